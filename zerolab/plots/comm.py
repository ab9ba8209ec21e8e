"""Figures of communication: the bytes each rank sends, and the timeline of one step.

Plain data in, a `CourseFigure` out (see `zerolab.plots`). Byte axes follow the course's unit
convention (plots_base.UNIT_CONVENTION).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Patch

from zerolab.plots import base
from zerolab.plots.base import EXTRA_SPAN_COLORS, FIGSIZE, OP_COLORS, SPAN_COLORS, UNKNOWN_COLOR

# --- bytes per rank, per stage -------------------------------------------------------------------


def bytes_per_rank(
    data: Mapping[str, Sequence[float]],
    expected: Mapping[str, float] | None = None,
    title: str = "Bytes sent per rank",
    *,
    ylabel: str = "bytes sent per rank",
    xlabel: str = "stage",
    decimal: bool = False,
    each_rank: bool = False,
    unit: str | None = None,
    formula_label: str = "formula",
) -> Figure:
    """Bars per stage (key): one bar per rank, `expected` per stage dashed.

    A stage whose ranks all sent the same bytes is one bar noted 'same on all N ranks' (its
    total on top); only stages whose ranks differ get a bar per rank, coloured by rank.
    each_rank=True draws every rank everywhere. Used for communication (each rank's
    `log.total_ring_bytes()`), or any per-rank byte count with `ylabel` changed.
    """
    stages = list(data)
    same = {s: not each_rank and base.all_equal(list(data[s])) for s in stages}
    top = max([v for vals in data.values() for v in vals] + list((expected or {}).values()) + [1])
    byte_unit = base.pick_unit(top, decimal, unit)
    scale = byte_unit[1]

    fig, ax = base.figure()
    group = 0.8  # width of one stage's bars
    x = np.arange(len(stages))
    same_label = base.same_note([len(data[s]) for s in stages if same[s]])
    for i, s in enumerate(stages):
        if same[s]:  # one bar for the stage; its colour's legend entry says why
            ax.bar(i, data[s][0] / scale, group * 0.75, color=base.SAME_COLOR,
                   edgecolor="white", label=same_label)
            ax.annotate(base.format_bytes(data[s][0], byte_unit), (i, data[s][0] / scale),
                        xytext=(0, 4), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
            continue
        width = group / max(len(data[s]), 1)
        for r, value in enumerate(data[s]):
            ax.bar(i - group / 2 + width * (r + 0.5), value / scale, width,
                   color=base.rank_color(r), label=f"rank {r}", edgecolor="white")
    for i, s in enumerate(stages):
        if expected is not None and s in expected:
            ax.hlines(expected[s] / scale, i - group / 2, i + group / 2, colors="black",
                      linestyles="--", linewidth=1.5, label=formula_label)
    ax.set_xticks(x, stages)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(base.byte_label(ylabel, byte_unit))
    ax.set_ylim(0, top / scale * 1.12)
    ax.set_title(title)
    base.legend_outside(ax, handles=base.dedupe_legend(ax))
    fig.byte_unit = byte_unit
    return fig


# --- the timeline of compute and communication ---------------------------------------------------

LABEL_FONT = FontProperties(size=7)


def unit_name(tag: str) -> str:
    """A bar's label: the bucket or unit a tag names, its last part ('zero3/fwd/blocks.2' ->
    'blocks.2', 'ddp/bwd/bucket3' -> 'bucket3', 'zero3/fwd/root' -> 'root')."""
    return tag.rsplit("/", 1)[-1]


def _span_colors(names: Sequence[str]) -> dict[str, str]:
    """The phases' own colours; a lesson's own span names get one light tone each."""
    extra = iter(EXTRA_SPAN_COLORS * 10)
    return {n: SPAN_COLORS.get(n) or next(extra, UNKNOWN_COLOR) for n in names}


def _compute_lane_name(names: Sequence[str]) -> str:
    """What the upper lane of a rank holds: the training phases (forward, backward, step,
    recompute) are compute; other spans are regions of code a lesson named."""
    kind = "compute" if names and all(n in SPAN_COLORS for n in names) else "code regions"
    listed = ", ".join(names)
    return f"{kind}\n({listed})" if names and len(listed) <= 32 else kind


class Lane:
    """The bars of one lane, labelled once the figure is laid out (text extents are exact
    then): a label goes where it fits inside its bar and covers no other bar and no other
    label; otherwise the bar has none."""

    def __init__(self, y: float) -> None:
        self.y = y
        self.bars: list[tuple[float, float, str]] = []  # (left, width, text), ms

    def add(self, left: float, width: float, text: str) -> None:
        self.bars.append((left, width, text))

    def label(self, ax: Any, renderer: Any) -> None:
        x0, x1 = ax.get_xlim()
        px_per_ms = ax.get_window_extent(renderer).width / (x1 - x0)
        placed: list[tuple[float, float]] = []
        for i, (left, width, text) in enumerate(self.bars):
            text_px = renderer.get_text_width_height_descent(text, LABEL_FONT, ismath=False)[0]
            half = (text_px + 6) / px_per_ms / 2  # a few pixels of margin
            mid = left + width / 2
            lo, hi = mid - half, mid + half
            fits = bool(text) and 2 * half < width
            covered = any(o_left < hi and lo < o_left + o_width
                          for j, (o_left, o_width, _) in enumerate(self.bars) if j != i)
            if fits and not covered and all(hi <= a or b <= lo for a, b in placed):
                ax.text(mid, self.y, text, ha="center", va="center", fontproperties=LABEL_FONT,
                        clip_on=True)
                placed.append((lo, hi))


def _sub_rows(bars: Sequence[tuple[float, float]]) -> tuple[list[int], int]:
    """A row for each (left, width) bar such that no two bars of a row overlap: each bar takes
    the first row free at its left edge (greedy, in order of left edge). Returns the rows and
    how many there are (1 when no bars overlap)."""
    ends: list[float] = []  # the right edge of each row's last bar
    rows = [0] * len(bars)
    for i in sorted(range(len(bars)), key=lambda i: bars[i][0]):
        left, width = bars[i]
        row = next((r for r, end in enumerate(ends) if end <= left + 1e-9), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row], rows[i] = left + width, row
    return rows, max(len(ends), 1)


def timeline(logs: Sequence[Any], title: str = "Timeline of one step") -> Figure:
    """Gantt lanes: per rank, a lane of compute spans (forward/backward/step) and a lane of
    collectives.

    `logs`: objects with `.rank`, `.events` (`.op`, `.tag`, `.start`, `.end` in seconds) and
    `.spans` (`.name`, `.start`, `.end`), such as the CommLog each worker returns. One colour
    per op and per span name, one legend entry each. A collective's bar shows the bucket or
    unit its tag names ('blocks.2', 'root', 'bucket3'; `unit_name`) where the whole name fits
    and no other bar overlaps it, and nothing otherwise; a span's bar shows its name likewise.
    Collectives in flight together (asynchronous calls) are drawn in thin sub-rows of their
    rank's lane, so that none hides another; such a lane's bars carry no labels.
    """
    logs = sorted(logs, key=lambda log: log.rank)
    starts = [e.start for log in logs for e in log.events] + [
        s.start for log in logs for s in log.spans]
    ends = [e.end for log in logs for e in log.events if e.end is not None] + [
        s.end for log in logs for s in log.spans]
    t0 = min(starts, default=0.0)
    span_ms = max((max(ends + starts, default=t0) - t0) * 1e3, 1e-3)
    min_width = span_ms * 0.004  # instantaneous or un-waited calls still show as a sliver
    span_names = list(dict.fromkeys(s.name for log in logs for s in log.spans))
    span_colors = _span_colors(span_names)
    compute = _compute_lane_name(span_names)

    rows = 2 * len(logs)
    fig, ax = base.figure((FIGSIZE[0], max(3.0, 1.4 + 0.4 * rows)))

    yticks, ylabels, lanes = [], [], []
    ops_seen: dict[str, None] = {}
    for i, log in enumerate(logs):
        y_compute, y_comm = rows - 1 - 2 * i, rows - 2 - 2 * i  # rank 0 at the top
        yticks += [y_compute, y_comm]
        ylabels += [f"rank {log.rank} · {compute}", f"rank {log.rank} · collectives"]
        spans, comms = Lane(y_compute), Lane(y_comm)
        lanes += [spans, comms]
        for s in log.spans:
            left, width = (s.start - t0) * 1e3, max((s.end - s.start) * 1e3, min_width)
            ax.barh(y_compute, width, left=left, height=0.7, color=span_colors[s.name],
                    edgecolor="white")
            spans.add(left, width, s.name)
        bars = []  # (left, width drawn, width measured, event), ms
        for e in log.events:
            ops_seen[e.op] = None
            end = e.start if e.end is None else e.end
            width = (end - e.start) * 1e3
            bars.append(((e.start - t0) * 1e3, max(width, min_width), width, e))
        # Sub-rows by the measured widths: a sliver drawn wider than it lasted shares a row.
        rows_of, n_rows = _sub_rows([(left, width) for left, _, width, _ in bars])
        height = 0.7 / n_rows
        for (left, width, _, e), row in zip(bars, rows_of):
            # Calls in flight together (asynchronous ones) share the lane in thin sub-rows,
            # the first issued on top, so that no bar hides another.
            y = y_comm + 0.35 - height * (row + 0.5)
            ax.barh(y, width, left=left, height=height, alpha=0.9,
                    color=OP_COLORS.get(e.op, UNKNOWN_COLOR), edgecolor="white", linewidth=0.5)
            if n_rows == 1:  # a label needs the lane's whole height
                comms.add(left, width, unit_name(e.tag))
        if i:  # a thin rule between ranks
            ax.axhline(y_compute + 0.5, color="#999999", linewidth=0.6)

    handles = [Patch(color=span_colors[n], label=n) for n in span_names]
    handles += [Patch(color=OP_COLORS.get(op, UNKNOWN_COLOR), label=op) for op in ops_seen]
    if not handles:
        handles = [Patch(color=UNKNOWN_COLOR, label="(no events)")]
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_xlim(0, span_ms + 2 * min_width)
    ax.set_xlabel("time since first event (ms)")
    ax.set_title(title)
    base.legend_outside(ax, handles=handles)
    renderer = FigureCanvasAgg(fig).get_renderer()  # any PNG canvas, to measure text with
    fig.draw_without_rendering()  # lays the figure out: bar and text widths are now known
    for lane in lanes:
        lane.label(ax, renderer)
    return fig
