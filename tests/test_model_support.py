"""Models people train today (tests/zoo.py), each routed, verified, counted and given DAR; and docs/models.md's
model-support table, which this test builds and holds docs/models.md to.

For each model: `inspect` finds it in graph mode with the block stack and the special tokens expected; a
route applies in graph and in boundary mode and `verify` passes in both; a routed train step's FLOPs (torch's
FLOP counter, forward + backward, attention on the CPU included) match the plan within 5%: the original step's,
less, for each routed block, its FLOPs on all tokens minus on the kept count (each block run alone on its
captured inputs, cut as the plan cuts them); gradients reach every parameter they reached before; DAR applies
and trains.

    python tests/test_model_support.py      # rewrite docs/models.md's table from a fresh run
"""

from __future__ import annotations

import inspect
import math
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zoo  # noqa: E402
from zoo import ZOO, Missing  # noqa: E402

import routekit as rk  # noqa: E402
from benchmarks.common import flop_counter_mode  # noqa: E402
from routekit.decision import Plan  # noqa: E402
from routekit.model import original_forward, report_of  # noqa: E402
from routekit.routing import gather_tokens, route_side  # noqa: E402
from routekit.state import fresh  # noqa: E402

TABLE_PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"
START, END = "<!-- model-support: built by tests/test_model_support.py -->", "<!-- model-support end -->"
ROWS: dict[str, dict] = {}


def loss_of(out) -> torch.Tensor:
    """A squared loss over every floating output (a block of a joint stack returns its text stream too)."""
    return sum(t.float().pow(2).mean() for t in pytree.tree_leaves(out)
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad)


def step_flops(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """FLOPs of one forward + backward of a squared-output loss."""
    model.zero_grad(set_to_none=True)
    with flop_counter_mode() as counter:
        loss_of(model(*args, **kwargs)).backward()
    return counter.get_total_flops()


def reached(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}


def planned_flops(model: nn.Module, plan: Plan, args: tuple, kwargs: dict) -> int:
    """What a routed step should cost: the original step's FLOPs, less what each routed block saves on the kept
    tokens (each block run alone on its own inputs, the stream and side inputs cut to the kept count)."""
    report, placed = plan.report, plan.placed[0]
    calls, handles = {}, []
    for b in report.blocks[placed.start:placed.end + 1]:  # a copy of each call: the run goes on to fill a cache
        hook = (lambda name: lambda m, a, kw: calls.setdefault(name, fresh((a, kw))) and None)(b.qualname)  # noqa: B023
        handles.append(model.get_submodule(b.qualname).register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad(), original_forward(model):  # each block's inputs as the original forward hands them
        model(*args, **kwargs)
    for h in handles:
        h.remove()
    saved = 0
    for b in report.blocks[placed.start:placed.end + 1]:
        a, kw = pytree.tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, calls[b.qualname])
        slot = report.stack_of(b.index).stream_slot
        stream = a[slot] if isinstance(slot, int) else kw[slot]
        for sign, tokens in ((1, report.stack_of(b.index).tokens), (-1, placed.kept_at(b.stack))):
            index = torch.arange(tokens).expand(stream.shape[0], tokens)
            values = dict(enumerate(a)) | dict(kw)
            values[slot] = gather_tokens(stream, index).detach().requires_grad_()
            for side in b.side_inputs:
                values[side.slot] = route_side(values[side.slot], stream, index, placed.cuts(side, b.stack),
                                               placed.shared)
            call_args, call_kwargs = fresh(([values[i] for i in range(len(a))],
                                            {k: v for k, v in values.items() if isinstance(k, str)}))
            with flop_counter_mode() as counter:
                loss_of(model.get_submodule(b.qualname)(*call_args, **call_kwargs)).backward()
            saved += counter.get_total_flops() * sign
    with original_forward(model):
        return step_flops(model, args, kwargs) - saved


def without_cache(model: nn.Module, kwargs: dict) -> dict:
    """The call's keyword arguments without a generation cache, where the forward takes one: FLOPs are counted
    without it (a block run alone on a captured cache would attend over the keys the rest of the run put there;
    the cache's copies count no FLOPs either way)."""
    if "use_cache" in inspect.signature(type(model).forward).parameters:
        return {**kwargs, "use_cache": False}
    return kwargs


def check(name: str) -> dict:
    """Route, verify, count and give DAR to one model of the zoo; the docs/models.md row of what held."""
    entry = ZOO[name]
    torch.manual_seed(0)
    model, args, kwargs = entry.build()
    with warnings.catch_warnings(record=True) as fell_back:
        warnings.simplefilter("always", rk.FallbackWarning)
        plan = rk.inspect(model, args, kwargs, **entry.options)
    fell_back = [w for w in fell_back if issubclass(w.category, rk.FallbackWarning)]
    assert plan.mode == entry.mode and bool(fell_back) == (entry.mode == "boundary"), plan.fallback
    assert plan.stack == entry.stack and plan.special == entry.special, plan
    assert plan.report.reordered is None, plan.report.reordered  # every zoo grid reaches its blocks row by row
    route = rk.Route(**entry.route)
    row = {"model": name, "tokens": plan.tokens, "mode": plan.mode}
    for mode in ("graph", "boundary") if entry.mode == "graph" else ("boundary",):
        routed = rk.apply(model, route, example_inputs=args, example_kwargs=kwargs, mode=mode, **entry.options)
        rk.verify(model, routed, args, kwargs)
        placed = report_of(routed).placed[0]
        assert placed.keep == tuple(i % plan.tokens for i in entry.special), mode
        routed.train()
        torch.manual_seed(0)
        routed(*args, **kwargs)
        mask = rk.last_route_mask(routed)  # the tokens this forward routed: never one the owner added
        assert mask.any() and not mask[:, list(placed.keep)].any(), mode
    kwargs = without_cache(model, kwargs)
    rk.strip(model)  # the routes off: the original step
    model.train()
    original = step_flops(model, args, kwargs)
    before = reached(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.FallbackWarning)  # said above, for boundary-mode models
        routed = rk.apply(model, route, example_inputs=args, example_kwargs=kwargs, **entry.options).train()
    measured = step_flops(routed, args, kwargs)
    assert reached(routed) == before, f"gradients stopped reaching {sorted(before - reached(routed))[:5]}"
    plan_ratio = planned_flops(model, report_of(routed), args, kwargs) / original
    ratio = measured / original
    assert abs(ratio / plan_ratio - 1) < 0.05, \
        f"{name}: a routed step costs {ratio:.4f} of the original FLOPs, the plan {plan_ratio:.4f}"
    if any(s.tokens != plan.stacks[0].tokens for s in plan.stacks):  # text joined in between two stacks
        with pytest.raises(rk.ConfigError, match="give DAR one stack"):
            rk.apply(model, residual=rk.DAR(), example_inputs=args, example_kwargs=kwargs, **entry.options)
        row["dar"] = "one stack at a time"
    elif entry.mode == "graph":
        # on the model as built: the calls above leave the library's own hooks on its blocks (transformers
        # records hidden states with hooks it adds on the first call that asks), and DAR calls a hooked block whole
        torch.manual_seed(0)
        model, args, kwargs = entry.build()
        kwargs = without_cache(model, kwargs)
        dar = rk.apply(model, residual=rk.DAR(chunk=2), example_inputs=args, example_kwargs=kwargs,
                       **entry.options).train()
        loss_of(dar(*args, **kwargs)).backward()
        assert dar.routekit.dar.query.grad is not None and torch.isfinite(dar.routekit.dar.query.grad).all()
        row["dar"] = f"{report_of(dar).dar.points} points"
    else:
        with pytest.raises(rk.ConfigError, match="needs graph mode"):
            rk.apply(model, residual=rk.DAR(), example_inputs=args, example_kwargs=kwargs, **entry.options)
        row["dar"] = "needs graph mode"
    notes = []
    if placed.keep:
        notes.append(f"keeps tokens {list(placed.keep)} (found)")
    if placed.shared:
        notes.append("one selection per batch (a table without a batch axis)")
    if placed.shrink:
        notes.append("grid sizes passed to the blocks shrink")
    if plan.report.residual not in ("sublayer", None):
        notes.append(f"DAR at {plan.report.residual} granularity")
    row.update(stack=plan.stack, grid="×".join(map(str, plan.grid)) if plan.grid else "–", route=str(route_text(route)),
               flops=f"{ratio:.3f} / {plan_ratio:.3f}", notes="; ".join(notes) or "–")
    return row


def route_text(route: rk.Route) -> str:
    return f"{route.start}→{route.end} {route.selector}"


def table(rows: list[dict]) -> str:
    lines = ["| model | stack (tokens, grid) | mode | route | verify | train FLOPs: measured / plan | DAR | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | `{r['stack']}` ({r['tokens']}, {r['grid']}) | {r['mode']} | {r['route']} | "
                     f"eval, train, kept tokens | {r['flops']} | {r['dar']} | {r['notes']} |")
    return "\n".join(lines)


def readme_rows() -> dict[str, str]:
    text = TABLE_PAGE.read_text()
    body = text[text.index(START) + len(START):text.index(END)]
    return {m.group(1): line for line in body.splitlines() if (m := re.match(r"\| (.+?) \| `", line))}


@pytest.mark.parametrize("name", list(ZOO))
def test_the_model_routes_verifies_saves_the_planned_flops_and_takes_dar(name: str) -> None:
    torch.set_num_threads(1)
    try:
        ROWS[name] = check(name)
    except Missing as err:
        pytest.skip(str(err))


@pytest.mark.one_end
@pytest.mark.parametrize("name", list(ZOO))
def test_the_model_in_bf16_trains_with_its_route_and_dar(name: str) -> None:
    """The zoo runs in fp32 above; people train in bf16, where sublayers can give outputs of two dtypes (Wan
    gates in fp32) and every rewritten add must hand on the dtype its readers expect. Route and DAR together,
    which `verify` checks against DAR alone."""
    entry = ZOO[name]
    torch.manual_seed(0)
    try:
        model, args, kwargs = entry.build()
    except Missing as err:
        pytest.skip(str(err))
    to_bf16 = lambda v: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    model, args, kwargs = model.to(torch.bfloat16), pytree.tree_map(to_bf16, args), pytree.tree_map(to_bf16, kwargs)
    torch.set_num_threads(1)
    plan = rk.inspect(model, args, kwargs, **entry.options)
    joined = any(s.tokens != plan.stacks[0].tokens for s in plan.stacks)  # DAR takes one stack there
    dar = rk.DAR(chunk=3) if entry.mode == "graph" and not joined else None  # DAR needs graph mode
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rk.FallbackWarning)
        routed = rk.apply(model, rk.Route(**entry.route), residual=dar, example_inputs=args, example_kwargs=kwargs,
                          **entry.options).train()
    loss = loss_of(routed(*args, **kwargs))
    loss.backward()
    assert torch.isfinite(loss) and (dar is None or torch.isfinite(routed.routekit.dar.query.grad).all())
    assert ("matches DAR without routes" if dar else "bit-identical") in rk.verify(model, routed, args, kwargs).train


def test_the_readme_table_is_what_this_run_measured() -> None:
    """Each model this run could build has the docs/models.md row it measured (rows of packages absent here are not
    compared); regenerate with `python tests/test_model_support.py`."""
    if not ROWS:
        pytest.skip("no model of the zoo ran in this process")
    written = readme_rows()
    for name, row in ROWS.items():
        line = table([row]).splitlines()[-1]
        assert written.get(name) == line, f"docs/models.md's row for {name} is stale; run python tests/test_model_support.py"
    assert set(written) == set(ZOO), "docs/models.md's table must list every model of the zoo"


if __name__ == "__main__":
    rows = []
    for name in ZOO:
        print(f"{name} ...", flush=True)
        try:
            rows.append(check(name))
        except Missing as err:
            sys.exit(f"cannot build {name}: {err}; run this where every package of the zoo imports")
    text = TABLE_PAGE.read_text()
    head, tail = text[:text.index(START) + len(START)], text[text.index(END):]
    TABLE_PAGE.write_text(f"{head}\n{table(rows)}\n{tail}")
    print(table(rows))


@pytest.mark.parametrize(("name", "selector", "mode"), [
    ("diffusers Wan", "row", "auto"), ("diffusers Wan", "frame", "auto"), ("diffusers Wan", "tube", "auto"),
    ("diffusers LTX-Video (image to video)", "row", "auto"), ("diffusers LTX-Video (image to video)", "frame", "boundary"),
    ("diffusers CogVideoX", "row", "auto"), ("diffusers CogVideoX", "frame", "auto"),
])
def test_a_video_model_routes_whole_rows_frames_or_tubes(name: str, selector: str, mode: str) -> None:
    """Wan's patch embedding is a Conv3d: its T×H×W grid is read off it. LTX-Video's latents come packed, (B, T·H·W,
    C): its grid is the sizes its pipeline names in the call (`num_frames`, `height`, `width`). CogVideoX embeds
    its (B, T, C, H, W) latents frame by frame: its grid is the latents over the patch, measured. Either way the
    video selectors route it, in both modes."""
    try:
        model, args, kwargs = ZOO[name].build()
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    routed = rk.apply(model, rk.Route(start=1, end=4, selector=selector), example_inputs=args, example_kwargs=kwargs,
                      mode=mode)
    assert report_of(routed).grid == (2, 4, 4)
    rk.verify(model, routed, args, kwargs)
    routed.train()
    routed(*args, **kwargs)
    kept = ~rk.last_route_mask(routed).reshape(2, 2, 4, 4)
    if selector == "frame":
        assert (kept.flatten(2).all(2) | ~kept.flatten(2).any(2)).all()
    if selector == "row":
        assert (kept.all(3) | ~kept.any(3)).all()
    if selector == "tube":
        assert (kept == kept[:, :1]).all()


def _ltx_at(kwargs: dict, frames: int, height: int, width: int) -> tuple[tuple, dict]:
    latents = torch.randn(2, 4, frames, height, width).permute(0, 2, 3, 4, 1).flatten(1, 3)
    conditioning = torch.zeros(2, frames * height * width)
    conditioning[:, :height * width] = 1.0
    return (latents,), {**kwargs, "num_frames": frames, "height": height, "width": width,
                        "timestep": torch.tensor([300.0, 700.0])[:, None] * (1 - conditioning)}


def _qwenimage_at(kwargs: dict, frames: int, height: int, width: int) -> tuple[tuple, dict]:
    return (torch.randn(2, height * width, 16),), {**kwargs, "img_shapes": [[(frames, height, width)]] * 2}


@pytest.mark.parametrize("mode", ["graph", "boundary"])
@pytest.mark.parametrize(("build", "call_at", "grid", "other"), [
    (zoo.diffusers_ltx_video, _ltx_at, (2, 4, 4), (2, 2, 8)),
    (zoo.diffusers_qwenimage, _qwenimage_at, (4, 4), (1, 2, 8)),
])
def test_a_grid_the_call_names_follows_the_call_at_another_aspect_in_both_modes(mode, build, call_at, grid, other):
    """LTX-Video's grid is the sizes its call names (`num_frames`, `height`, `width`), QwenImage's the one shape
    per sample its `img_shapes` names (it had none: `row` asked for grid=). A call of as many tokens at another
    aspect must route that call's rows: boundary mode kept the example's grid for every call, and routed rows of 4
    out of rows of 8."""
    try:
        model, args, kwargs = build()
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    routed = rk.apply(model, rk.Route(start=1, end=4, selector="row"), example_inputs=args, example_kwargs=kwargs,
                      mode=mode)
    assert report_of(routed).grid == grid
    rk.verify(model, routed, args, kwargs)
    routed.train()
    args, kwargs = call_at(kwargs, *other)
    for _ in range(3):
        routed(*args, **kwargs)
        routed_around = rk.last_route_mask(routed).reshape(2, *other)
        assert (routed_around.all(-1) | ~routed_around.any(-1)).all()
        assert routed_around.all(-1).flatten(1).sum(1).tolist() == [math.prod(other[:-1]) // 2] * 2


@pytest.mark.parametrize(("build", "selector", "grid"), [
    (zoo.diffusers_hidream, "row", (4, 4)), (zoo.diffusers_mochi, "row", (2, 4, 4)),
    (zoo.diffusers_mochi, "frame", (2, 4, 4)),
])
def test_a_model_whose_grid_no_patch_embedding_shows_gets_it_measured_and_routes_its_lines(build, selector, grid):
    """HiDream patchifies its latents by reshaping, Mochi embeds video frames one by one: no (B, C, H, W) output of
    theirs has a cell per token, so grid selectors asked for grid=. The image over the patch is their grid where
    measuring finds every token made from one of its cells, and whole rows (frames) are kept."""
    try:
        model, args, kwargs = build()
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    routed = rk.apply(model, rk.Route(start=1, end=4, selector=selector), example_inputs=args, example_kwargs=kwargs)
    assert report_of(routed).grid == grid and report_of(routed).report.reordered is None
    rk.verify(model, routed, args, kwargs)
    routed.train()
    routed(*args, **kwargs)
    kept = ~rk.last_route_mask(routed).reshape(2, -1, grid[-1])  # (B, rows of every frame, W)
    assert (kept.all(2) | ~kept.any(2)).all() and kept.any()


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_a_grid_selector_follows_another_square_size_of_hidream_and_refuses_a_padded_one_by_the_example(mode):
    """HiDream patchifies a square image into its grid's tokens, and pads one that is not square into a longer
    sequence that no grid makes. Another square size routes that size's rows; a padded call is refused, saying
    why (it said no patch embedding was found and asked for grid=, which cannot help)."""
    try:
        model, args, kwargs = zoo.diffusers_hidream()
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    routed = rk.apply(model, rk.Route(start=1, end=4, selector="row"), example_inputs=args, example_kwargs=kwargs,
                      mode=mode)
    routed.train()
    routed(torch.randn(2, 4, 16, 16), **kwargs)  # an 8×8 grid
    routed_around = rk.last_route_mask(routed).reshape(2, 8, 8)
    assert (routed_around.all(2) | ~routed_around.any(2)).all() and routed_around.all(2).sum(1).tolist() == [4, 4]
    # padded, HiDream hands its blocks a mask of the padding the square example never passed: graph mode refuses
    # that input by name; boundary mode sees the stream come from no grid it found
    refusal = "as 'hidden_states_masks' on this call" if mode == "graph" else "example inputs. stream came from a 4×4 grid"
    with pytest.raises(rk.ConfigError, match=refusal):
        routed(torch.randn(2, 4, 4, 16), **kwargs)


@pytest.mark.parametrize("mode", ["graph", "boundary"])
def test_special_tokens_are_kept_at_another_caption_length_or_the_call_is_refused(mode):
    """AuraFlow's single-stream blocks take its 8 registers and its caption in front of the image. A routed model
    kept the positions it resolved on the example (8 + 5 tokens) at every call: with a 7-token caption it routed
    caption tokens as image tokens, in both modes. Graph mode decided at apply that the registers and then as many
    tokens as the call's caption are special, and keeps the whole caption of any length; boundary mode, which
    found the caption on the example call and cannot count it again, refuses the call by name. At another image
    size with the example's caption, both keep the registers and the caption."""
    try:
        model, args, kwargs = zoo.diffusers_auraflow()
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    routed = rk.apply(model, rk.Route(start=1, end=4), example_inputs=args, example_kwargs=kwargs, mode=mode,
                      stack="single_transformer_blocks")
    routed.train()
    routed(torch.randn(2, 4, 8, 16), **kwargs)  # a 4×8 grid, the example's caption
    assert not rk.last_route_mask(routed)[:, :13].any() and rk.last_route_mask(routed).shape[1] == 13 + 32
    longer = {**kwargs, "encoder_hidden_states": torch.randn(2, 7, 24)}
    if mode == "boundary":
        with pytest.raises(rk.ConfigError, match="15 tokens besides the 16 of its image's grid"):
            routed(*args, **longer)
        return
    for _ in range(3):
        routed(*args, **longer)
        assert not rk.last_route_mask(routed)[:, :15].any() and rk.last_route_mask(routed)[:, 15:].sum(1).tolist() == [8, 8]
    # 8 registers and an 8-token caption are as many tokens as the image's: what is special was decided at apply
    # (registers, then as many tokens as the caption the call passes), so no coincidence of lengths can change it
    routed(*args, **{**kwargs, "encoder_hidden_states": torch.randn(2, 8, 24)})
    assert not rk.last_route_mask(routed)[:, :16].any() and rk.last_route_mask(routed)[:, 16:].sum(1).tolist() == [8, 8]


def test_captions_of_different_lengths_per_sample_are_kept_or_the_route_asks_for_keep():
    """Lumina2 lays out each sample as its caption, then its image, then padding, by its caption mask's values, and
    passes its blocks an attention mask only where the lengths differ. An example batch whose captions differ had
    the positions all samples share taken for the special tokens, and the longer caption's last tokens routed,
    silently; an example whose captions matched, then a batch whose did not, failed inside attention (the mask the
    example did not have reached the routed blocks whole). Now the first asks for keep= by saying so, the second
    names the argument, and with a keep that covers the longest caption every sample keeps its caption, at the
    example's layout and at the others, and verifies. The twin, an example of equal lengths, keeps its caption."""
    try:
        model, args, kwargs = zoo.diffusers_lumina2()
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    ragged = {**kwargs, "encoder_attention_mask": torch.tensor([[True] * 5, [True] * 3 + [False] * 2])}
    assert rk.inspect(model, args, kwargs).stacks[0].special == tuple(range(5))  # the twin: one layout
    with pytest.warns(rk.FallbackWarning):
        even = rk.apply(model, rk.Route(start=1, end=4), example_inputs=args, example_kwargs=kwargs)
    even.train()
    even(*args, **kwargs)
    assert not rk.last_route_mask(even)[:, :5].any() and rk.last_route_mask(even)[:, 5:].sum(1).tolist() == [8, 8]
    with pytest.raises(rk.ConfigError, match="'attention_mask' on this call, where the example call passed None"):
        even(*args, **ragged)
    with pytest.warns(rk.FallbackWarning), pytest.raises(
            rk.ConfigError, match=r"sample 0: \[0..4\]; sample 1: \[0..2, 19..20\]\).*keep=list\(range\(L\)\)"):
        rk.apply(model, rk.Route(start=1, end=4), example_inputs=args, example_kwargs=ragged)
    with pytest.warns(rk.FallbackWarning):
        routed = rk.apply(model, rk.Route(start=1, end=4, keep=list(range(5))), example_inputs=args,
                          example_kwargs=ragged)
    assert rk.verify(model, routed, args, ragged).train == "rate 0 bit-identical"
    assert "kept" in rk.verify(model, routed, args, kwargs).checks  # equal lengths: the blocks' mask is left out
    routed.train()
    for mask in ([[1] * 5, [1] * 3 + [0] * 2], [[1] * 2 + [0] * 3, [1] * 4 + [0]], [[1] * 5] * 2):
        routed(*args, **{**ragged, "encoder_attention_mask": torch.tensor(mask, dtype=torch.bool)})
        routed_around = rk.last_route_mask(routed)
        tokens = max(map(sum, mask)) + 16  # the longest caption, then the 4×4 image
        assert routed_around.shape[1] == tokens and not routed_around[:, :5].any()
        assert routed_around.sum(1).tolist() == [(tokens - 5) // 2] * 2


def test_a_causal_lm_trains_with_a_route():
    """transformers' LlamaForCausalLM, trained as it trains (labels in, loss out): the routed step's loss is a
    loss over every token, its gradients reach the parameters they reached unrouted, and eval is the model's."""
    try:
        transformers = __import__("zoo").package("transformers")
    except Missing as err:
        pytest.skip(str(err))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                      num_attention_heads=2, num_key_value_heads=2, use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    routed = rk.apply(model, rk.Route(start=1, end=4), example_inputs=(ids,), example_kwargs={"labels": ids})
    rk.verify(model, routed, (ids,), {"labels": ids})
    model.train()
    model(ids, labels=ids).loss.backward()
    before = reached(model)
    routed.train()
    model.zero_grad()
    loss = routed(ids, labels=ids).loss
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss) and reached(routed) == before
