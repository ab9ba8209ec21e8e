"""Who holds what: the ZeRO paper's Figure 1, drawn from what each rank really held.

A panel is one moment of a training step: a row per rank, a column per category (parameters,
gradients, optimizer state). Each cell is a strip standing for the whole model, laid out as the
engine's flat buckets end to end; the parts the rank holds are filled, in the category's colour,
shaded by what they hold (the legend). Dotted lines split each bucket into the world_size equal
shards of the flat layout: rank r's shard is the r-th.

The data: `zerolab.lessons.holdings` (objects with .rank, .world_size, .label, .buckets and
.moments, each moment a .label and .held = {category: [segments with .start, .end, .status]}).
Each filled rectangle's gid is "panel|rank r|category|status|start-end", for tests to read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from zerolab.plots.base import CATEGORY_COLORS, CourseFigure

COLUMNS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
GAP = 0.12  # between two columns, in cell widths
ROW = 0.72  # a strip's height, in rows
# How a segment is drawn, by (category, status): solid for what the step needs now, light for
# values of the step before, hatched for a rank's own unreduced gradient.
STYLES = {
    ("params", "before the update"): {"alpha": 0.35},
    ("params", "updated"): {},
    ("grads", "this rank's own"): {"alpha": 0.45, "hatch": "////"},
    ("grads", "averaged over the ranks"): {},
    ("grads", "held, empty (zeros or scratch)"): {"alpha": 0.15},
    ("optimizer", "Adam's m and v"): {},
}


def _style(category: str, status: str) -> dict[str, Any]:
    color = CATEGORY_COLORS[category]
    style = STYLES.get((category, status), {})
    if "hatch" in style:  # the hatch takes the edge's colour: a face of its own, lighter
        return {"facecolor": (*_rgb(color), style["alpha"]), "edgecolor": color,
                "hatch": style["hatch"], "linewidth": 0}
    return {"facecolor": color, "alpha": style.get("alpha", 1.0), "linewidth": 0}


def _rgb(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))


def _check_same_moments(per_rank: Sequence[Any]) -> list[str]:
    labels = [m.label for m in per_rank[0].moments]
    for h in per_rank[1:]:
        if [m.label for m in h.moments] != labels:
            raise ValueError(f"rank {h.rank}'s moments differ from rank {per_rank[0].rank}'s: "
                             "pass one stage's Holdings from every rank of one launch")
    return labels


def _panel(ax: Any, name: str, cells: Sequence[tuple[int, Mapping[str, Sequence[Any]]]],
           buckets: Sequence[Any], world_size: int, headers: bool) -> set[tuple[str, str]]:
    """One moment: cells = [(rank, {category: segments})]. Returns the (category, status)
    pairs drawn, for the legend."""
    total = sum(b.padded_numel for b in buckets)
    rows = len(cells)
    drawn = set()
    for c, category in enumerate(COLUMNS):
        x0 = c * (1 + GAP)
        for i, (rank, held) in enumerate(cells):
            y = rows - 1 - i - ROW / 2  # rank 0 at the top
            ax.add_patch(Rectangle((x0, y), 1, ROW, facecolor="white", edgecolor="#999999",
                                   linewidth=0.6, zorder=1))
            for s in held.get(category, []):
                ax.add_patch(Rectangle((x0 + s.start / total, y), (s.end - s.start) / total,
                                       ROW, zorder=2, **_style(category, s.status),
                                       gid=f"{name}|rank {rank}|{category}|{s.status}|"
                                           f"{s.start}-{s.end}"))
                drawn.add((category, s.status))
            for b in buckets:  # the shards of the flat layout, and the buckets' ends
                for k in range(1, world_size):
                    x = x0 + (b.start + k * b.padded_numel / world_size) / total
                    ax.plot([x, x], [y, y + ROW], color="#555555", linewidth=0.5,
                            linestyle=":", zorder=3)
                if b.start:
                    ax.plot([x0 + b.start / total] * 2, [y, y + ROW], color="black",
                            linewidth=0.8, zorder=3)
        if headers:
            ax.text(x0 + 0.5, rows - 0.5 + 0.15, COLUMNS[category], ha="center", va="bottom",
                    fontsize=8)
    ax.set_xlim(-0.02, 3 + 2 * GAP + 0.02)
    ax.set_ylim(-0.6, rows - 0.4 + (0.45 if headers else 0))
    ax.set_yticks([rows - 1 - i for i in range(rows)], [f"rank {r}" for r, _ in cells],
                  fontsize=8)
    ax.set_xticks([])
    for side in ("top", "right", "bottom", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(left=False)
    ax.set_title(name, fontsize=8.5, loc="left")
    return drawn


def _draw(panels: Mapping[str, Sequence[tuple[int, Mapping[str, Sequence[Any]]]]],
          buckets: Mapping[str, Sequence[Any]], world_size: int, title: str,
          columns: int) -> Figure:
    n = len(panels)
    columns = max(1, min(columns, n))
    grid_rows = -(-n // columns)
    ranks = max(len(cells) for cells in panels.values())
    height = grid_rows * (0.3 * ranks + 0.75) + 1.2
    fig = CourseFigure(figsize=(4.6 * columns + 0.8, height), layout="constrained")
    axes = fig.subplots(grid_rows, columns, squeeze=False)
    drawn: set[tuple[str, str]] = set()
    for i, (name, cells) in enumerate(panels.items()):
        ax = axes[i // columns][i % columns]
        drawn |= _panel(ax, name, cells, buckets[name], world_size, headers=True)
    for j in range(n, grid_rows * columns):
        axes[j // columns][j % columns].set_visible(False)
    handles = [Patch(label=f"{COLUMNS[c]}: {s}", **_style(c, s)) for c, s in STYLES
               if (c, s) in drawn]
    handles.append(Patch(facecolor="white", edgecolor="#999999", label="not held"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(3, len(handles)),
               fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    return fig


def holdings_over_step(per_rank: Sequence[Any], title: str | None = None,
                       moments: Sequence[str] | None = None, columns: int = 2) -> Figure:
    """One stage: a panel per moment of its step (before and after each collective), each
    with a row per rank, numbered in the step's order. per_rank: that stage's Holdings from
    every rank of one launch. moments: the labels to draw (default: all, in order)."""
    per_rank = sorted(per_rank, key=lambda h: h.rank)
    labels = _check_same_moments(per_rank)
    chosen = list(moments) if moments is not None else labels
    missing = [m for m in chosen if m not in labels]
    if missing:
        raise ValueError(f"no moment {missing[0]!r}; the moments are {labels}")
    # Panels numbered in the step's order: "3. after reduce_scatter zero2/bwd/bucket0".
    panels = {f"{labels.index(m) + 1}. {m}": [(h.rank, h.moments[labels.index(m)].held)
                                               for h in per_rank] for m in chosen}
    first = per_rank[0]
    return _draw(panels, {name: first.buckets for name in panels}, first.world_size,
                 title or f"{first.label}: what each of {first.world_size} ranks holds, "
                          "before and after each collective of one step", columns)


def holdings_by_stage(by_stage: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]],
                      moment: int = -1, title: str | None = None, columns: int = 2) -> Figure:
    """The ZeRO paper's Figure 1: a panel per stage, each at one moment of its step (default
    the last: after the step). by_stage: {stage: that stage's Holdings from every rank}, or
    what `zerolab.launch(holdings, ...)` returns (per rank, {stage: Holdings})."""
    if not isinstance(by_stage, Mapping):  # per rank -> per stage
        by_stage = {s: [r[s] for r in by_stage] for s in by_stage[0]}
    panels, buckets, world_size = {}, {}, 1
    for per_rank in by_stage.values():
        per_rank = sorted(per_rank, key=lambda h: h.rank)
        _check_same_moments(per_rank)
        first = per_rank[0]
        name = f"{first.label}, {first.moments[moment].label}"
        panels[name] = [(h.rank, h.moments[moment].held) for h in per_rank]
        buckets[name], world_size = first.buckets, first.world_size
    return _draw(panels, buckets, world_size,
                 title or f"What each of {world_size} ranks holds, stage by stage", columns)
