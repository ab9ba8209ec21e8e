"""What every figure of the course shares: units, colours, legends, and the figure class.

The figures themselves are in plots_memory.py (bytes held), plots_comm.py (bytes sent, and the
timeline of compute and collectives) and activation_plots.py; `zerolab.plots` gathers them.

One unit convention for the whole course (`UNIT_CONVENTION`, which a notebook prints once):
bytes that zerolab measured are in binary IEC units (B, KiB, MiB, GiB: powers of 2^10), and
the model-scale figures of the ZeRO paper and of GPU datasheets are in decimal GB (10^9 B).
Every function that draws bytes takes `decimal` (False: measured; True: model scale) and picks
the unit from that family only; a `unit` asked for from the other family is an error, so that a
figure cannot mix the two.

Only matplotlib and numpy here, so the figures can be drawn wherever the data is.
"""

from __future__ import annotations

import io
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import matplotlib
from matplotlib.figure import Figure

FIGSIZE = (8, 4)  # readable at the default width of a notebook cell

UNIT_CONVENTION = ("measured bytes in binary units B, KiB, MiB, GiB (1 KiB = 2^10 B, "
                   "1 MiB = 2^20 B); model-scale figures in decimal GB (1 GB = 10^9 B)")
BINARY_UNITS = {"B": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}  # measured bytes
DECIMAL_UNITS = {"B": 1.0, "kB": 1e3, "MB": 1e6, "GB": 1e9}  # the paper's; GPUs are sold in GB

# One colour per category, the same in every figure of the course; the order is the order of a
# stack, bottom up: the model states, then what the step adds on top of them.
CATEGORY_COLORS = {
    "params": "#4c72b0",
    "grads": "#dd8452",
    "optimizer": "#55a868",
    "activations": "#c44e52",  # saved for backward (memory.track_memory(activations=True))
    "comm": "#8172b3",  # buffers a collective is using now (engines' state_tensors()["comm"])
    "other": "#8c8c8c",  # temporaries: whatever is alive and in no category above
}
# Categories a caller invents (e.g. "buffers") get these, never one of the colours above.
_EXTRA_COLORS = ["#937860", "#da8bc3", "#ccb974", "#64b5cd", "#8c613c", "#dc7ec0"]
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
# Spans a lesson names itself ("work", "phase 1: all-reduce"): light tones, one per name.
EXTRA_SPAN_COLORS = ["#d9d9d9", "#c6dbef", "#fdd0a2", "#dadaeb", "#c7e9c0", "#fcbba1"]
UNKNOWN_COLOR = "#bbbbbb"
SAME_COLOR = "#5f7ea3"  # one bar standing for every rank, where every rank is the same


class CourseFigure(Figure):
    """A Figure outside pyplot that shows itself as PNG when it is a notebook cell's value.

    Outside pyplot, nothing keeps it alive after the caller drops it and it is shown once,
    with or without `%matplotlib inline`. `byte_unit`: (name, bytes per unit) of its byte axis,
    for a caller that draws more lines on it in the same unit.
    """

    byte_unit: tuple[str, float] | None = None

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=96, metadata={"Software": None})
        return buffer.getvalue()


def figure(figsize: tuple[float, float] = FIGSIZE) -> tuple[CourseFigure, Any]:
    fig = CourseFigure(figsize=figsize, layout="constrained")
    return fig, fig.subplots()


# --- units ---------------------------------------------------------------------------------------


def pick_unit(max_bytes: float, decimal: bool = False,
              unit: str | None = None) -> tuple[str, float]:
    """(name, bytes per unit): `unit` if given, else the largest unit in which `max_bytes` is
    at least 1. decimal=False: B, KiB, MiB, GiB (measured); True: B, kB, MB, GB (model scale)."""
    units = DECIMAL_UNITS if decimal else BINARY_UNITS
    if unit is not None:
        if unit not in units:
            family = "decimal=True (model scale)" if unit in DECIMAL_UNITS else (
                "decimal=False (measured)" if unit in BINARY_UNITS else "no family")
            raise ValueError(f"unit {unit!r} is not one of {list(units)}: it belongs to "
                             f"{family}. The course's convention: {UNIT_CONVENTION}")
        return unit, units[unit]
    chosen = "B"
    for name, scale in units.items():
        if max_bytes >= scale:
            chosen = name
    return chosen, units[chosen]


def short(value: float) -> str:
    """3 significant digits without exponents: 0.0123, 38.5, 112, 1120."""
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def format_bytes(nbytes: float, unit: tuple[str, float]) -> str:
    """'438 KiB': a byte count in a figure's unit (`pick_unit`'s pair), the unit always said."""
    name, scale = unit
    return f"{short(nbytes / scale)} {name}"


def byte_label(what: str, unit: tuple[str, float]) -> str:
    """An axis label: 'bytes held (MiB)'."""
    return f"{what} ({unit[0]})"


# --- categories, ranks and legends ----------------------------------------------------------------


def category_order(categories: Sequence[str]) -> list[str]:
    """Known categories first, in a fixed order (params at the bottom of a stack), then the rest."""
    known = [c for c in CATEGORY_COLORS if c in categories]
    return known + [c for c in dict.fromkeys(categories) if c not in CATEGORY_COLORS]


def category_colors(categories: Sequence[str]) -> dict[str, str]:
    extra = iter(_EXTRA_COLORS * 10)
    return {c: CATEGORY_COLORS.get(c) or next(extra) for c in categories}


def category_label(category: str, categories: Sequence[str]) -> str:
    """The legend's name for a category. "other" says what it holds: without an "activations"
    category (a trace taken without activations=True), activations are in it too."""
    if category == "comm":
        return "comm (buffers in flight)"
    if category == "other":
        return ("other (temporaries)" if "activations" in categories
                else "other\n(activations, temporaries)")
    return category


def shown_categories(rows: Sequence[Mapping[str, float]]) -> list[str]:
    """The categories to draw, in stack order: those that hold bytes somewhere (an empty "comm"
    in every bar would only add a legend entry for nothing)."""
    present = category_order([c for row in rows for c in row])
    nonzero = [c for c in present if any(row.get(c, 0) for row in rows)]
    return nonzero or present[:1]


def rank_color(i: int) -> Any:
    return matplotlib.colormaps["tab10"](i % 10)


def all_equal(values: Sequence[Any]) -> bool:
    """More than one value, all the same (dicts compare with missing keys as 0)."""
    if len(values) < 2:
        return False
    if all(isinstance(v, Mapping) for v in values):
        keys = {k for v in values for k in v}
        values = [tuple(v.get(k, 0) for k in sorted(keys)) for v in values]
    return all(v == values[0] for v in values[1:])


def same_note(sizes: int | Collection[int]) -> str:
    """'same on all 4 ranks' (or '... all ranks' for groups of several sizes)."""
    sizes = {sizes} if isinstance(sizes, int) else set(sizes)
    return f"same on all {sizes.pop()} ranks" if len(sizes) == 1 else "same on all ranks"


def legend_outside(ax: Any, **kwargs: Any) -> None:
    """Legend to the right of the axes, so that it never hides a bar or a line."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, **kwargs)


def dedupe_legend(ax: Any, reverse: bool = False) -> list[Any]:
    """One legend entry per label (many bars share one); stacks read top-down when reversed."""
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # later duplicates overwrite, order of first seen kept
    formula = [h for lab, h in unique.items() if lab.startswith("formula")]
    items = [h for lab, h in unique.items() if not lab.startswith("formula")]
    if reverse:
        items.reverse()
    return items + formula
