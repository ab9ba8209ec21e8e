"""Notebook 08's figures: activations against sequence length, and the whole memory of a rank.

Kept beside `zerolab.plots` (whose helpers and colours, in plots_base.py, they share) rather
than in it, so that each file stays short. Same rules: plain data in, a `CourseFigure` out;
byte axes follow the course's unit convention (binary units for measurements, decimal GB with
decimal=True for model-scale figures).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from zerolab.plots.base import (
    FIGSIZE,
    CourseFigure,
    byte_label,
    category_colors,
    category_label,
    dedupe_legend,
    legend_outside,
    pick_unit,
    rank_color,
    shown_categories,
)


def curves(
    measured: Mapping[str, Mapping[float, float]],
    formula: Mapping[str, Callable[[float], float]],
    title: str,
    *,
    xlabel: str = "sequence length s (tokens)",
    ylabel: str = "bytes kept for backward",
    x_range: tuple[float, float] | None = None,
    logx: bool = False,
    logy: bool = False,
    decimal: bool = False,
    hlines: Mapping[str, float] | None = None,
    kinds: tuple[str, str] = ("formula", "measured"),
) -> Figure:
    """Formula curves with measured markers on top, one colour per label.

    measured: {label: {x: bytes}}; formula: {label: x -> bytes}, drawn over `x_range` (default:
    the measured x's). logx: a base-2 x axis, ticks at powers of two; logy: a log byte axis
    (a line of slope 1 is linear growth, slope 2 quadratic). hlines: {label: bytes} drawn
    dashed (a GPU's memory). kinds: what the legend adds to the curves' and the markers' labels
    ("" adds nothing). Curves cycle through line styles; a curve within 1% of an earlier one
    everywhere is drawn thin on top of a wide one (its label should say so: see
    `close_curves`), so that both stay visible.
    """
    labels = list(dict.fromkeys([*formula, *measured]))
    xs = sorted({x for pts in measured.values() for x in pts})
    lo, hi = x_range or (min(xs), max(xs))
    grid = np.geomspace(lo, hi, 200) if logx else np.linspace(lo, hi, 200)
    lines = {lab: np.array([formula[lab](x) for x in grid]) for lab in formula}
    top = max([v.max() for v in lines.values()] + [1]
              + [v for pts in measured.values() for v in pts.values()]
              + list((hlines or {}).values()))
    byte_unit = pick_unit(top, decimal)
    scale = byte_unit[1]
    close = close_curves(lines)
    under = set(close.values())  # curves another is drawn on top of

    def name(label: str, kind: str) -> str:
        return f"{label}, {kind}" if kind else label

    fig = CourseFigure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    for i, lab in enumerate(labels):
        color = rank_color(i)
        if lab in lines:
            ax.plot(grid, lines[lab] / scale, color=color, label=name(lab, kinds[0]),
                    linestyle=("-", "--", "-.", ":")[i % 4],
                    linewidth=1.6 if lab in close else 5.0 if lab in under else 2.0 + 0.6 * (i % 2),
                    zorder=2.5 if lab in close else 2)
        if lab in measured:
            pts = sorted(measured[lab].items())
            ax.plot([x for x, _ in pts], [v / scale for _, v in pts], "o", color=color,
                    markersize=7, markeredgecolor="black", label=name(lab, kinds[1]))
    for lab, nbytes in (hlines or {}).items():
        ax.axhline(nbytes / scale, color="black", linestyle="--", linewidth=1, label=lab)
    if logx:
        ax.set_xscale("log", base=2)
        ticks = [2**k for k in range(int(np.ceil(np.log2(lo))), int(np.log2(hi)) + 1)]
        ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ticks])
    elif xs:
        ax.set_xticks(xs, [str(int(x)) for x in xs])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(byte_label(ylabel, byte_unit))
    if logy:  # ticks at 1, 2, 5 x 10^k, written plainly (20, not 2x10^1)
        low = min([v.min() for v in lines.values()]
                  + [v for pts in measured.values() for v in pts.values()]) / scale
        ax.set_yscale("log")
        ax.set_ylim(low / 1.5, top / scale * 2)
        decades = range(int(np.floor(np.log10(low / 1.5))), int(np.log10(top / scale * 2)) + 1)
        ax.set_yticks([m * 10.0**k for k in decades for m in (1, 2, 5)
                       if low / 1.5 <= m * 10.0**k <= top / scale * 2])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    else:
        ax.set_ylim(0, top / scale * 1.1)
    ax.set_title(title)
    legend_outside(ax)
    fig.byte_unit = byte_unit
    return fig


def close_curves(lines: Mapping[str, Any], rtol: float = 0.01) -> dict[str, str]:
    """{label: the earlier label it stays within rtol of, at every x}: curves drawn on top of
    each other."""
    out: dict[str, str] = {}
    labels = list(lines)
    for k, lab in enumerate(labels):
        same = next((e for e in labels[:k] if e not in out
                     and np.allclose(lines[lab], lines[e], rtol=rtol, atol=0)), None)
        if same is not None:
            out[lab] = same
    return out


def stacked_panels(
    panels: Mapping[str, Mapping[Any, Mapping[str, float]]],
    title: str,
    *,
    capacity: float | None = None,
    capacity_label: str = "GPU memory",
    xlabels: Sequence[str] | None = None,
    decimal: bool = True,
) -> Figure:
    """Side-by-side panels of stacked bars sharing one byte axis.

    panels: {panel title: {bar label: {category: bytes}}}, e.g. one panel against the world
    size and one against the sequence length. Categories stack in the course's order (params
    at the bottom, activations on top) and colours. capacity: a dashed line (a GPU's memory)
    across every panel; a bar that crosses it is what does not fit.
    """
    rows = [d for bars in panels.values() for d in bars.values()]
    present = [c for d in rows for c in d]
    categories = shown_categories(rows)
    colors = category_colors(categories)
    top = max([sum(d.values()) for d in rows] + [capacity or 0, 1])
    byte_unit = pick_unit(top, decimal)
    scale = byte_unit[1]

    fig = CourseFigure(figsize=(FIGSIZE[0] + 2, FIGSIZE[1]), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for k, (ax, (name, bars)) in enumerate(zip(axes, panels.items())):
        x = np.arange(len(bars))
        bottom = np.zeros(len(bars))
        for cat in categories:
            heights = np.array([d.get(cat, 0) for d in bars.values()]) / scale
            ax.bar(x, heights, 0.65, bottom=bottom, color=colors[cat], edgecolor="white",
                   label=category_label(cat, present))
            bottom += heights
        if capacity is not None:
            ax.axhline(capacity / scale, color="black", linestyle="--", linewidth=1.2,
                       label=capacity_label)
        ax.set_xticks(x, [str(b) for b in bars])
        ax.set_title(name, fontsize=10)
        if xlabels is not None:
            ax.set_xlabel(xlabels[k])
    axes[0].set_ylabel(byte_label("bytes per GPU", byte_unit))
    axes[0].set_ylim(0, top / scale * 1.1)
    fig.suptitle(title)
    fig.byte_unit = byte_unit
    handles = dedupe_legend(axes[-1], reverse=True)
    axes[-1].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                    borderaxespad=0.0)
    return fig


__all__ = ["curves", "stacked_panels"]
