"""Figures of time (notebook 10): a fitted link against its measurements, and what a step's
time is made of.

Plain data in, a `CourseFigure` out (see `zerolab.plots`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from zerolab.plots import base
from zerolab.plots.base import OP_COLORS, SPAN_COLORS


def link_fit(measured: Mapping[str, Sequence[tuple[float, float, float, float]]],
             predicted: Mapping[str, Sequence[tuple[float, float]]],
             unseen: Mapping[str, Sequence[tuple[float, float]]] | None = None,
             title: str = "Collective time against size: measured, and the fitted link") -> \
        base.CourseFigure:
    """Log-log seconds against S, one colour per op.

    measured: op -> [(S bytes, median s, first quartile, third quartile)]: markers with the
    middle half as a bar. predicted: op -> [(S, s)]: the link's line. unseen: op -> [(S,
    median s)]: sizes the fit never saw, hollow markers.
    """
    fig, ax = base.figure()
    for op, points in measured.items():
        color = OP_COLORS.get(op, "#555555")
        s, t, lo, hi = (np.array(v, dtype=float) for v in zip(*points))
        ax.errorbar(s / 2**20, t * 1e3, yerr=[(t - lo) * 1e3, (hi - t) * 1e3], fmt="o",
                    color=color, markersize=4, capsize=2, label=f"{op} (measured)")
        line = sorted(predicted.get(op, ()))
        if line:
            ls, lt = zip(*line)
            ax.plot(np.array(ls) / 2**20, np.array(lt) * 1e3, color=color, linewidth=1)
        if unseen and unseen.get(op):
            us, ut = zip(*unseen[op])
            ax.plot(np.array(us) / 2**20, np.array(ut) * 1e3, "o", markerfacecolor="none",
                    color=color, markersize=6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("S: the tensor's size (MiB)")
    ax.set_ylabel("milliseconds (slowest rank)")
    ax.set_title(title, fontsize=10)
    ax.plot([], [], color="#555555", linewidth=1, label="the link: α·messages + β·bytes")
    if unseen:
        ax.plot([], [], "o", markerfacecolor="none", color="#555555",
                label="sizes the fit did not see")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", linewidth=0.3)
    return fig


def step_breakdown(steps: Mapping[str, Mapping[str, float]],
                   title: str = "One step: compute alone, and what communication added") -> \
        base.CourseFigure:
    """One bar per label (e.g. "DDP, N = 2"): compute alone (forward, backward, step stacked)
    and, on top, the exposed rest of the measured step; a tick marks the step the link
    predicts (compute + communication, none hidden).

    steps: label -> {"forward", "backward", "step": compute alone, "measured": the step,
    "predicted": the predicted step}, all in seconds.
    """
    fig, ax = base.figure()
    labels = list(steps)
    x = np.arange(len(labels))
    for i, label in enumerate(labels):
        d = steps[label]
        bottom = 0.0
        for phase in ("forward", "backward", "step"):
            ax.bar(i, d[phase] * 1e3, 0.6, bottom=bottom, color=SPAN_COLORS[phase],
                   label=f"{phase} alone" if i == 0 else None)
            bottom += d[phase] * 1e3
        exposed = d["measured"] * 1e3 - bottom
        ax.bar(i, exposed, 0.6, bottom=bottom, color=OP_COLORS["all_reduce"], alpha=0.6,
               label="the rest of the measured step" if i == 0 else None)
        ax.plot([i - 0.35, i + 0.35], [d["predicted"] * 1e3] * 2, color="black", linewidth=1.5,
                label="predicted step (nothing hidden)" if i == 0 else None)
    ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("milliseconds (slowest rank, median)")
    ax.set_title(title, fontsize=10)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)
    return fig


def threshold(tokens: Sequence[float], forward: Sequence[float], gather: float,
              predicted: Mapping[str, Sequence[tuple[float, float]]], gather_predicted: float,
              hidden: Mapping[str, Sequence[float]], t_star: float,
              t_star_measured: float | None = None,
              title: str = "A unit's forward against its gather") -> base.CourseFigure:
    """Two panels against T, tokens per rank (log2 axes).

    Left, milliseconds: the forward measured (markers) and fitted (line), the gather measured
    (a solid level) and predicted by the link (a dashed one); T* predicted (dashed vertical)
    and measured (dotted). predicted: "forward" -> [(T, s)] (the fit's line) and "hidden" ->
    [(T, share)] (perfect overlap). Right: the share of the gather hidden, measured per way
    (hidden: label -> share per T) beside perfect overlap's.
    """
    fig = base.CourseFigure(figsize=(10, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    ms = np.array(forward) * 1e3
    left.plot(tokens, ms, "o", color="#2471a3", markersize=5, label="forward, measured")
    lt, ls = zip(*predicted["forward"])
    left.plot(lt, np.array(ls) * 1e3, color="#2471a3", linewidth=1,
              label="forward, fitted: t0 + 2PT/C")
    left.axhline(gather * 1e3, color="#c0392b", linewidth=1.2, label="gather, measured")
    left.axhline(gather_predicted * 1e3, color="#c0392b", linestyle="--", linewidth=1,
                 label="gather, the link's prediction")
    right.axhline(0, color="#999999", linewidth=0.6)
    for ax in (left, right):
        ax.axvline(t_star, color="black", linestyle="--", linewidth=1,
                   label=f"T* predicted: {t_star:,.0f}")
        if t_star_measured is not None:
            ax.axvline(t_star_measured, color="black", linestyle=":", linewidth=1.2,
                       label=f"T* measured: {t_star_measured:,.0f}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T: tokens per rank")
        ax.grid(True, which="both", linewidth=0.3)
    left.set_yscale("log")
    left.set_ylabel("milliseconds (slowest rank, medians)")
    left.set_title(title, fontsize=10)
    colors = ("#c0392b", "#2471a3", "#7d3c98")
    for color, (label, share) in zip(colors, hidden.items()):
        right.plot(tokens, share, "o-", color=color, markersize=5, linewidth=0.8, label=label)
    right.plot(*zip(*predicted["hidden"]), color="black", linewidth=1.2,
               label="perfect overlap: min(1, forward / gather)")
    right.set_ylabel("share of the gather hidden")
    right.set_title("Both at once: (gather + forward - together) / gather", fontsize=10)
    low = min(min(v) for v in hidden.values())
    right.set_ylim(min(-0.3, low - 0.1), 1.2)  # every point shown, however far below zero
    left.legend(fontsize=7, loc="upper left")
    right.legend(fontsize=7, loc="lower left")
    return fig
