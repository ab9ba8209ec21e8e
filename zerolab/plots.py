"""The course's figures. Everything else in zerolab returns data; this file draws it.

Each function takes plain data (lists, dicts, or the comm logs), returns a matplotlib Figure
outside pyplot: a notebook displays the returned figure, a test inspects it.
Byte axes pick their unit from the data (B, KiB, MiB, GiB; or kB, MB, GB with decimal=True,
the paper's units), and the unit is part of the axis label.

Only matplotlib and numpy here, so the figures can be drawn wherever the data is.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

FIGSIZE = (8, 4)  # readable at the default width of a notebook cell

# One colour per category and per op, the same in every figure of the course.
CATEGORY_COLORS = {
    "params": "#4c72b0",
    "grads": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",  # saved for backward (memory.track_memory(activations=True))
    "other": "#8c8c8c",
}
_EXTRA_COLORS = ["#c44e52", "#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd"]
OP_COLORS = {
    "all_reduce": "#c44e52",
    "reduce_scatter": "#dd8452",
    "all_gather": "#4c72b0",
    "broadcast": "#8172b3",
    "send": "#64b5cd",
    "recv": "#ccb974",
}
SPAN_COLORS = {"forward": "#a1c9a1", "backward": "#f2b880", "step": "#b7a6d9"}
SPAN_COLORS["recompute"] = "#4f8f5f"  # a checkpointed forward, run again inside backward
_UNKNOWN_COLOR = "#bbbbbb"

_BINARY_UNITS = [("B", 1.0), ("KiB", 2.0**10), ("MiB", 2.0**20), ("GiB", 2.0**30)]
_DECIMAL_UNITS = [("B", 1.0), ("kB", 1e3), ("MB", 1e6), ("GB", 1e9)]  # GPUs are sold in GB


class CourseFigure(Figure):
    """A Figure outside pyplot that shows itself as PNG when it is a notebook cell's value.

    Outside pyplot, nothing keeps it alive after the caller drops it and it is shown once,
    with or without `%matplotlib inline`.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=96, metadata={"Software": None})
        return buffer.getvalue()


def _figure(figsize: tuple[float, float] = FIGSIZE, layout: str = "constrained"):
    fig = CourseFigure(figsize=figsize, layout=layout)
    return fig, fig.subplots()


def pick_unit(max_bytes: float, decimal: bool = False) -> tuple[str, float]:
    """The largest unit in which `max_bytes` is at least 1: (name, bytes per unit)."""
    units = _DECIMAL_UNITS if decimal else _BINARY_UNITS
    chosen = units[0]
    for name, scale in units:
        if max_bytes >= scale:
            chosen = (name, scale)
    return chosen


def _short(value: float) -> str:
    """3 significant digits without exponents: 0.0123, 38.5, 112, 1120."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _category_order(categories: Sequence[str]) -> list[str]:
    """Known categories first, in a fixed order (params at the bottom of a stack), then the rest."""
    known = [c for c in CATEGORY_COLORS if c in categories]
    return known + [c for c in dict.fromkeys(categories) if c not in CATEGORY_COLORS]


def _category_colors(categories: Sequence[str]) -> dict[str, str]:
    extra = iter(_EXTRA_COLORS * 10)
    return {c: CATEGORY_COLORS.get(c) or next(extra) for c in categories}


def _rank_color(i: int) -> Any:
    return matplotlib.colormaps["tab10"](i % 10)


def _legend_outside(ax: Any, **kwargs: Any) -> None:
    """Legend to the right of the axes, so that it never hides a bar or a line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


# --- 1. memory per rank ----------------------------------------------------------------------


def memory_bars(
    per_rank: Sequence[Mapping[str, float]],
    expected: float | Mapping[str, float] | Sequence[float | Mapping[str, float]] | None = None,
    title: str = "Model-state memory per rank",
    *,
    labels: Sequence[str] | None = None,
    xlabel: str = "rank",
    decimal: bool = False,
) -> Figure:
    """One stacked bar per rank: bytes per category ({'params': .., 'grads': .., ...}).

    `expected` (bytes): a number (the formula's total), a dict per category (a dashed line at
    each boundary of the stack), or a list of either, one per rank; drawn as dashed lines
    labelled 'formula'. `labels` replaces the tick labels 'rank 0', 'rank 1', ... (e.g. stage
    names), `decimal` uses GB instead of GiB.
    """
    categories = _category_order([c for d in per_rank for c in d])
    colors = _category_colors(categories)
    totals = [sum(d.values()) for d in per_rank]
    one_for_all = expected is None or isinstance(expected, (Mapping, Real))
    expected_list = [expected] * len(per_rank) if one_for_all else list(expected)
    expected_tops = [sum(e.values()) if isinstance(e, Mapping) else e or 0 for e in expected_list]
    unit, scale = pick_unit(max(totals + expected_tops + [1]), decimal)

    fig, ax = _figure(figsize=FIGSIZE, layout="constrained")
    x = np.arange(len(per_rank))
    bottom = np.zeros(len(per_rank))
    for cat in categories:
        heights = np.array([d.get(cat, 0) for d in per_rank]) / scale
        ax.bar(x, heights, 0.6, bottom=bottom, color=colors[cat], label=cat, edgecolor="white")
        bottom += heights

    if expected is not None:
        # Dashed segments over each bar: where the formula says the stack (or each part) ends.
        label = "formula"
        if isinstance(expected, Real):
            label = f"formula ({_short(expected / scale)} {unit})"
        for i, e in enumerate(expected_list):
            if isinstance(e, Mapping):
                levels = np.cumsum([e.get(c, 0) for c in _category_order(list(e))])
            else:
                levels = [e]
            for level in levels:
                ax.hlines(level / scale, i - 0.4, i + 0.4, colors="black", linestyles="--",
                          linewidth=1.5, label=label)

    if len(per_rank) <= 16:  # the total on top of each bar, while there is room to read it
        for i, total in enumerate(totals):
            ax.annotate(_short(total / scale), (i, total / scale), xytext=(0, 4),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, list(labels) if labels is not None else [f"rank {i}" for i in x])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"bytes held ({unit})")
    ax.set_ylim(0, max(totals + expected_tops + [1]) / scale * 1.15)  # room for the labels
    ax.set_title(title)
    _legend_outside(ax, handles=_dedupe_legend(ax, reverse=True))
    return fig


def _dedupe_legend(ax: Any, reverse: bool = False) -> list[Any]:
    """One legend entry per label (many bars share one); stacks read top-down when reversed."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # later duplicates overwrite, order of first seen kept
    formula = [h for lab, h in unique.items() if lab.startswith("formula")]
    items = [h for lab, h in unique.items() if not lab.startswith("formula")]
    if reverse:
        items.reverse()
    return items + formula


# --- 2. memory over time ---------------------------------------------------------------------


def memory_timeline(
    timelines: Sequence[Any],
    category: str | None = None,
    title: str = "Memory over one step",
    *,
    decimal: bool = False,
) -> Figure:
    """Memory against time: samples (t_seconds, {category: bytes}) per rank.

    Several ranks: one line per rank (total, or `category`). One rank and no `category`:
    stacked areas per category. x is in ms from the earliest sample; values hold until the next
    sample (memory changes at allocations), so lines are drawn as steps. An entry may also be an
    object with `.samples` (a `zerolab.MemoryTrace`).
    """
    timelines = [getattr(s, "samples", s) for s in timelines]
    nonempty = [s for s in timelines if s]
    t0 = min(s[0][0] for s in nonempty) if nonempty else 0.0
    t_end = max(s[-1][0] for s in nonempty) if nonempty else 0.0
    # A sample's value holds until the next sample; the last one would get no width, so every
    # series is extended by a short tail past the last sample of any rank.
    tail_ms = 0.02 * (t_end - t0) * 1e3 + 1e-3

    def times_ms(samples: Sequence[tuple[float, Mapping[str, float]]]) -> Any:
        x = [(t - t0) * 1e3 for t, _ in samples]
        return np.array(x + [(t_end - t0) * 1e3 + tail_ms])

    def series(samples: Sequence[tuple[float, Mapping[str, float]]], cat: str | None) -> Any:
        values = [sum(d.values()) if cat is None else d.get(cat, 0) for _, d in samples]
        return np.array(values + values[-1:], dtype=float)  # the tail repeats the last value

    stacked = len(timelines) == 1 and category is None
    peak = max((series(s, category).max() for s in nonempty), default=1.0)
    unit, scale = pick_unit(max(peak, 1), decimal)

    fig, ax = _figure(figsize=FIGSIZE, layout="constrained")
    if stacked and nonempty:
        samples = timelines[0]
        x = times_ms(samples)
        cats = _category_order([c for _, d in samples for c in d])
        colors = _category_colors(cats)
        ys = [series(samples, c) / scale for c in cats]
        ax.stackplot(x, ys, labels=cats, colors=[colors[c] for c in cats], step="post")
        _legend_outside(ax, handles=ax.get_legend_handles_labels()[0][::-1])
    else:
        for rank, samples in enumerate(timelines):
            if not samples:
                continue
            ax.step(times_ms(samples), series(samples, category) / scale, where="post",
                    color=_rank_color(rank), label=f"rank {rank}")
        _legend_outside(ax)
    what = "total memory" if category is None else f"{category} memory"
    ax.set_xlabel("time since first sample (ms)")
    ax.set_ylabel(f"{what} ({unit})")
    ax.set_xlim(0, (t_end - t0) * 1e3 + tail_ms)
    ax.set_ylim(0, peak / scale * 1.1)
    ax.set_title(title)
    return fig


# --- 3. timeline of compute and communication --------------------------------------------------


def timeline(logs: Sequence[Any], title: str = "Timeline of one step") -> Figure:
    """Gantt lanes: per rank, a compute lane (forward/backward/step spans) and a comm lane.

    `logs`: objects with `.rank`, `.events` (`.op`, `.tag`, `.start`, `.end` in seconds) and
    `.spans` (`.name`, `.start`, `.end`), such as the CommLog each worker returns. One colour per
    op; a bar wide enough to hold it shows the last part of its tag ('blocks.2').
    """
    logs = sorted(logs, key=lambda log: log.rank)
    starts = [e.start for log in logs for e in log.events] + [
        s.start for log in logs for s in log.spans]
    ends = [e.end for log in logs for e in log.events if e.end is not None] + [
        s.end for log in logs for s in log.spans]
    t0 = min(starts, default=0.0)
    span_ms = max((max(ends + starts, default=t0) - t0) * 1e3, 1e-3)
    min_width = span_ms * 0.004  # instantaneous or un-waited calls still show as a sliver

    rows = 2 * len(logs)
    fig, ax = _figure(figsize=(FIGSIZE[0], max(3.0, 1.4 + 0.35 * rows)), layout="constrained")
    # Text fits when the bar is wider than ~4.5 points per character at fontsize 7 (the axes
    # take ~60% of the figure's width next to the lane names and the legend; exact text
    # extents would need a draw). A narrow bar gets the unit's index alone ('blocks.2' -> '2').
    points_per_ms = FIGSIZE[0] * 0.6 * 72 / span_ms

    def label(x: float, y: float, width: float, text: str) -> None:
        for candidate in (text, text.rsplit(".", 1)[-1] if "." in text else ""):
            if candidate and width * points_per_ms > 4.5 * len(candidate) + 4:
                ax.text(x + width / 2, y, candidate, ha="center", va="center", fontsize=7,
                        clip_on=True)
                return

    yticks, ylabels = [], []
    ops_seen: dict[str, None] = {}
    spans_seen: dict[str, None] = {}
    for i, log in enumerate(logs):
        y_compute, y_comm = rows - 1 - 2 * i, rows - 2 - 2 * i  # rank 0 at the top
        yticks += [y_compute, y_comm]
        ylabels += [f"rank {log.rank} compute", f"rank {log.rank} comm"]
        for s in log.spans:
            spans_seen[s.name] = None
            left, width = (s.start - t0) * 1e3, max((s.end - s.start) * 1e3, min_width)
            ax.barh(y_compute, width, left=left, height=0.7,
                    color=SPAN_COLORS.get(s.name, _UNKNOWN_COLOR), edgecolor="white")
            label(left, y_compute, width, s.name)
        for e in log.events:
            ops_seen[e.op] = None
            end = e.start if e.end is None else e.end
            left, width = (e.start - t0) * 1e3, max((end - e.start) * 1e3, min_width)
            ax.barh(y_comm, width, left=left, height=0.7, alpha=0.9,
                    color=OP_COLORS.get(e.op, _UNKNOWN_COLOR), edgecolor="white", linewidth=0.5)
            label(left, y_comm, width, e.tag.rsplit("/", 1)[-1])  # 'zero3/fwd/blocks.2'
        if i:  # a thin rule between ranks
            ax.axhline(y_compute + 0.5, color="#999999", linewidth=0.6)

    handles = [Patch(color=SPAN_COLORS.get(n, _UNKNOWN_COLOR), label=n) for n in spans_seen]
    handles += [Patch(color=OP_COLORS.get(op, _UNKNOWN_COLOR), label=op) for op in ops_seen]
    if not handles:
        handles = [Patch(color=_UNKNOWN_COLOR, label="(no events)")]
    ax.set_yticks(yticks, ylabels)
    ax.set_ylim(-0.6, rows - 0.4)
    ax.set_xlim(0, span_ms + 2 * min_width)
    ax.set_xlabel("time since first event (ms)")
    ax.set_ylabel("lane")
    ax.set_title(title)
    _legend_outside(ax, handles=handles)
    return fig


# --- 4. bytes per rank, per stage --------------------------------------------------------------


def bytes_per_rank(
    data: Mapping[str, Sequence[float]],
    expected: Mapping[str, float] | None = None,
    title: str = "Bytes sent per rank",
    *,
    ylabel: str = "bytes sent per rank",
    decimal: bool = False,
) -> Figure:
    """Grouped bars: one group per stage (key), one bar per rank; `expected` per stage dashed.

    Used for communication (each rank's `log.total_bytes()`), or any per-rank byte count with
    `ylabel` changed.
    """
    stages = list(data)
    nranks = max((len(v) for v in data.values()), default=0)
    top = max([v for vals in data.values() for v in vals] + list((expected or {}).values()) + [1])
    unit, scale = pick_unit(top, decimal)

    fig, ax = _figure(figsize=FIGSIZE, layout="constrained")
    group = 0.8  # width of one group of bars
    width = group / max(nranks, 1)
    x = np.arange(len(stages))
    for r in range(nranks):
        heights = [data[s][r] / scale if r < len(data[s]) else 0 for s in stages]
        ax.bar(x - group / 2 + width * (r + 0.5), heights, width, color=_rank_color(r),
               label=f"rank {r}", edgecolor="white")
    for i, s in enumerate(stages):
        if expected is not None and s in expected:
            ax.hlines(expected[s] / scale, i - group / 2, i + group / 2, colors="black",
                      linestyles="--", linewidth=1.5, label="formula")
    ax.set_xticks(x, stages)
    ax.set_xlabel("stage")
    ax.set_ylabel(f"{ylabel} ({unit})")
    ax.set_ylim(0, top / scale * 1.1)
    ax.set_title(title)
    _legend_outside(ax, handles=_dedupe_legend(ax))
    return fig


# --- 5. memory against world size --------------------------------------------------------------


def memory_vs_world_size(
    measured: Mapping[Any, Any],
    formula: Callable[[float], float] | Mapping[str, Callable[[float], float]],
    title: str = "Memory per rank against world size",
    *,
    max_world_size: int | None = None,
    decimal: bool = False,
) -> Figure:
    """The formula as a curve over N = 1..max, the measurements as markers on top.

    `measured`: {N: bytes}, or {label: {N: bytes}} for several stages; `formula`: N -> bytes, or
    {label: N -> bytes}. Labels present in either are drawn, one colour per label. The curve
    runs to `max_world_size` (default: the largest measured N, or 64 with no measurements); the
    x axis turns logarithmic (base 2) past N = 16.
    """
    if measured and all(isinstance(v, Mapping) for v in measured.values()):
        series: dict[str, Mapping[Any, float]] = dict(measured)
    else:
        series = {"": measured} if measured else {}
    formulas = dict(formula) if isinstance(formula, Mapping) else {"": formula}
    labels = list(dict.fromkeys(list(series) + list(formulas)))
    sizes = sorted({int(n) for pts in series.values() for n in pts})
    n_max = max_world_size or max(sizes, default=64)
    logx = n_max > 16
    grid = np.geomspace(1, n_max, 200) if logx else np.linspace(1, n_max, 200)
    # Ticks at 1, the measured sizes, and on a log axis every power of two.
    if logx:
        ticks = {1, *sizes, n_max} | {2**i for i in range(int(np.log2(n_max)) + 1)}
    else:
        ticks = set(sizes) | {1, n_max} if sizes else set(range(1, n_max + 1))

    curves = {lab: np.array([formulas[lab](n) for n in grid]) for lab in formulas}
    top = max([c.max() for c in curves.values()]
              + [v for pts in series.values() for v in pts.values()] + [1])
    unit, scale = pick_unit(top, decimal)

    fig, ax = _figure(figsize=FIGSIZE, layout="constrained")
    for i, lab in enumerate(labels):
        color = _rank_color(i)
        name = f"{lab} " if lab else ""
        if lab in curves:
            ax.plot(grid, curves[lab] / scale, color=color, label=f"{name}formula")
        if lab in series:
            pts = sorted(series[lab].items())
            ax.plot([n for n, _ in pts], [v / scale for _, v in pts], "o", color=color,
                    markersize=8, markeredgecolor="black", label=f"{name}measured")
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(n) for n in sorted(ticks)])
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_ylim(0, top / scale * 1.1)
    ax.set_title(title)
    _legend_outside(ax)
    return fig


__all__ = [
    "CATEGORY_COLORS",
    "OP_COLORS",
    "SPAN_COLORS",
    "bytes_per_rank",
    "memory_bars",
    "memory_timeline",
    "memory_vs_world_size",
    "pick_unit",
    "timeline",
]
