"""DiM / ZigMa style backbone: Mamba-2 blocks under adaLN-Zero, in plain PyTorch, no routing code.

A block is adaLN modulation around a Mamba-2 mixer (Dao & Gu 2024): one input projection to
z, x, B, C and dt; a short depthwise causal conv over (x, B, C); the SSD scan with one scalar
decay per head; the output gated by silu(z) and RMS-normalised; an output projection. Scans run
forward in even blocks and reversed in odd ones (DiM's alternating directions), optionally in
zig-zag order over the token grid (ZigMa: every odd grid row reversed, so consecutive tokens stay
neighbours). A block stores the grid width W and takes H' = N' // W rows from its token count, so it
stays valid when a routekit row route hands it whole rows only; without zig-zag it needs no grid.

Sizes: DiT widths, twice DiT's depth and no MLP sublayer (mlp_ratio=0), the usual Mamba
convention: a mixer block has about 9·D² parameters, half a transformer block, so S/2 (384×24,
34 M) and B/2 (768×24, 133 M) match DiT-S/2 and DiT-B/2 in parameters. DiM's published models
are larger. mlp_ratio > 0 adds DiT's MLP as a second sublayer with its own adaLN gate.

Scan implementations (`backbones.ops.ssd`): mamba-ssm's Triton SSD kernel for CUDA tensors when it
imports (wrapped as the custom op `backbones::mamba_ssd`, so torch.compile sees one node), else the
pure-PyTorch chunked SSD; set `SSD_IMPL` to force one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import sys
import types
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .dit import Mlp, PatchDenoiser, modulate
from .dit import example_inputs as example_inputs
from .dit import grid as grid
from .ops.grid import snake
from .ops.ssd import ssd_chunked, ssd_reference

SIZES: dict[str, dict] = {
    "S/2": dict(depth=24, hidden=384, patch=2),
    "B/2": dict(depth=24, hidden=768, patch=2),
}

SSD_IMPL: str | None = None  # None: "kernel" for CUDA tensors when mamba-ssm imports, else "chunked"

INSTALL_HINT = (
    "mamba-ssm's Triton SSD kernel is not importable ({error}). Install the package without "
    "compiling its CUDA extension (only its Triton kernels are used here): "
    "`MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation mamba-ssm`; "
    "it also needs triton and einops. Or leave SSD_IMPL=None to use the pure-PyTorch chunked scan.")


@functools.cache
def _load_kernel() -> tuple[types.ModuleType | None, str]:
    """The one place that imports mamba-ssm: (its Triton SSD module, "") or (None, why not).

    `import mamba_ssm` runs its package __init__, which imports the compiled selective-scan
    extension unconditionally, so an install without that extension fails there even though the
    Triton SSD kernels we use are pure Python. When the plain import fails we load the kernel
    module under a bare stand-in for the package, which skips that __init__, then remove the stand-in.
    """
    name = "mamba_ssm.ops.triton.ssd_combined"
    try:
        return importlib.import_module(name), ""
    except (ImportError, OSError) as err:
        error = f"{type(err).__name__}: {err}"
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or not spec.submodule_search_locations:
        return None, error
    bare = types.ModuleType("mamba_ssm")
    bare.__path__ = list(spec.submodule_search_locations)
    sys.modules["mamba_ssm"] = bare
    try:
        return importlib.import_module(name), ""
    except (ImportError, OSError) as err:
        return None, f"{error}; without its __init__: {type(err).__name__}: {err}"
    finally:
        if sys.modules.get("mamba_ssm") is bare:
            del sys.modules["mamba_ssm"]


def _kernel_module() -> types.ModuleType:
    kernels, error = _load_kernel()
    if kernels is None:
        raise ImportError(INSTALL_HINT.format(error=error))
    return kernels


def _scan_forward(x, dt, A, B, C, chunk):
    """mamba-ssm's SSD forward: (y,)."""
    return (_kernel_module()._mamba_chunk_scan_combined_fwd(x, dt, A, B, C, chunk)[0],)


def _scan_backward(dout, x, dt, A, B, C, out, chunk):
    """mamba-ssm's SSD backward: the gradients of x, dt, A, B and C."""
    grads = _kernel_module()._mamba_chunk_scan_combined_bwd(dout, x, dt, A, B, C, out, chunk)
    return tuple(g.contiguous() for g in grads[:5])


# mamba-ssm's entry point is an autograd.Function around autotuned Triton launches, all of which Dynamo
# must trace to compile a model, and a compiled DiM broke into pieces at the scan that CUDA graphs cannot
# hold, its step bound by the Python that launches some forty kernels a block. As a custom op with its
# own backward (the same forward and backward functions the Function calls, so the same numbers) the
# scan is one opaque node: the model compiles whole and CUDA graphs capture the kernels.
@torch.library.custom_op("backbones::mamba_ssd", mutates_args=())
def _mamba_ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
               chunk: int) -> torch.Tensor:
    return _scan_forward(x, dt, A, B, C, chunk)[0]


@_mamba_ssd.register_fake
def _(x, dt, A, B, C, chunk):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("backbones::mamba_ssd_backward", mutates_args=())
def _mamba_ssd_backward(dout: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                        B: torch.Tensor, C: torch.Tensor, out: torch.Tensor,
                        chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _scan_backward(dout, x, dt, A, B, C, out, chunk)


@_mamba_ssd_backward.register_fake
def _(dout, x, dt, A, B, C, out, chunk):
    dx, ddt, dB, dC = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (x, dt, B, C))
    return dx, ddt, torch.empty_like(A, dtype=torch.float32), dB, dC  # mamba-ssm's dA is fp32 whatever A is


def _save_for_backward(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:5], output)
    ctx.chunk = inputs[5]


def _mamba_ssd_grads(ctx, dout):
    return (*torch.ops.backbones.mamba_ssd_backward(dout.contiguous(), *ctx.saved_tensors, ctx.chunk), None)


_mamba_ssd.register_autograd(_mamba_ssd_grads, setup_context=_save_for_backward)


# Eager, the scan runs through a plain autograd.Function over the same two functions: the custom op's dispatch
# and its generated backward were host work an eager step waited on (~0.7 ms a block at batch 64 on an H200).
# And mamba-ssm launches some twenty autotuned Triton kernels a block from Python (its backward ~2.3 ms of host
# time a block there, more than a routed block's kernels take), so on CUDA each direction is replayed from a CUDA
# graph captured once per input signature (`_Replay`): one launch where there were twenty.
class _Replay:
    """`fn` of CUDA tensors of one signature, replayed from a CUDA graph: the inputs are copied into the graph's
    own and its outputs cloned out (~0.2 ms of copies a block at DiM-B/2's batch 64, against ~3 ms of launches).
    Captured with autocast off: mamba-ssm's host code calls no op autocast changes."""

    def __init__(self, fn: Callable, inputs: list[torch.Tensor], chunk: int):
        self.inputs = [t.detach().clone(memory_format=torch.contiguous_format) for t in inputs]
        device = inputs[0].device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.autocast("cuda", enabled=False):
            fn(*self.inputs, chunk)  # autotunes and compiles the kernels, outside the capture
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"), torch.autocast("cuda", enabled=False):
            self.outputs = fn(*self.inputs, chunk)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for mine, given in zip(self.inputs, inputs):
            mine.copy_(given)
        self.graph.replay()
        return tuple(out.clone() for out in self.outputs)


REPLAYS_KEPT = 16  # captured signatures kept per direction (a routed DiM meets two token counts, eval a third)
_replays: dict[tuple, _Replay | None] = {}


def _replayed(fn: Callable, inputs: list[torch.Tensor], chunk: int) -> tuple[torch.Tensor, ...]:
    """`fn(*inputs, chunk)`, from its CUDA graph where the inputs are CUDA tensors and no capture is under way
    (a model captured whole runs the kernels into that capture); directly where a capture failed (warned once)."""
    if not inputs[0].is_cuda or torch.cuda.is_current_stream_capturing():
        return fn(*inputs, chunk)
    key = (fn, chunk, inputs[0].device, *((t.shape, t.dtype) for t in inputs))
    replay = _replays.pop(key, False)  # popped and put back: the dict's order is least recently used first
    if replay is False:
        if len(_replays) >= 2 * REPLAYS_KEPT:
            del _replays[next(iter(_replays))]
        try:
            replay = _Replay(fn, inputs, chunk)
        except RuntimeError as err:
            warnings.warn(f"the SSD scan's {fn.__name__} runs without a CUDA graph: capturing it failed ({err})",
                          stacklevel=3)
            replay = None
    _replays[key] = replay
    return fn(*inputs, chunk) if replay is None else replay(*inputs)


class _EagerScan(torch.autograd.Function):
    """`backbones::mamba_ssd` and its backward without the custom-op dispatch, for eager mode (under
    torch.compile the custom op is used, one opaque node that Inductor and CUDA graphs take whole)."""

    @staticmethod
    def forward(ctx, x, dt, A, B, C, chunk):
        (out,) = _replayed(_scan_forward, [x, dt, A, B, C], chunk)
        ctx.save_for_backward(x, dt, A, B, C, out)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*_replayed(_scan_backward, [dout.contiguous(), *ctx.saved_tensors], ctx.chunk), None)


def mamba_kernel() -> Callable:
    """mamba-ssm's Triton SSD scan as a custom op, (x, dt, A, B, C, chunk) -> y, or an ImportError that
    says how to install it. Inputs must be contiguous."""
    _kernel_module()
    return torch.ops.backbones.mamba_ssd


@torch.compiler.assume_constant_result
def _kernel_error() -> str:
    """"" when mamba-ssm's kernels import, else why not. A constant to Dynamo, which cannot trace the
    import: tracing it broke a compiled model's graph at every block."""
    return _load_kernel()[1]


def ssd_impl(cuda: bool) -> str:
    """The SSD implementation a scan on CUDA (or CPU) tensors runs: SSD_IMPL, else the kernel on CUDA
    when mamba-ssm imports, else the chunked scan."""
    if SSD_IMPL is not None:
        return SSD_IMPL
    return "kernel" if cuda and not _kernel_error() else "chunked"


def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
        chunk: int) -> torch.Tensor:
    """The SSD scan by the implementation SSD_IMPL names, or the best one for x's device."""
    name = ssd_impl(x.is_cuda)
    if SSD_IMPL is None and x.is_cuda and name == "chunked":
        warnings.warn(INSTALL_HINT.format(error=_kernel_error()), stacklevel=2)
    if name == "kernel":
        args = (x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(), chunk)
        if torch.compiler.is_compiling():
            return torch.ops.backbones.mamba_ssd(*args)
        _kernel_module()
        return _EagerScan.apply(*args)
    if name == "chunked":
        return ssd_chunked(x, dt, A, B, C, chunk)
    if name == "reference":
        return ssd_reference(x, dt, A, B, C)
    raise ValueError(f"unknown SSD_IMPL {name!r}; valid: 'kernel', 'chunked', 'reference' "
                     "or None (by device)")


class Mamba2Mixer(nn.Module):
    """Mamba-2 token mixer over a sequence (B, L, D) in scan order; causal along L.

    Defaults follow Mamba-2 (expand 2, head dim 64, one group of B/C, conv width 4, A ~ U[1, 16]
    per head, dt log-uniform in [1e-3, 1e-1] through its bias) except d_state 64 instead of 128,
    plenty for 256-token images. `chunk` is the SSD chunk length of both the kernel and the
    pure-PyTorch scan.
    """

    def __init__(self, hidden: int, d_state: int = 64, headdim: int = 64, expand: int = 2,
                 d_conv: int = 4, chunk: int = 64):
        super().__init__()
        inner = expand * hidden
        if inner % headdim:
            raise ValueError(f"expand * hidden = {inner} must be a multiple of headdim {headdim}")
        self.inner, self.d_state, self.headdim, self.chunk = inner, d_state, headdim, chunk
        self.heads = inner // headdim
        conv_dim = inner + 2 * d_state
        self.in_proj = nn.Linear(hidden, inner + conv_dim + self.heads, bias=False)  # z, (x, B, C), dt
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1)
        dt = torch.exp(torch.empty(self.heads).uniform_(math.log(1e-3), math.log(1e-1)))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.empty(self.heads).uniform_(1, 16).log())
        self.D = nn.Parameter(torch.ones(self.heads))
        self.norm = nn.RMSNorm(inner, eps=1e-5)
        self.out_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        length = u.shape[1]
        z, xbc, dt = self.in_proj(u).split([self.inner, self.inner + 2 * self.d_state, self.heads], dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :length].transpose(1, 2))  # causal: first L
        x, B, C = xbc.split([self.inner, self.d_state, self.d_state], dim=-1)
        x = x.unflatten(-1, (self.heads, self.headdim))
        dt = F.softplus(dt + self.dt_bias)
        A = -torch.exp(self.A_log.float())
        y = ssd(x, dt, A, B.unsqueeze(2), C.unsqueeze(2), self.chunk) + x * self.D[:, None]
        return self.out_proj(self.norm(y.flatten(2) * F.silu(z)))


class DiMBlock(nn.Module):
    """Mamba-2 block conditioned on c (B, D) through adaLN-Zero; one gated residual add per sublayer.

    `reverse`: scan from the last token to the first. `zigzag`: scan the grid in snake order, which
    needs the grid, so then x must be (B, N', D) with N' = H'·W.
    """

    def __init__(self, hidden: int, width: int, *, reverse: bool, zigzag: bool, mlp_ratio: float = 0.0,
                 **mixer_options):
        super().__init__()
        self.width, self.reverse, self.zigzag = width, reverse, zigzag
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mixer = Mamba2Mixer(hidden, **mixer_options)
        self.mlp = Mlp(hidden, mlp_ratio) if mlp_ratio > 0 else None
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6) if mlp_ratio > 0 else None
        self.sublayers = 2 if mlp_ratio > 0 else 1
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 3 * self.sublayers * hidden))

    def scan(self, x: torch.Tensor) -> torch.Tensor:
        """The mixer applied in this block's token order, the result put back in grid order."""
        if self.zigzag:
            x = snake(x, self.width)  # refuses partial rows
        if self.reverse:
            x = x.flip(1)
        x = self.mixer(x)
        if self.reverse:
            x = x.flip(1)
        if self.zigzag:
            x = snake(x, self.width)  # snake order is its own inverse
        return x

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        mod = self.adaLN_modulation(c).unsqueeze(1).chunk(3 * self.sublayers, dim=-1)  # each (B, 1, D)
        x = x + mod[2] * self.scan(modulate(self.norm1(x), mod[0], mod[1]))
        if self.mlp is not None:
            x = x + mod[5] * self.mlp(modulate(self.norm2(x), mod[3], mod[4]))
        return x


class DiM(PatchDenoiser):
    """Class-conditional diffusion Mamba: DiT's embedders and output layer around Mamba-2 blocks that
    alternate scan direction (odd blocks reversed), optionally in zig-zag order over the grid."""

    def __init__(self, depth: int, hidden: int, patch: int, mlp_ratio: float = 0.0, zigzag: bool = True,
                 input_size: int | tuple[int, int] = 32, in_channels: int = 4, num_classes: int = 1000,
                 learn_sigma: bool = False, class_dropout: float = 0.1, **mixer_options):
        def make_block(i: int, grid: tuple[int, int]) -> DiMBlock:
            return DiMBlock(hidden, grid[1], reverse=i % 2 == 1, zigzag=zigzag, mlp_ratio=mlp_ratio, **mixer_options)

        super().__init__(make_block, depth, hidden, patch, input_size=input_size, in_channels=in_channels,
                         num_classes=num_classes, learn_sigma=learn_sigma, class_dropout=class_dropout)


def build(size: str = "S/2", **overrides) -> DiM:
    """DiM of a named size ("S/2", "B/2"); overrides replace any constructor or mixer argument."""
    if size not in SIZES:
        raise ValueError(f"unknown DiM size {size!r}; valid sizes: {', '.join(SIZES)}")
    return DiM(**{**SIZES[size], **overrides})


def DiM_S_2(**overrides) -> DiM:
    """DiM S/2: ``build("S/2", **overrides)``."""
    return build("S/2", **overrides)


def DiM_B_2(**overrides) -> DiM:
    """DiM B/2: ``build("B/2", **overrides)``."""
    return build("B/2", **overrides)
