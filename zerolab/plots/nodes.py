"""Figures of notebook 09 (past one node): bytes in groups (per link, per variant), and loss
curves set side by side (quantised against full precision)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from zerolab.plots.base import FIGSIZE, CourseFigure, pick_unit
from zerolab.plots.base import figure as _figure
from zerolab.plots.base import legend_outside as _legend_outside
from zerolab.plots.base import rank_color as _rank_color
from zerolab.plots.base import short as _short


def grouped_bytes(data: Mapping[str, Mapping[str, float]], title: str, *, xlabel: str,
                  ylabel: str, lines: Mapping[str, float] | None = None,
                  decimal: bool = False, unit: tuple[str, float] | None = None) -> Figure:
    """Bars in groups: data = {group: {series: bytes}}, one colour per series, each bar
    labelled with its value; `lines` = {label: bytes}, horizontal lines across (in the legend).
    unit: (name, bytes per unit) to count in something other than B/KiB/MiB, e.g. ("M", 4Ψ):
    multiples of the model's size."""
    series = list(dict.fromkeys(s for bars in data.values() for s in bars))
    top = max([v for bars in data.values() for v in bars.values()]
              + list((lines or {}).values()) + [1])
    unit, scale = unit or pick_unit(top, decimal)
    fig, ax = _figure()
    width = 0.8 / max(len(series), 1)
    for i, s in enumerate(series):
        xs = [g + width * (i + 0.5) - 0.4 for g, bars in enumerate(data.values()) if s in bars]
        heights = [bars[s] / scale for bars in data.values() if s in bars]
        bars = ax.bar(xs, heights, width, color=_rank_color(i), label=s, edgecolor="white")
        ax.bar_label(bars, [f"{_short(h)} {unit}" for h in heights], fontsize=7, padding=2,
                     rotation=90 if len(series) > 2 else 0)  # narrow bars: labels upright
    for (label, nbytes), style in zip((lines or {}).items(), [":", "--", "-."] * 3):
        ax.axhline(nbytes / scale, color="black", linestyle=style, linewidth=1, label=label,
                   zorder=0.5)  # behind the bars
    ax.set_xticks(range(len(data)), list(data))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"{ylabel} ({unit})")
    ax.set_ylim(0, top / scale * (1.3 if len(series) > 2 else 1.15))  # room for the labels
    ax.set_title(title)
    _legend_outside(ax)
    return fig


def loss_curves(curves: Mapping[str, Sequence[float]], title: str,
                difference: tuple[str, str] | None = None) -> Figure:
    """Loss against step, one line per curve; `difference` = (a, b): a second panel, a - b."""
    fig = CourseFigure(figsize=(FIGSIZE[0], 5.5 if difference else FIGSIZE[1]),
                       layout="constrained")
    axes = fig.subplots(2 if difference else 1, 1, sharex=True, squeeze=False,
                        height_ratios=[2, 1] if difference else None)[:, 0]
    for i, (label, losses) in enumerate(curves.items()):
        axes[0].plot(range(len(losses)), losses, color=_rank_color(i), linewidth=1.2,
                     label=label)
    axes[0].set_ylabel("loss")
    axes[0].set_title(title)
    _legend_outside(axes[0])
    if difference:
        a, b = (np.asarray(curves[k]) for k in difference)
        axes[1].plot(range(len(a)), a - b, color="black", linewidth=1)
        axes[1].axhline(0, color="grey", linewidth=0.8)
        axes[1].set_ylabel("difference")
        axes[1].set_title(f"{difference[0]} - {difference[1]}", fontsize=9)
    axes[-1].set_xlabel("step")
    return fig
