"""Printing and drawing a plan (`routekit.decision.Plan`): a table for the terminal, a PNG for docs.

Rendering sits below the plan it renders (the plan's `__str__` and `draw` call it), so it reads the
plan's fields without importing its module.
"""

from __future__ import annotations

import math
import re
import textwrap
from typing import Any


def _measured(rule: Any) -> str:
    """Where a grid no module shows came from (a `findings.CallGrid`), and so how it follows other calls."""
    if rule is None:
        return "measured off the call"
    if rule.patch is None:
        return "the latent sizes the call names"
    frames = " (frames before channels)" if rule.frames_first else ""
    return f"measured: the image{frames} over a {'×'.join(map(str, rule.patch))} patch"


def format_plan(plan: Any) -> str:
    r = plan.report
    tokens = r.tokens
    grid = "none found"
    if plan.grid:
        source = "given" if plan.grid_given else f"read off {r.grid_node}" if r.grid_node else _measured(r.call_grid)
        grid = "×".join(map(str, plan.grid)) + f" ({source})"
    others = {k: v for k, v in r.candidates.items() if k not in {s.name for s in r.stacks}}
    if plan.grid and not plan.grid_given and r.reordered:
        grid += "; its lines reach the blocks broken up (grid selectors refuse it)"
    if plan.grid and not r.special and math.prod(plan.grid) < tokens:
        grid += (f"; plus {tokens - math.prod(plan.grid)} other token(s) at positions routekit could not "
                 "tell: name them in Route(keep=[...])")
    lines = [
        f"routekit report for {r.model}  [{r.mode} mode]",
        f"  block stack : {r.stack} ({r.depth} blocks)" + (f"; other chains: {others}" if others else ""),
        f"  token grid  : {grid}",
    ]
    for k, stack in enumerate(r.stacks):
        _, n, channels = stack.stream.shape
        out = f", output [{stack.stream_out_index}]" if stack.stream_out_index is not None else ""
        if len(r.stacks) > 1:
            lines.append(f"  stack {k}     : {stack.name} (blocks {stack.first}..{stack.first + stack.depth - 1})")
        lines.append(f"  token stream: {stack.stream} (tokens {n}, channels {channels}), block input "
                     f"{stack.stream_slot!r}{out}")
        if stack.joined_at is not None:
            lines.append(f"    joined    : stack {k - 1}'s tokens at {stack.joined_at}.."
                         f"{stack.joined_at + r.stacks[k - 1].tokens - 1}, the owner's before or after them")
        if stack.special:
            lines.append(f"    special   : {len(stack.special)} tokens not made from the image (text, register, class) "
                         f"at {_cut(str(list(stack.special)), 40)}: routes keep them")
        if stack.unknown_special:
            lines.append(f"    special tokens: unknown ({stack.unknown_special}): a route needs keep=[...]")
    firsts = {k: _sides(r.blocks[stack.first]) for k, stack in enumerate(r.stacks)}
    for k, first in firsts.items():
        if not first:
            continue
        same = all(_sides(b) == first for b in r.blocks if b.stack == k)
        which = f"stack {k}'s blocks" if len(r.stacks) > 1 else "every block"
        lines.append(f"  side inputs : ({which}{'' if same else '; blocks that differ say so'})")
        lines += [f"    {_cut(str(slot), 24):<24} {kind:<10} {text}" for slot, kind, text in first]
    lines += ["", f"  {'#':>3}  {'block':<28} {'class':<24} notes"]
    routed, uncompiled = plan.route_at(), plan.uncompiled_by_dar()
    for b in r.blocks:
        notes = []
        if b.index in routed:
            notes.append(f"route {routed[b.index]}")
        if _sides(b) != firsts[b.stack]:
            notes.append("side inputs " + ", ".join(f"{slot}: {kind}" for slot, kind, _ in _sides(b)))
        if b.escapes:
            notes.append(f"output also used by {b.escapes[0].split(' → ')[1]}")
        if b.aux_escapes:
            notes.append(f"per-token side output {b.aux_escapes[0]}")
        if b.compiled and b.index in routed:
            notes.append(f"compiled: {r.stack_of(b.index).tokens} and {plan.placed[routed[b.index]].kept_at(b.stack)} "
                         "tokens, each static")
        if b.adds is not None:
            notes.append(f"{len(b.adds)} residual adds" if b.adds else "no residual add found on its stream: one DAR source")
        if b.qualname in uncompiled:
            notes.append("compiled, DAR inlines it uncompiled")
        first, *more = textwrap.wrap("; ".join(notes), 58, break_on_hyphens=False) or [""]
        lines.append(f"  {b.index:>3}  {_cut(b.qualname, 28):<28} {_cut(b.cls, 24):<24} {first}".rstrip())
        lines += [" " * 61 + line for line in more]
    lines.append("")
    if r.fallback:
        lines.append(f"  boundary mode: routes sit at block calls, because the owner forward is not traceable: {r.fallback}")
    for k, rp in enumerate(plan.placed):
        route, kept = rp.route, rp.kept
        across = "" if len(rp.stacks) == 1 else f", then {', '.join(map(str, rp.kept_in[1:]))} with the joined"
        keep = f", always keeping {list(rp.keep)}" if rp.keep else ""
        if rp.keep and route.keep is None:
            keep += " (found: class/register/text tokens; keep=[] routes them too)"
        lines.append(
            f"  route {k}: blocks {rp.start}→{rp.end}, rate {route.rate}, selector {route.selector!r}{keep}: "
            f"{kept} of {r.stack_of(rp.start).tokens} tokens go through{across}"
        )
        if route.fuse is not None:
            lines.append(f"           ends with SPRINT's fusion (path_drop {route.fuse.path_drop}, init "
                         f"{route.fuse.init!r}): in eval too, on every token")
        if rp.shared:
            lines.append("           one selection for the batch: a block reads a table without a batch axis that it "
                         "cannot take one per sample")
        if rp.shrink:
            lines.append(f"           the grid sizes handed to the blocks shrink along axes {list(rp.shrink)}")
    if plan.placed:
        how = ("each block's FLOPs at the tokens it sees, counted" if plan.flops_measured
               else "token-linear estimate: a block's FLOPs could not be counted")
        lines.append(f"  block FLOPs per step: ×{plan.block_flop_fraction():.3f} of the original ({how})")
    if r.residual:
        total = sum(len(b.adds or ()) for b in r.blocks)
        lines.append(f"  residual adds (what DAR rewrites): {total} in {r.depth} blocks, {r.residual} granularity")
    if plan.dar:
        lines.append(f"  DAR: {plan.dar.config!r}: {plan.dar.points} aggregation points")
    lines.append("  leafed submodules: " + ("(called whole: their own code failed to trace)" if r.leafed else "none"))
    for name, why in r.leafed.items():
        lines += textwrap.wrap(f"{name}: {why}", 112, initial_indent="    ", subsequent_indent="      ",
                               break_on_hyphens=False)
    if r.specialised:
        lines.append(f"  specialised to the example's shapes ({len(r.specialised)}; another shape traces again):")
        lines += [f"    {_cut(_short_paths(text), 112)}" for text in r.specialised[:8]]
        if len(r.specialised) > 8:
            lines.append(f"    ... and {len(r.specialised) - 8} more (plan.report.specialised)")
    else:
        lines.append("  specialised to the example's shapes: nothing")
    return "\n".join(lines)


def _sides(block: Any) -> list[tuple]:
    """A block's side inputs as the table shows them: (parameter name, or slot where the signature tells none; kind;
    what it holds)."""
    return [(s.argument if isinstance(s.argument, str) else s.slot, s.kind, s.describe()) for s in block.side_inputs]


def _short_paths(text: str) -> str:
    """`.../transformers/masking_utils.py:292` for a whole path: the file and its folder say where."""
    return re.sub(r"/[^ :]*/([^/ :]+/[^/ :]+:[0-9]+)", r".../\1", text)


def _cut(text: str, width: int) -> str:
    """`text` in at most `width` characters: cut at the last word boundary that fits (mid-word only where one word
    fills most of the width), "..." marking the cut."""
    if len(text) <= width:
        return text
    cut = text[:width - 3]
    space = cut.rfind(" ")
    if space > width // 2:
        cut = cut[:space].rstrip(" ,;:(")
    return cut + "..."


def draw_plan(plan: Any, path: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch
    except ImportError as err:
        from .errors import RoutekitError

        raise RoutekitError("drawing needs matplotlib: pip install matplotlib") from err
    r, tokens = plan.report, plan.report.tokens
    width = max(8.0, 0.55 * r.depth + 3)
    fig, ax = plt.subplots(figsize=(width, 3.6))
    x0 = 1.6
    colours = ["#e4572e", "#17bebb", "#ffc914", "#76b041", "#7d5ba6"]
    kept = {}
    for k, rp in enumerate(plan.placed):
        route = rp.route
        for i in rp.blocks:
            kept[i] = rp.kept / tokens
        c = colours[k % len(colours)]
        left, right = x0 + rp.start - 0.45, x0 + rp.end + 0.45
        ax.annotate("", xy=(right + 0.5, 0.1), xytext=(left - 0.5, 0.1),
                    arrowprops=dict(arrowstyle="->", color=c, lw=2, connectionstyle="arc3,rad=0.25"))
        ax.text((left + right) / 2, -0.8, f"route {k}: {rp.start}→{rp.end}, {route.rate:.0%} routed "
                f"({route.selector})", ha="center", color=c, fontsize=9)
    for i, _b in enumerate(r.blocks):
        h = 1.6 * kept.get(i, 1.0)
        ax.add_patch(FancyBboxPatch((x0 + i - 0.4, 1.0 - h / 2 + 0.8), 0.8, h, boxstyle="round,pad=0.02",
                                    fc="#4c72b0" if i not in kept else "#a1c9f4", ec="black", lw=0.8))
        ax.text(x0 + i, 0.45, str(i), ha="center", fontsize=8)
    ax.add_patch(FancyBboxPatch((0.0, 1.0), 0.9, 1.2, boxstyle="round,pad=0.02", fc="#dddddd", ec="black"))
    ax.text(0.45, 1.6, "embed", ha="center", va="center", fontsize=8)
    end = x0 + r.depth + 0.2
    ax.add_patch(FancyBboxPatch((end, 1.0), 0.9, 1.2, boxstyle="round,pad=0.02", fc="#dddddd", ec="black"))
    ax.text(end + 0.45, 1.6, "head", ha="center", va="center", fontsize=8)
    grid = f", grid {'×'.join(map(str, plan.grid))}" if plan.grid else ""
    ax.set_title(f"{r.model}: {r.stack} ({r.depth} blocks), stream {r.stream}{grid}; box height = tokens seen",
                 fontsize=10)
    ax.set_xlim(-0.3, end + 1.2)
    ax.set_ylim(-1.0, 3.0)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
