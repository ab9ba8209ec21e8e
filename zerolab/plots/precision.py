"""Figures of notebook 11: what rounding on the wire does to training, and where offloading
the optimizer to a CPU costs no step time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure

from zerolab.plots.base import FIGSIZE, CourseFigure
from zerolab.plots.base import legend_outside as _legend_outside
from zerolab.plots.base import rank_color as _rank_color


def accuracy(losses: Mapping[str, Sequence[float]], errors: Mapping[str, Sequence[float]],
             title: str) -> Figure:
    """Two panels over the steps: each variant's loss (top), and its gradient's relative error
    against the exact wire's at the same weights (bottom, log scale). Colours match by label."""
    fig = CourseFigure(figsize=(FIGSIZE[0], 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 1])
    colors = {label: _rank_color(i) for i, label in enumerate(losses)}
    for label, values in losses.items():
        top.plot(range(len(values)), values, color=colors[label], linewidth=1.2, label=label)
    for label, values in errors.items():
        bottom.plot(range(len(values)), values, color=colors[label], linewidth=1.2)
    top.set_ylabel("loss (mean of the ranks)")
    top.set_title(title)
    _legend_outside(top)
    bottom.set_yscale("log")
    bottom.set_ylabel("gradient's relative error")
    bottom.set_title("‖g − g_fp32‖ / ‖g_fp32‖ at the same weights and batch", fontsize=9)
    bottom.set_xlabel("step")
    return fig


def break_even(tokens: Sequence[float], gpu: Sequence[float], flat: Mapping[str, float],
               crossing: float, title: str) -> Figure:
    """Seconds per step against tokens per GPU per step (log-log): the GPU's forward and
    backward (a line through the published rate), and the offloaded work that does not grow
    with tokens (`flat`: the CPU's AdamW step, the PCIe transfer), a mark at the break-even."""
    fig = CourseFigure(figsize=FIGSIZE, layout="constrained")
    ax = fig.subplots()
    ax.plot(tokens, gpu, color="black", linewidth=1.5, label="GPU forward + backward")
    for i, (label, seconds) in enumerate(flat.items()):
        ax.axhline(seconds, color=_rank_color(i), linestyle=("-", "--", ":")[i % 3],
                   linewidth=1.2, label=label)
    ax.axvline(crossing, color="grey", linewidth=0.8, linestyle=":",
               label=f"break-even: {crossing:,.0f} tokens")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens per GPU per step")
    ax.set_ylabel("seconds per step")
    ax.set_title(title)
    _legend_outside(ax)
    return fig
