"""A calculator of a rank's peak, predicted without building the model (zerolab.predict).

Where the memory calculator (calculator.py) adds formulas (model states, activations), this one
runs the model's forward and backward on fake tensors under each stage's schedule and reads
the peak off it, by the ledger's rows. Two layers, testable without a browser:

- `calculate(model, precision, seq_len, micro_batch)`: every stage's prediction at every world
  size of WORLD_SIZES (one fake run per stage serves them all; kept, so changing N or the GPU
  is free); `table_html(...)` and `figure(...)` render one world size of it;
- `peak_calculator(...)`: ipywidgets controls that recompute on change.

The predictions are for a GPU job of zerolab's engines (whole-tensor AdamW, NCCL): `predict.
gpu_job`. A model change costs a few seconds (four fake runs); the rest is instant.
"""

from __future__ import annotations

import functools
import html
import io
from typing import Any

import ipywidgets as ipw
import torch
from matplotlib.figure import Figure

from zerolab import models, predict
from zerolab.ledger import ROWS
from zerolab.plots import base
from zerolab.plots.base import category_colors, category_order, legend_outside
from zerolab.theory import format_bytes

MODELS = {"7B": models.GPT_7B, "GPT-2 124M": models.GPT2_124M, "course GPT": models.GPTConfig()}
PRECISIONS = {"bf16 mixed": torch.bfloat16, "fp32": None}
WORLD_SIZES = [2**i for i in range(11)]  # 1 .. 1024
SEQ_LENS = [2**i for i in range(4, 14)]  # 16 .. 8192 tokens (at most the model's block_size)
GPU_MEMORY = {"24 GB": 24e9, "40 GB": 40e9, "80 GB": 80e9, "141 GB": 141e9}
START = {"model": "7B", "world_size": 8, "precision": "bf16 mixed", "seq_len": 4096,
         "micro_batch": 1, "gpu_memory": 80e9}


@functools.lru_cache(maxsize=16)
def calculate(model: str, precision: str, seq_len: int, micro_batch: int
              ) -> dict[str, list[predict.Prediction]]:
    """Every stage's predicted peak per rank at each of WORLD_SIZES: {stage: [Prediction]}."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {list(MODELS)}")
    config = MODELS[model]
    if not 1 <= seq_len <= config.block_size:
        raise ValueError(f"seq_len must be 1 to the model's block_size ({config.block_size}), "
                         f"got {seq_len}")
    return predict.gpu_job(config, WORLD_SIZES, batch_size=micro_batch, seq_len=seq_len,
                           param_dtype=PRECISIONS[precision])


def at(predictions: dict[str, list[predict.Prediction]],
       world_size: int) -> dict[str, predict.Prediction]:
    """Each stage's prediction at one world size."""
    return {stage: next(p for p in ps if p.world_size == world_size)
            for stage, ps in predictions.items()}


def summary(predictions: dict[str, list[predict.Prediction]], world_size: int,
            gpu_memory: float) -> str:
    """One sentence per stage: its peak at world_size, and the fewest GPUs it fits on."""
    lines = []
    for stage, p in at(predictions, world_size).items():
        n = predict.smallest_fitting(predictions[stage], gpu_memory)
        fits = f"fits from N = {n}" if n else f"fits on no N up to {WORLD_SIZES[-1]}"
        lines.append(f"{stage} peaks at {format_bytes(p.peak_bytes, decimal=True)} per GPU on "
                     f"{world_size} GPUs (in {p.phase}); on {gpu_memory / 1e9:.0f} GB it "
                     f"{fits}.")
    return " ".join(lines)


def _unit(chosen: dict[str, predict.Prediction]) -> tuple[str, float]:
    return base.pick_unit(max(p.peak_bytes for p in chosen.values()), decimal=True)


def table_html(predictions: dict[str, list[predict.Prediction]], world_size: int,
               gpu_memory: float) -> str:
    """The rows by stage at one world size, in GB, the peak, and whether it fits."""
    chosen = at(predictions, world_size)
    name, scale = _unit(chosen)
    rows = [r for r in ROWS if any(p.rows[r] for p in chosen.values())]
    head = "".join(f"<th>{s}</th>" for s in chosen)
    body = "".join(f"<tr><td>{r}</td>" + "".join(
        f"<td>{p.rows[r] / scale:.2f}</td>" for p in chosen.values()) + "</tr>" for r in rows)
    peak = "".join(f"<td><b>{p.peak_bytes / scale:.2f}</b></td>" for p in chosen.values())
    fits = "".join(f"<td>{'yes' if p.peak_bytes <= gpu_memory else 'no'}</td>"
                   for p in chosen.values())
    return (f"<p>{html.escape(summary(predictions, world_size, gpu_memory))}</p>"
            f"<table><tr><th>{name} per GPU, N = {world_size}</th>{head}</tr>{body}"
            f"<tr><td><b>peak</b></td>{peak}</tr>"
            f"<tr><td>fits in {gpu_memory / 1e9:.0f} GB</td>{fits}</tr></table>")


def figure(predictions: dict[str, list[predict.Prediction]], world_size: int,
           gpu_memory: float, title: str = "") -> Figure:
    """Stacked bars, one per stage at world_size, by row; the GPU's memory as a line."""
    chosen = at(predictions, world_size)
    name, scale = _unit(chosen)
    fig, ax = base.figure()
    rows = category_order([r for r in ROWS if any(p.rows[r] for p in chosen.values())])
    colors = category_colors(rows)
    bottoms = [0.0] * len(chosen)
    for row in rows:
        values = [p.rows[row] / scale for p in chosen.values()]
        ax.bar(list(chosen), values, bottom=bottoms, label=row, color=colors[row])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if gpu_memory <= 1.5 * max(bottoms) * scale:  # a line far above the bars hides them
        ax.axhline(gpu_memory / scale, color="black", linestyle="--", linewidth=1,
                   label=f"{gpu_memory / 1e9:.0f} GB GPU")
    ax.set_ylabel(f"{name} per GPU at the peak (predicted)")
    ax.set_title(title or f"Predicted peak per GPU, N = {world_size}")
    legend_outside(ax)
    return fig


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return buffer.getvalue()


class PeakCalculator(ipw.VBox):
    """The widget: `.controls` by name, `.predictions` (calculate's) and `.table_html` now."""

    def __init__(self, **settings: Any) -> None:
        if unknown := set(settings) - set(START):
            raise TypeError(f"unknown settings {sorted(unknown)}; expected some of {list(START)}")
        start = {**START, **settings}
        style = {"description_width": "110px"}
        self.controls = {
            "model": ipw.Dropdown(options=list(MODELS), value=start["model"],
                                  description="model", style=style),
            "world_size": ipw.Dropdown(options=WORLD_SIZES, value=start["world_size"],
                                       description="GPUs (N)", style=style),
            "precision": ipw.Dropdown(options=list(PRECISIONS), value=start["precision"],
                                      description="precision", style=style),
            "seq_len": ipw.Dropdown(options=SEQ_LENS, value=start["seq_len"],
                                    description="sequence length", style=style),
            "micro_batch": ipw.BoundedIntText(value=start["micro_batch"], min=1, max=64,
                                              description="micro-batch", style=style),
            "gpu_memory": ipw.Dropdown(options=list(GPU_MEMORY.items()),
                                       value=start["gpu_memory"], description="GPU memory",
                                       style=style),
        }
        self.table = ipw.HTML()
        self.image = ipw.Image(format="png", layout=ipw.Layout(max_width="800px"))
        c = self.controls
        super().__init__([ipw.HBox([ipw.VBox([c["model"], c["world_size"], c["precision"]]),
                                    ipw.VBox([c["seq_len"], c["micro_batch"],
                                              c["gpu_memory"]])]), self.table, self.image])
        for control in c.values():
            control.observe(self._update, names="value")
        self._update()

    def _update(self, change: dict | None = None) -> None:
        c = {name: control.value for name, control in self.controls.items()}
        seq_len = min(c["seq_len"], MODELS[c["model"]].block_size)
        self.predictions = calculate(c["model"], c["precision"], seq_len, c["micro_batch"])
        self.table_html = table_html(self.predictions, c["world_size"], c["gpu_memory"])
        self.table.value = self.table_html
        self.image.value = _png(figure(self.predictions, c["world_size"], c["gpu_memory"],
                                       f"{c['model']}, {c['precision']}, {seq_len} tokens x "
                                       f"{c['micro_batch']}: predicted peak per GPU, N = "
                                       f"{c['world_size']}"))


def peak_calculator(**settings: Any) -> PeakCalculator:
    """The calculator, started at START's settings or those given."""
    return PeakCalculator(**settings)
