"""A memory calculator for the notebooks: pick a model, a world size, a stage; read the bytes.

Two layers, so that the numbers are testable without a browser:

- `calculate(...)` is pure: control values in, a `Calculation` out (per-stage bytes, formulas,
  communication). `table_html(calc)` and `figure(calc)` render it.
- `calculator(...)` wraps them in ipywidgets controls that recompute on every change.

Where widgets cannot render (a notebook viewer, nbconvert, a frontend without the widget
extension), the calculator still shows a static table and figure: its display bundle carries an
HTML fallback, and `calculator_static(...)` shows the same without any widget.

Optimizer multipliers K (optimizer-state bytes per parameter, `theory.optimizer_multiplier`):
Adam/AdamW 8 in fp32 (m, v), 12 mixed (+ fp32 master weights); SGD with momentum 4 / 8; plain
SGD 0 / 4.
"""

from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass
from typing import Any

import ipywidgets as ipw
from matplotlib.figure import Figure

from zerolab import plots, theory

OPTIMIZERS = {"adam": "Adam / AdamW", "sgd_momentum": "SGD + momentum", "sgd": "SGD"}
PRECISION_LABELS = {"fp32": "fp32", "mixed": "mixed bf16/fp16"}
WORLD_SIZES = [2**i for i in range(11)]  # 1 .. 1024


@dataclass(frozen=True)
class Calculation:
    """Everything the calculator shows, for one choice of controls."""

    model: str  # preset name or a readable size, e.g. '7B' or '3.5B params'
    num_params: float
    world_size: int
    stage: str
    precision: str
    optimizer: str
    fp32_grad_accum: bool
    k: int
    stages: dict[str, theory.ModelStates]  # every stage, so the table can compare them
    comm: dict[str, theory.CommVolume]

    @property
    def selected(self) -> theory.ModelStates:
        return self.stages[self.stage]

    def _repr_html_(self) -> str:  # static display: the table and the figure, no widgets
        return table_html(self) + _figure_html(self)

    def _ipython_display_(self) -> None:
        # Two outputs rather than one HTML blob: the table (text, stable under nbval) and the
        # figure as an ordinary image.
        from IPython.display import HTML, Image, display

        display(HTML(table_html(self)))
        display(Image(data=_png(figure(self))))


def calculate(
    model: str | float = "7B",
    world_size: int = 8,
    stage: str = "ZeRO-3",
    precision: str = "fp32",
    optimizer: str = "adam",
    fp32_grad_accum: bool = False,
) -> Calculation:
    """The calculator's numbers. `model`: a preset name ('125M', '1.3B', '7B', '70B') or a
    parameter count. fp32_grad_accum only applies to mixed precision (ignored for fp32)."""
    if isinstance(model, str):
        num_params = float(theory.MODEL_PRESETS[model])
        name = model
    else:
        num_params = float(model)
        name = f"{num_params / 1e9:.3g}B params"
    precision = theory.precision_name(precision)
    accum = fp32_grad_accum and precision == "mixed"
    kwargs = {"precision": precision, "optimizer": optimizer, "fp32_grad_accum": accum}
    bytes_per_element = theory.PRECISIONS[precision]["grad_bytes"]
    return Calculation(
        model=name,
        num_params=num_params,
        world_size=world_size,
        stage=theory.stage_name(stage),
        precision=precision,
        optimizer=optimizer,
        fp32_grad_accum=accum,
        k=theory.optimizer_multiplier(optimizer, precision),
        stages=theory.all_stages(num_params, world_size, **kwargs),
        comm={s: theory.comm_volume(num_params, world_size, s, bytes_per_element)
              for s in theory.STAGES},
    )


def _gb(nbytes: float) -> str:
    # GPU memory is quoted in GB: 1,120 GB reads better next to 80 GB cards than 1.12 TB.
    if nbytes >= theory.TB:
        return f"{nbytes / theory.GB:,.0f} GB"
    return theory.format_bytes(nbytes, decimal=True)


def summary(calc: Calculation) -> str:
    """One sentence: what the selected stage holds per GPU, against DDP."""
    ddp, sel = calc.stages["DDP"].total, calc.selected.total
    if calc.stage == "DDP":
        return f"DDP holds {_gb(sel)} per GPU, the same on each of the {calc.world_size} GPUs."
    return (f"{calc.stage} holds {_gb(sel)} per GPU on {calc.world_size} GPUs "
            f"(DDP: {_gb(ddp)}, {ddp / sel:.3g}x less).")


def table_html(calc: Calculation) -> str:
    """An HTML table: bytes per category for every stage, the selected stage highlighted."""
    kwargs = {"precision": calc.precision, "optimizer": calc.optimizer,
              "fp32_grad_accum": calc.fp32_grad_accum}
    rows = [
        ("params", lambda s: _gb(calc.stages[s].params)),
        ("grads", lambda s: _gb(calc.stages[s].grads)),
        ("optimizer", lambda s: _gb(calc.stages[s].optimizer)),
        ("<b>total</b>", lambda s: f"<b>{_gb(calc.stages[s].total)}</b>"),
        ("formula", lambda s: theory.memory_formula(s, **kwargs)),
        ("comm per step", lambda s: f"{calc.comm[s].elements / calc.num_params:g}Ψ elements"),
        # 4 B per element in fp32, 2 B in mixed precision (16-bit grads and params on the wire)
        ("sent per GPU (ring)", lambda s: _gb(calc.comm[s].ring_sent_bytes)),
    ]
    hi = "background:#fff3c4;"
    cell = "padding:2px 10px;text-align:right;"
    head = "".join(
        f'<th style="{cell}{hi if s == calc.stage else ""}">{s}</th>' for s in theory.STAGES)
    body = "".join(
        f'<tr><td style="{cell}text-align:left">{name}</td>'
        + "".join(f'<td style="{cell}{hi if s == calc.stage else ""}">{value(s)}</td>'
                  for s in theory.STAGES)
        + "</tr>"
        for name, value in rows
    )
    precision = PRECISION_LABELS[calc.precision]
    if calc.fp32_grad_accum:
        precision += " + fp32 grad accumulation"
    optimizer = OPTIMIZERS.get(calc.optimizer, calc.optimizer)
    caption = (f"<b>{html.escape(calc.model)}</b> ({calc.num_params:,.0f} parameters), "
               f"N = {calc.world_size}, {precision}, {optimizer} (K = {calc.k}). "
               "Per GPU, model states only (no activations), 1 GB = 1e9 B.")
    return (f'<div class="zerolab-calculator"><p>{caption}</p>'
            f"<p><b>{html.escape(summary(calc))}</b></p>"
            f'<table style="border-collapse:collapse"><thead><tr><th></th>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def figure(calc: Calculation) -> Figure:
    """Stacked bars per stage (per GPU, in GB), the selected stage solid, the others faded."""
    fig = plots.memory_bars(
        [calc.stages[s].as_dict() for s in theory.STAGES],
        title=f"{calc.model}, {PRECISION_LABELS[calc.precision]}, {calc.world_size} GPUs: "
              "model states per GPU",
        labels=list(theory.STAGES),
        xlabel="stage",
        decimal=True,
    )
    ax = fig.axes[0]
    selected = theory.STAGES.index(calc.stage)
    for i, patch in enumerate(ax.patches):  # bars are drawn category by category, stage order
        if i % len(theory.STAGES) != selected:
            patch.set_alpha(0.35)
    ax.get_xticklabels()[selected].set_fontweight("bold")
    return fig


def _png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, metadata={"Software": None})
    return buf.getvalue()


def _figure_html(calc: Calculation) -> str:
    data = base64.b64encode(_png(figure(calc))).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="model-state memory per stage"/>'


def calculator_static(model: str | float = "7B", **settings: Any) -> Calculation:
    """The calculator without widgets: `calculate(model, **settings)`, which displays as the
    table and the figure (useful in exported notebooks and for pinned numbers)."""
    return calculate(model, **settings)


class Calculator(ipw.VBox):
    """The interactive calculator (an ipywidgets VBox). `.calculation` and `.table_html` hold
    what it shows now; `.controls` maps names to the control widgets."""

    def __init__(
        self,
        model: str | float = "7B",
        world_size: int = 8,
        stage: str = "ZeRO-3",
        precision: str = "fp32",
        optimizer: str = "adam",
        fp32_grad_accum: bool = False,
    ) -> None:
        style = {"description_width": "110px"}
        preset = model if isinstance(model, str) else "custom"
        billions = (theory.MODEL_PRESETS[model] if isinstance(model, str) else model) / 1e9
        self.controls = {
            "model": ipw.Dropdown(options=[*theory.MODEL_PRESETS, "custom"], value=preset,
                                description="model", style=style),
            "billions": ipw.BoundedFloatText(value=billions, min=1e-6, max=1e6, step=0.1,
                                           description="Ψ (billions)", style=style),
            "world_size": ipw.Dropdown(options=sorted({*WORLD_SIZES, world_size}),
                                     value=world_size, description="GPUs (N)", style=style),
            "stage": ipw.ToggleButtons(options=list(theory.STAGES), value=theory.stage_name(stage),
                                     description="stage", style=style),
            "precision": ipw.Dropdown(options=[(v, k) for k, v in PRECISION_LABELS.items()],
                                    value=theory.precision_name(precision),
                                    description="precision", style=style),
            "optimizer": ipw.Dropdown(options=[(v, k) for k, v in OPTIMIZERS.items()],
                                    value=optimizer, description="optimizer", style=style),
            "fp32_grad_accum": ipw.Checkbox(value=fp32_grad_accum,
                                          description="fp32 grad accumulation (+4Ψ, mixed only)",
                                          indent=False),
        }
        self.table = ipw.HTML()
        self.image = ipw.Image(format="png", layout=ipw.Layout(max_width="800px"))
        c = self.controls
        super().__init__([
            ipw.HBox([ipw.VBox([c["model"], c["billions"], c["world_size"]]),
                    ipw.VBox([c["precision"], c["optimizer"], c["fp32_grad_accum"]])]),
            c["stage"], self.table, self.image,
        ])
        c["model"].observe(self._on_preset, names="value")
        c["billions"].observe(self._on_billions, names="value")
        for name in ("world_size", "stage", "precision", "optimizer", "fp32_grad_accum"):
            c[name].observe(self._update, names="value")
        self._update()

    # The preset and the size box follow each other; each change recomputes exactly once.
    def _on_preset(self, change: dict) -> None:
        billions = self.controls["billions"]
        if change["new"] != "custom" and billions.value != self._preset_billions(change["new"]):
            billions.value = self._preset_billions(change["new"])  # -> _on_billions -> _update
        else:
            self._update()

    def _on_billions(self, change: dict) -> None:
        preset = self.controls["model"].value
        if preset != "custom" and change["new"] != self._preset_billions(preset):
            self.controls["model"].value = "custom"  # a typed size is no longer the preset
        else:
            self._update()

    @staticmethod
    def _preset_billions(preset: str) -> float:
        return theory.MODEL_PRESETS[preset] / 1e9

    def values(self) -> dict:
        """The controls' values, as `calculate` takes them."""
        c = self.controls
        preset = c["model"].value
        return {
            "model": preset if preset != "custom" else c["billions"].value * 1e9,
            "world_size": c["world_size"].value,
            "stage": c["stage"].value,
            "precision": c["precision"].value,
            "optimizer": c["optimizer"].value,
            "fp32_grad_accum": c["fp32_grad_accum"].value,
        }

    def _update(self, change: dict | None = None) -> None:
        c = self.controls
        c["fp32_grad_accum"].disabled = c["precision"].value == "fp32"
        self.calculation = calculate(**self.values())
        self.table.value = table_html(self.calculation)
        self.image.value = _png(figure(self.calculation))

    @property
    def table_html(self) -> str:
        """The table as shown now (HTML)."""
        return self.table.value

    def show_static(self) -> Calculation:
        """The current numbers as a static display (table + figure), for exported notebooks."""
        return self.calculation

    def _repr_mimebundle_(self, **kwargs) -> dict:
        # The widget view for frontends that render widgets, and a static HTML fallback (table
        # + figure) for those that do not: each frontend picks the richest type it supports.
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        bundle["text/html"] = self.calculation._repr_html_()
        return bundle


def calculator(
    model: str | float = "7B",
    world_size: int = 8,
    stage: str = "ZeRO-3",
    precision: str = "fp32",
    optimizer: str = "adam",
    fp32_grad_accum: bool = False,
) -> Calculator:
    """The interactive memory calculator (a VBox). Display it as the last line of a cell."""
    return Calculator(model, world_size, stage, precision, optimizer, fp32_grad_accum)
