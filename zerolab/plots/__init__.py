"""The course's figures. Everything else in zerolab returns data; the plots modules draw it.

Each function takes plain data (lists, dicts, or the comm logs), returns a matplotlib Figure
outside pyplot (a `CourseFigure`): a notebook displays the returned figure, a test inspects it.
They live by idea in memory.py (bytes held: per rank, over a step, against N), comm.py (bytes
sent per rank, the timeline of compute and collectives), activations.py (notebook 08),
nodes.py (notebook 09), schematics.py and holdings.py (pictures of what moves: the ring
all-reduce, DDP's buckets, ZeRO-3's units, the HSDP mesh, the flat layout, and who holds what
per stage, the ZeRO paper's Figure 1, each drawn from data recorded on real ranks by
zerolab.lessons.schematics) and calculator.py (the memory calculator, with its ipywidgets
controls); their shared units, colours and legends are in base.py. `zerolab.plots.<name>`
reaches every figure but the calculator's (`zerolab.plots.calculator`, which needs ipywidgets).

Units, one convention for the whole course (`UNIT_CONVENTION`, for a notebook to print once):
measured bytes in binary units, B, KiB, MiB, GiB (1 MiB = 2^20 B); model-scale figures (the
paper's, a GPU's) in decimal GB (1 GB = 10^9 B), with decimal=True. Every byte axis and every
bar total says its unit; `unit=` forces one, so that two figures compared side by side read
alike.

Memory categories, in this order and these colours everywhere: params, grads, optimizer (the
model states), activations (saved for backward), comm (buffers a collective is using now) and
other (temporaries: whatever is left).

Only matplotlib and numpy here, so the figures can be drawn wherever the data is.
"""

from __future__ import annotations

from zerolab.plots import activations
from zerolab.plots.base import (
    CATEGORY_COLORS,
    FIGSIZE,
    OP_COLORS,
    SPAN_COLORS,
    UNIT_CONVENTION,
    CourseFigure,
    byte_label,
    format_bytes,
    pick_unit,
)
from zerolab.plots.comm import bytes_per_rank, timeline, unit_name
from zerolab.plots.holdings import holdings_by_stage, holdings_over_step
from zerolab.plots.memory import memory_bars, memory_timeline, memory_vs_world_size
from zerolab.plots.meshes import axis_bytes
from zerolab.plots.nodes import grouped_bytes, loss_curves
from zerolab.plots.schematics import (
    ddp_buckets,
    flat_layout,
    hsdp_mesh,
    ring_all_reduce,
    zero3_lifecycle,
)

__all__ = [
    "CATEGORY_COLORS",
    "FIGSIZE",
    "OP_COLORS",
    "SPAN_COLORS",
    "UNIT_CONVENTION",
    "CourseFigure",
    "activations",
    "axis_bytes",
    "byte_label",
    "bytes_per_rank",
    "ddp_buckets",
    "flat_layout",
    "format_bytes",
    "grouped_bytes",
    "holdings_by_stage",
    "holdings_over_step",
    "hsdp_mesh",
    "loss_curves",
    "memory_bars",
    "memory_timeline",
    "memory_vs_world_size",
    "pick_unit",
    "ring_all_reduce",
    "timeline",
    "unit_name",
    "zero3_lifecycle",
]
