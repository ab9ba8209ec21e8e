"""Notebook 12's figure: the bytes each mesh axis carries per step, against the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from zerolab.plots.base import byte_label, figure, pick_unit

AXIS_COLORS = {"tp": "#c44e52", "dp": "#4c72b0"}  # activations (all-reduce), weights (gathers)


def axis_bytes(seqs: Sequence[float], formula: Mapping[str, Sequence[float]],
               measured: Mapping[str, Mapping[int, float]], title: str,
               crossover: float | None = None) -> Figure:
    """Bytes a rank sends over each axis per step against sequences per dp rank: the formula
    as lines (formula[axis][i] at seqs[i]), the measurements as points ({seqs: bytes}), and
    the crossover, if given, as a dotted vertical line."""
    top = max(max(v) for v in formula.values())
    unit = pick_unit(top)
    fig, ax = figure()
    for axis, values in formula.items():
        color = AXIS_COLORS.get(axis, "#8c8c8c")
        ax.plot(seqs, [v / unit[1] for v in values], color=color, linewidth=1.5,
                label=f"{axis}: formula")
        points = measured.get(axis, {})
        ax.plot(list(points), [v / unit[1] for v in points.values()], "o", color=color,
                markersize=7, markerfacecolor="none", markeredgewidth=1.5,
                label=f"{axis}: measured (rank 0)")
    if crossover is not None:
        ax.axvline(crossover, color="grey", linestyle=":", linewidth=1.2,
                   label=f"crossover, formula: {crossover:.1f}")
    ax.set_xlabel("sequences per data-parallel rank (16 tokens each)")
    ax.set_ylabel(byte_label("bytes sent per step", unit))
    ax.set_xlim(0, max(seqs))
    ax.set_ylim(0, None)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=9)  # below the dp line, right of the tp line
    return fig
