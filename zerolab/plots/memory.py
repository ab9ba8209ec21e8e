"""Figures of the bytes a rank holds: per rank, over one step, and against the world size.

Plain data in, a `CourseFigure` out (see `zerolab.plots`). Byte axes follow the course's unit
convention (plots_base.UNIT_CONVENTION): binary units for measurements, decimal GB with
decimal=True for model-scale figures; every axis and every total says its unit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from zerolab.plots.base import (
    all_equal,
    byte_label,
    category_colors,
    category_label,
    category_order,
    dedupe_legend,
    figure,
    format_bytes,
    legend_outside,
    pick_unit,
    rank_color,
    same_note,
    shown_categories,
)

Bytes = Mapping[str, float]  # {category: bytes}
Expected = float | Bytes | None  # a formula's total, or its bytes per category

# --- 1. memory per rank ----------------------------------------------------------------------


def _bars(per_rank: Sequence[Bytes] | Mapping[str, Sequence[Bytes]], expected: Any,
          labels: Sequence[str] | None, each_rank: bool
          ) -> tuple[list[tuple[str, Bytes, Expected]], str | None, str | None]:
    """The bars to draw, (tick label, bytes per category, formula); the note beside a single
    bar standing for every rank; the note for the legend when groups were merged. Ranks that
    hold the same bytes are one bar (unless each_rank): N equal bars say nothing one does not."""
    if isinstance(per_rank, Mapping):  # {group: [rank 0's, rank 1's, ...]}
        per_group = isinstance(expected, Mapping) and bool(expected) and set(expected) <= set(
            per_rank)
        bars, merged = [], {}
        for group, ranks in per_rank.items():
            e = expected.get(group) if per_group else expected
            if not each_rank and all_equal(list(ranks)):
                bars.append((group, ranks[0], e))
                merged[group] = len(ranks)
            else:
                bars += [(f"{group}\nrank {r}", d, e) for r, d in enumerate(ranks)]
        legend_note = None
        if merged:
            who = "every bar" if len(merged) == len(per_rank) else ", ".join(merged)
            legend_note = f"{who}: {same_note(merged.values())}"
        return bars, None, legend_note
    rows = list(per_rank)
    one_for_all = expected is None or isinstance(expected, (Mapping, Real))
    formulas = [expected] * len(rows) if one_for_all else list(expected)
    if labels is None and not each_rank and all_equal(rows) and (
            one_for_all or all_equal(formulas)):
        return [(f"ranks 0–{len(rows) - 1}", rows[0], formulas[0])], same_note(len(rows)), None
    names = list(labels) if labels is not None else [f"rank {i}" for i in range(len(rows))]
    return list(zip(names, rows, formulas)), None, None


def memory_bars(
    per_rank: Sequence[Bytes] | Mapping[str, Sequence[Bytes]],
    expected: float | Bytes | Sequence[float | Bytes] | Mapping[str, Any] | None = None,
    title: str = "Model-state memory per rank",
    *,
    labels: Sequence[str] | None = None,
    xlabel: str = "rank",
    decimal: bool = False,
    each_rank: bool = False,
    unit: str | None = None,
    formula_label: str = "formula",
) -> Figure:
    """Stacked bars of bytes per category ({'params': .., 'grads': .., ...}).

    per_rank: a list, one bar per rank ('rank 0', ...) or per thing `labels` names (stages,
    batch sizes); or {group: [rank 0's, rank 1's, ...]} (e.g. {'DDP': [...], 'ZeRO-1': [...]}).
    Ranks that hold exactly the same bytes are drawn as one bar noted 'same on all N ranks'
    (with the measured and the formula's total beside it); each_rank=True draws every rank.
    expected (bytes): a number (the formula's total), a dict per category (a dashed line at
    each boundary of the stack), a list of either, one per bar, or {group: either}; drawn
    dashed, labelled `formula_label`. decimal: GB (model scale) instead of binary units;
    unit: force one ('MiB'), e.g. to compare two figures.
    """
    bars, note, legend_note = _bars(per_rank, expected, labels, each_rank)
    present = [c for _, d, _ in bars for c in d]
    categories = shown_categories([d for _, d, _ in bars])
    colors = category_colors(categories)
    totals = [sum(d.values()) for _, d, _ in bars]
    tops = [sum(e.values()) if isinstance(e, Mapping) else e or 0 for _, _, e in bars]
    byte_unit = pick_unit(max(totals + tops + [1]), decimal, unit)
    scale = byte_unit[1]

    fig, ax = figure()
    x = np.arange(len(bars))
    bottom = np.zeros(len(bars))
    for cat in categories:
        heights = np.array([d.get(cat, 0) for _, d, _ in bars]) / scale
        ax.bar(x, heights, 0.6, bottom=bottom, color=colors[cat], edgecolor="white",
               label=category_label(cat, present))
        bottom += heights

    if expected is not None:
        # Dashed segments over each bar: where the formula says the stack (or each part) ends.
        label = formula_label
        if isinstance(expected, Real):
            label = f"{formula_label} ({format_bytes(expected, byte_unit)})"
        for i, (_, _, e) in enumerate(bars):
            levels = (np.cumsum([e[c] for c in category_order(list(e))])  # stack order
                      if isinstance(e, Mapping) else [e])
            for level in levels if e is not None else []:
                ax.hlines(level / scale, i - 0.4, i + 0.4, colors="black", linestyles="--",
                          linewidth=1.5, label=label)

    if len(bars) <= 16:  # the total on top of each bar, with its unit, while there is room
        for i, total in enumerate(totals):
            ax.annotate(format_bytes(total, byte_unit), (i, total / scale), xytext=(0, 4),
                        textcoords="offset points", ha="center", va="bottom", fontsize=8)
    if note is not None:  # one bar for every rank: say so beside it, with the formula
        lines = [note, f"measured {format_bytes(totals[0], byte_unit)}"]
        if tops[0]:
            lines.append(f"{formula_label} {format_bytes(tops[0], byte_unit)}")
        ax.text(0.45, totals[0] / scale / 2, "\n".join(lines), ha="left", va="center",
                fontsize=9)
        ax.set_xlim(-0.8, 2.2)
    ax.set_xticks(x, [name for name, _, _ in bars])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(byte_label("bytes held", byte_unit))
    ax.set_ylim(0, max(totals + tops + [1]) / scale * 1.15)  # room for the totals
    ax.set_title(title)
    handles = dedupe_legend(ax, reverse=True)
    if legend_note is not None:  # a line of text in the legend, with no symbol
        handles.append(Patch(visible=False, label=legend_note))
    legend_outside(ax, handles=handles)
    fig.byte_unit = byte_unit
    return fig


# --- 2. memory over time ---------------------------------------------------------------------


def memory_timeline(
    timelines: Sequence[Any],
    category: str | None = None,
    title: str = "Memory over one step",
    *,
    decimal: bool = False,
    unit: str | None = None,
    ymax: float | None = None,
    phases: Sequence[Any] = (),
    levels: Mapping[str, float] | None = None,
) -> Figure:
    """Memory against time: samples (t_seconds, {category: bytes}) per rank.

    Several ranks: one line per rank (total, or `category`). One rank and no `category`:
    stacked areas per category. x is in ms from the earliest sample; values hold until the next
    sample (memory changes at allocations), so lines are drawn as steps. An entry may also be an
    object with `.samples` (a `zerolab.MemoryTrace`). Two figures meant to be compared (prefetch
    on and off) should share `unit` ('MiB') and `ymax` (bytes): each would otherwise fit its own.
    phases: spans with .name, .start, .end (seconds, on the samples' clock from the first sample,
    as `MeasuredStep.phases()` gives them), each start marked dotted and named at the top.
    levels: {label: bytes}, dashed horizontal lines labelled at the right (the sizes that should
    bound the curve).
    """
    timelines = [getattr(s, "samples", s) for s in timelines]
    nonempty = [s for s in timelines if s]
    t0 = min(s[0][0] for s in nonempty) if nonempty else 0.0
    t_end = max(s[-1][0] for s in nonempty) if nonempty else 0.0
    # A sample's value holds until the next sample; the last one would get no width, so every
    # series is extended by a short tail past the last sample of any rank.
    tail_ms = 0.02 * (t_end - t0) * 1e3 + 1e-3

    def times_ms(samples: Sequence[tuple[float, Bytes]]) -> Any:
        x = [(t - t0) * 1e3 for t, _ in samples]
        return np.array(x + [(t_end - t0) * 1e3 + tail_ms])

    def series(samples: Sequence[tuple[float, Bytes]], cat: str | None) -> Any:
        values = [sum(d.values()) if cat is None else d.get(cat, 0) for _, d in samples]
        return np.array(values + values[-1:], dtype=float)  # the tail repeats the last value

    stacked = len(timelines) == 1 and category is None
    peak = max((series(s, category).max() for s in nonempty), default=1.0)
    top = ymax if ymax is not None else peak * 1.1
    byte_unit = pick_unit(max(peak, 1), decimal, unit)
    scale = byte_unit[1]

    fig, ax = figure()
    if stacked and nonempty:
        samples = timelines[0]
        x = times_ms(samples)
        present = [c for _, d in samples for c in d]
        cats = shown_categories([d for _, d in samples])
        colors = category_colors(cats)
        ax.stackplot(x, [series(samples, c) / scale for c in cats], step="post",
                     labels=[category_label(c, present) for c in cats],
                     colors=[colors[c] for c in cats])
        legend_outside(ax, handles=ax.get_legend_handles_labels()[0][::-1])
    else:
        for rank, samples in enumerate(timelines):
            if not samples:
                continue
            ax.step(times_ms(samples), series(samples, category) / scale, where="post",
                    color=rank_color(rank), label=f"rank {rank}")
        legend_outside(ax)
    for label, nbytes in (levels or {}).items():
        ax.axhline(nbytes / scale, color="black", linewidth=0.8, linestyle="--")
        ax.text(0.995, nbytes / scale, label, transform=ax.get_yaxis_transform(), ha="right",
                va="top", fontsize=8)
    for phase in phases:
        ax.axvline(phase.start * 1e3, color="black", linewidth=0.8, linestyle=":")
        ax.text((phase.start + phase.end) / 2 * 1e3, 0.99, phase.name, ha="center", va="top",
                transform=ax.get_xaxis_transform(), fontsize=9)
    what = "total memory" if category is None else f"{category} memory"
    ax.set_xlabel("time since first sample (ms)")
    ax.set_ylabel(byte_label(what, byte_unit))
    ax.set_xlim(0, (t_end - t0) * 1e3 + tail_ms)
    ax.set_ylim(0, top / scale)
    ax.set_title(title)
    fig.byte_unit = byte_unit
    return fig


# --- 3. memory against world size --------------------------------------------------------------

_LINESTYLES = ("-", "--", ":", "-.")  # the 1st, 2nd, ... of curves that are equal
_MARKERS = ("o", "s", "^", "D", "v", "P")


def _equal_curves(curves: Mapping[str, Any]) -> dict[str, tuple[int, int, str | None]]:
    """label -> (its place among the curves equal to it, how many they are, the first of them).
    Equal curves are drawn widest first, each next one narrower and dashed on top of it."""
    groups: list[list[str]] = []
    for lab, ys in curves.items():
        group = next((g for g in groups if np.allclose(curves[g[0]], ys, rtol=1e-9, atol=0)),
                     None)
        if group is None:
            groups.append([lab])
        else:
            group.append(lab)
    return {lab: (k, len(g), g[0] if k else None) for g in groups for k, lab in enumerate(g)}


def _stacking(points: Mapping[str, Mapping[int, float]], tolerance: float
              ) -> dict[tuple[str, int], tuple[int, int]]:
    """(label, N) -> (its place, how many) among measured points that land on one another
    (DDP, ZeRO-1 and ZeRO-2 send the same bytes). Such markers stay at their N and are drawn
    widest first, each next one smaller on top, so that every one shows."""
    out: dict[tuple[str, int], tuple[int, int]] = {}
    sizes = sorted({n for pts in points.values() for n in pts})
    for n in sizes:
        clusters: list[list[tuple[str, float]]] = []
        for lab, pts in points.items():
            if n not in pts:
                continue
            near = next((c for c in clusters if abs(c[0][1] - pts[n]) <= tolerance), None)
            if near is None:
                clusters.append([(lab, pts[n])])
            else:
                near.append((lab, pts[n]))
        for cluster in clusters:
            for k, (lab, _) in enumerate(cluster):
                out[lab, n] = (k, len(cluster))
    return out


def memory_vs_world_size(
    measured: Mapping[Any, Any],
    formula: Callable[[float], float] | Mapping[str, Callable[[float], float]],
    title: str = "Memory per rank against world size",
    *,
    max_world_size: int | None = None,
    decimal: bool = False,
    unit: str | None = None,
) -> Figure:
    """The formula as a curve over N = 1..max, the measurements as markers on top.

    `measured`: {N: bytes}, or {label: {N: bytes}} for several stages; `formula`: N -> bytes, or
    {label: N -> bytes}. Each label has its colour, line style and marker, and one legend entry
    (line: formula, marker: measured); a curve equal to an earlier one is drawn thinner on top
    of it and its entry says so ('ZeRO-1 (= DDP)'); measured points that coincide stay at
    their N, drawn widest first. The curve runs to `max_world_size` (default: the largest
    measured N, or 64 with no measurements); the x axis turns logarithmic (base 2) past N = 16.
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
    byte_unit = pick_unit(top, decimal, unit)
    scale = byte_unit[1]
    stacking = _stacking({lab: {int(n): v for n, v in pts.items()}
                          for lab, pts in series.items()}, 0.01 * top)

    equal = _equal_curves(curves)

    fig, ax = figure()
    handles = []
    for i, lab in enumerate(labels):
        k, count, same = equal.get(lab, (0, 1, None))
        style = {"color": rank_color(i), "linestyle": _LINESTYLES[k % 4],
                 "linewidth": 2.0 + 1.3 * (count - 1 - k)}
        mark = {"marker": _MARKERS[i % len(_MARKERS)], "markersize": 8,
                "markeredgecolor": "black", "color": style["color"]}
        if lab in curves:
            ax.plot(grid, curves[lab] / scale, **style)
        if lab in series:  # on top of every curve; a marker at 0 B shows whole
            pts = sorted((int(n), v) for n, v in series[lab].items())
            # the k-th of `count` coinciding markers: area shrinks from the widest at the back
            areas = [(mark["markersize"] * (1 + 0.55 * (c - 1 - k))) ** 2
                     for k, c in (stacking[lab, n] for n, _ in pts)]
            ax.scatter([n for n, _ in pts], [v / scale for _, v in pts], s=areas,
                       marker=mark["marker"], color=mark["color"], edgecolors="black",
                       zorder=3 + 0.1 * i, clip_on=False)
        name = lab if same is None else f"{lab} (= {same})"
        if lab:  # one entry per label: its line and its marker
            line = style if lab in curves else {"linestyle": "none"}
            handles.append(Line2D([], [], label=name, **{**line, **(
                mark if lab in series else {"color": style["color"]})}))
        else:  # a single unlabelled series: the entries say which is which
            handles += [Line2D([], [], label="formula", **style)] if lab in curves else []
            handles += ([Line2D([], [], label="measured", linestyle="none", **mark)]
                        if lab in series else [])
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ticks), [str(n) for n in sorted(ticks)])
    ax.set_xlabel("world size N (ranks)")
    ax.set_ylabel(byte_label("bytes per rank", byte_unit))
    ax.set_ylim(0, top / scale * 1.1)
    ax.set_title(title)
    kinds = series and curves and any(labels)
    legend_outside(ax, handles=handles,
                   title="line: formula, marker: measured" if kinds else None,
                   title_fontsize=8)
    fig.byte_unit = byte_unit
    return fig
