"""How each kernel is launched: every default in one table, one parser for overrides, and the
arithmetic that maps rows onto lanes and programs.

The defaults were measured on the H200 at DiT-XL/2's shapes (docs/kernels.md tells what each
measurement found). An override is an argument of the op that launches the kernel
(``aggregation.aggregate_triton(..., launch=)``, ``weighted_sums.weighted_sum_triton(..., launch=)``),
made from text by ``parse_launch`` for a tuning sweep (benchmarks/dar_kernel.py --launch). One value
follows the environment, once, at import: ``FUSED_REDUCE`` is off under ``TRITON_INTERPRET=1``, Triton's
own switch for its CPU interpreter (see the comment there). It is read here, and nowhere else in routekit,
so the launch defaults and the kernels agree on it; it changes how a kernel sums (one fused reduction or
separate ones), not what it computes.
No triton import: the benchmarks' command lines parse launches without it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from routekit.errors import ConfigError

# Triton's CPU interpreter runs a multi-operand tl.reduce element by element, far slower than separate
# tl.sum calls (the CPU kernel tests would take minutes), so the interpreter never fuses reductions. The
# variable is Triton's, read by Triton itself to decide whether kernels run in the interpreter; routekit
# only follows it (asking triton instead would need a triton import here).
FUSED_REDUCE = os.environ.get("TRITON_INTERPRET") != "1"


def _powers_of_two(what: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1 or value & (value - 1):
            raise ConfigError(f"{what} {name} must be a power of two, got {value}")


@dataclass(frozen=True)
class MergeLaunch:
    """A merge kernel's launch in one direction: warps per program, own sources per tile, whether the
    next row's first loads are issued before this row is computed, whether rows are held as a power-of-two
    head and tail of lanes (1024 + 128 at D=1152) rather than padded, and whether a tile's three row sums
    share one tl.reduce (backward only; the forward takes one source at a time)."""

    warps: int
    tile: int
    prefetch: bool
    split_rows: bool
    fused_reduce: bool = False

    def __post_init__(self) -> None:
        _powers_of_two("merge launch", warps=self.warps, tile=self.tile)

    def as_list(self) -> list[int]:
        return [self.warps, self.tile, int(self.prefetch), int(self.split_rows), int(self.fused_reduce)]

    @classmethod
    def from_list(cls, values: list[int]) -> MergeLaunch:
        warps, tile, prefetch, split_rows, fused_reduce = values
        return cls(warps, tile, bool(prefetch), bool(split_rows), bool(fused_reduce))


@dataclass(frozen=True)
class AggregateLaunch:
    """How one aggregation op launches whichever kernel runs it. The generic kernel: rows per program
    and, per direction, the sources reduced together (one cross-thread reduction serves a tile of them)
    and the warps per program, and whether a tile's row sums share one tl.reduce. A two-phase chunk's
    merge, where its own kernel takes it: ``merge_fwd`` and ``merge_bwd``."""

    block_rows: int
    fwd_sources: int
    fwd_warps: int
    bwd_sources: int
    bwd_warps: int
    fused_reduce: bool
    merge_fwd: MergeLaunch
    merge_bwd: MergeLaunch

    def __post_init__(self) -> None:
        _powers_of_two("launch", block_rows=self.block_rows, fwd_sources=self.fwd_sources,
                       bwd_sources=self.bwd_sources)
        for name in ("fwd_warps", "bwd_warps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"launch {name} must be at least 1, got {getattr(self, name)}")

    def generic(self) -> list[int]:
        """The generic kernel's six settings, in ``parse_launch("aggregate", ...)``'s order."""
        return [self.block_rows, self.fwd_sources, self.fwd_warps, self.bwd_sources, self.bwd_warps,
                int(self.fused_reduce)]

    def as_list(self) -> list[int]:
        """The form the custom ops take (their schema allows a list of ints, not this class)."""
        return self.generic() + self.merge_fwd.as_list() + self.merge_bwd.as_list()

    @classmethod
    def from_list(cls, values: list[int]) -> AggregateLaunch:
        return cls(*values[:5], bool(values[5]), MergeLaunch.from_list(values[6:11]),
                   MergeLaunch.from_list(values[11:16]))


@dataclass(frozen=True)
class WeightedSumLaunch:
    """Warps per program in each direction, and the programs each row is split among (each takes a
    1/split slice of its lanes; powers of two)."""

    fwd_warps: int
    bwd_warps: int
    fwd_split: int
    bwd_split: int

    def __post_init__(self) -> None:
        for name in ("fwd_warps", "bwd_warps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"weighted sum launch {name} must be at least 1, got {getattr(self, name)}")
        _powers_of_two("weighted sum launch", fwd_split=self.fwd_split, bwd_split=self.bwd_split)

    def as_list(self) -> list[int]:
        return [self.fwd_warps, self.bwd_warps, self.fwd_split, self.bwd_split]


DEFAULTS = {
    # The generic aggregation, by feature size: a program holds row tiles of ROW_TILE elements (one row
    # at D=1152, padded to 2048 lanes); per direction, sources per tile and elements per thread, which
    # set the warps for rows of any width.
    "aggregate": {"row_tile": 2048, "fwd_sources": 1, "fwd_per_thread": 64, "bwd_sources": 2, "bwd_per_thread": 32},
    # A chunk's merges: one warp a row, one source at a time, the next row in flight, 1024 + 128 lanes.
    "merge_fwd": MergeLaunch(warps=1, tile=1, prefetch=True, split_rows=True),
    "merge_bwd": MergeLaunch(warps=1, tile=1, prefetch=True, split_rows=True),
    # A chunk's shared part: forward on one warp a quarter of a row, backward one warp a whole row.
    "weighted_sum": WeightedSumLaunch(fwd_warps=1, bwd_warps=1, fwd_split=4, bwd_split=1),
}

# Backward programs per launch: several per SM to hide memory latency, few enough that each sums its
# query gradient over many rows; and the most sources for which a program walks several row tiles.
BWD_PROGRAMS = 4096
ROW_LOOP_MAX_SOURCES = 8


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def aggregate_launch(d: int, rows: int) -> AggregateLaunch:
    """The default launch of an aggregation of ``rows`` rows of ``d`` features (``DEFAULTS``)."""
    rule = DEFAULTS["aggregate"]
    block_d = next_power_of_2(d)
    block_r = max(1, min(rule["row_tile"] // block_d, next_power_of_2(rows)))
    size = block_r * block_d

    def warps(sources: int, per_thread: int) -> int:
        return max(1, min(16, sources * size // (32 * per_thread)))

    # Triton 3.6 fails to compile the fused reduction for some small tiles ("operand does not dominate
    # this use", seen at D=3); it is used only for the row shape measured on the H200
    fused = FUSED_REDUCE and block_d == 2048 and block_r == 1
    return AggregateLaunch(block_r, rule["fwd_sources"], warps(rule["fwd_sources"], rule["fwd_per_thread"]),
                           rule["bwd_sources"], warps(rule["bwd_sources"], rule["bwd_per_thread"]), fused,
                           DEFAULTS["merge_fwd"], DEFAULTS["merge_bwd"])


def _aggregate(values: list[int]) -> AggregateLaunch:
    return AggregateLaunch(*values[:5], bool(values[5]), DEFAULTS["merge_fwd"], DEFAULTS["merge_bwd"])


# kind: (what the text lists, an example, how the values become a launch)
FORMS = {
    "aggregate": ("rows,fwd_sources,fwd_warps,bwd_sources,bwd_warps,fused_reduce", "1,1,1,2,4,1", _aggregate),
    "merge_fwd": ("warps,tile,prefetch,split_rows,fused_reduce", "4,1,1,1,0", MergeLaunch.from_list),
    "merge_bwd": ("warps,tile,prefetch,split_rows,fused_reduce", "4,1,1,1,0", MergeLaunch.from_list),
    "weighted_sum": ("fwd_warps,bwd_warps,fwd_split,bwd_split", "4,1,1,2", lambda v: WeightedSumLaunch(*v)),
}


def parse_launch(kind: str, text: str) -> AggregateLaunch | MergeLaunch | WeightedSumLaunch:
    """The launch of ``kind`` (a key of ``FORMS``) that ``text``, comma-separated integers, names; for
    "aggregate" the generic kernel's settings, with the default merge launches. A ConfigError says the
    expected form."""
    if kind not in FORMS:
        raise ConfigError(f"unknown launch kind {kind!r}; valid kinds are {', '.join(FORMS)}")
    form, example, build = FORMS[kind]
    count = form.count(",") + 1
    try:
        values = [int(v) for v in text.split(",")]
        if len(values) != count:
            raise ValueError(f"got {len(values)} values")
        return build(values)
    except ValueError as exc:  # ConfigError is a ValueError too
        raise ConfigError(f"{kind} launch {text!r}: expected {count} integers {form}, e.g. {example} ({exc})") from None


def head_tail(d: int) -> tuple[int, int]:
    """A row of d lanes as a power-of-two head and tail ((1024, 128) for 1152), or (padded d, 0)
    where that saves no lanes (d a power of two, or a tail as long as the head)."""
    head = 1 << (d.bit_length() - 1)
    tail = next_power_of_2(d - head) if d > head else 0
    return (head, tail) if tail and head + tail < next_power_of_2(d) else (next_power_of_2(d), 0)


def lane_split(d: int) -> tuple[int, int]:
    """``head_tail`` for kernels that always take a tail: a one-lane tail past D, masked off, where the
    row needs none."""
    head, tail = head_tail(d)
    return head, max(tail, 1)


def sample_split(b: int, n: int, block_r: int, sources: int = 1, programs: int = BWD_PROGRAMS) -> tuple[int, int]:
    """(programs per sample, row tiles per program) for a backward grid of about ``programs``.
    Walking several row tiles per program saves the query-gradient bytes (one fp32 row per row tile
    otherwise) but leaves fewer programs to hide latency: worth it for a few sources (a chunk's
    merges), not for many, where those bytes are a few percent of the sources'."""
    tiles = cdiv(n, block_r)
    if sources > ROW_LOOP_MAX_SOURCES:
        return tiles, 1
    splits = min(tiles, max(1, cdiv(programs, b)))
    iters = cdiv(tiles, splits)
    return cdiv(tiles, iters), iters


_DEFAULT_LAUNCHES: dict[tuple[int, int], list[int]] = {}


@torch.compiler.assume_constant_result
def _default_launch(d: int, rows: int) -> list[int]:
    """``aggregate_launch(d, rows)`` as the op takes it, made once per shape: a constant to torch.compile, which
    would otherwise trace the rule (and build its dataclasses) at every aggregation of a model."""
    if (d, rows) not in _DEFAULT_LAUNCHES:
        _DEFAULT_LAUNCHES[d, rows] = aggregate_launch(d, rows).as_list()
    return _DEFAULT_LAUNCHES[d, rows]


def launch_list(d: int, rows: int, launch: AggregateLaunch | None) -> list[int]:
    """The launch an aggregation runs (``launch``, else the default for its shape) as the op takes it."""
    if launch is not None:
        return launch.as_list()  # an AggregateLaunch is valid by construction
    if isinstance(rows, int):  # a symbolic row count (a compiled model's dynamic batch) cannot be a constant
        return _default_launch(d, rows)
    return aggregate_launch(d, rows).as_list()
