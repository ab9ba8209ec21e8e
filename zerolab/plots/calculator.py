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

Activations (notebook 08): given a sequence length, the calculator adds what one rank keeps for
backward for its micro-batch (`theory.model_activation_bytes`, for the model's shape in
`theory.MODEL_SHAPES`: 4 bytes per element in fp32, 2 in mixed precision), with checkpointing
none, full (every block) or selective (the attention core). ZeRO shards none of it: the row is
the same for every stage. Without a sequence length, it shows model states only, as before.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from typing import Any

import ipywidgets as ipw
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from zerolab import plots, theory
from zerolab.plots import activations as activation_plots
from zerolab.plots.base import legend_outside

OPTIMIZERS = {"adam": "Adam / AdamW", "sgd_momentum": "SGD + momentum", "sgd": "SGD"}
PRECISION_LABELS = {"fp32": "fp32", "mixed": "mixed bf16/fp16"}
WORLD_SIZES = [2**i for i in range(11)]  # 1 .. 1024
# Nominal sizes, smallest first (shapes in theory.MODEL_SHAPES); "8B" is the slides' model.
PRESETS = dict(sorted({**theory.MODEL_PRESETS, "8B": 8e9}.items(), key=lambda kv: kv[1]))
SEQ_LENS = [2**i for i in range(9, 18)]  # 512 .. 131072 tokens
CHECKPOINT_LABELS = {"none": "none", "block": "full (every block)",
                     "attention": "selective (attention core)"}
CHECKPOINT_TEXT = {"none": "no checkpointing", "block": "full checkpointing",
                   "attention": "selective checkpointing"}
GPU_MEMORY = {"24 GB": 24e9, "40 GB": 40e9, "80 GB": 80e9, "141 GB": 141e9}


@dataclass(frozen=True)
class Activations:
    """One rank's activations for one micro-batch (the same for every stage)."""

    seq_len: int
    micro_batch: int
    checkpoint: str  # "none", "block" (full) or "attention" (selective)
    attention: str  # "sdpa" (fused) or "explicit"
    shape_name: str  # the MODEL_SHAPES entry used
    shape: theory.ModelShape
    bytes_per_element: int  # 4 in fp32, 2 in mixed precision
    nbytes: float  # theory.model_activation_bytes: kept for backward, + one recompute
    gpu_memory: float  # the GPU the longest sequence is computed for
    longest: dict[str, int]  # stage -> the longest sequence that fits on that GPU

    def of(self, seq_len: int, checkpoint: str | None = None) -> float:
        """The same activations at another sequence length (and checkpointing)."""
        return theory.model_activation_bytes(
            self.shape, seq_len, self.micro_batch, attention=self.attention,
            checkpoint=checkpoint or self.checkpoint, bytes_per_element=self.bytes_per_element)


def nearest_shape(num_params: float) -> str:
    """The MODEL_SHAPES entry closest in size (log scale) to a parameter count."""
    return min(theory.MODEL_SHAPES,
               key=lambda k: abs(math.log(PRESETS.get(k, 1) / max(num_params, 1.0))))


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
    activations: Activations | None = None  # with a sequence length only

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
        if self.activations is not None:
            display(Image(data=_png(activation_figure(self))))


def calculate(
    model: str | float = "7B",
    world_size: int = 8,
    stage: str = "ZeRO-3",
    precision: str = "fp32",
    optimizer: str = "adam",
    fp32_grad_accum: bool = False,
    seq_len: int | None = None,
    micro_batch: int = 1,
    checkpoint: str = "none",
    attention: str = "sdpa",
    shape: str | theory.ModelShape | None = None,
    gpu_memory: float = 80e9,
) -> Calculation:
    """The calculator's numbers. `model`: a preset name ('125M', '1.3B', '7B', '8B', '70B') or a
    parameter count. fp32_grad_accum only applies to mixed precision (ignored for fp32).

    seq_len: add the activations of a micro-batch of `micro_batch` sequences of that length,
    with `checkpoint` ('none', 'full'/'block', 'selective'/'attention') and `attention`
    ('sdpa', 'explicit'), for `shape` (default: the preset's, or the nearest preset's for a
    parameter count), and the longest sequence each stage fits in `gpu_memory` bytes.
    """
    if isinstance(model, str):
        num_params = float(PRESETS[model])
        name = model
    else:
        num_params = float(model)
        name = f"{num_params / 1e9:.3g}B params"
    precision = theory.precision_name(precision)
    accum = fp32_grad_accum and precision == "mixed"
    kwargs = {"precision": precision, "optimizer": optimizer, "fp32_grad_accum": accum}
    bytes_per_element = theory.PRECISIONS[precision]["grad_bytes"]
    stages = theory.all_stages(num_params, world_size, **kwargs)
    activations = None
    if seq_len is not None:
        if shape is None:
            shape = name if name in theory.MODEL_SHAPES else nearest_shape(num_params)
        shape_name = shape if isinstance(shape, str) else "custom"
        model_shape = theory.MODEL_SHAPES[shape] if isinstance(shape, str) else shape
        act = {"attention": attention, "checkpoint": theory.checkpoint_name(checkpoint),
               "bytes_per_element": bytes_per_element}
        activations = Activations(
            seq_len, micro_batch, act["checkpoint"], attention, shape_name, model_shape,
            bytes_per_element,
            theory.model_activation_bytes(model_shape, seq_len, micro_batch, **act), gpu_memory,
            {s: theory.longest_sequence(model_shape, gpu_memory, stages[s].total, micro_batch,
                                        **act) for s in theory.STAGES})
    return Calculation(
        model=name,
        num_params=num_params,
        world_size=world_size,
        stage=theory.stage_name(stage),
        precision=precision,
        optimizer=optimizer,
        fp32_grad_accum=accum,
        k=theory.optimizer_multiplier(optimizer, precision),
        stages=stages,
        comm={s: theory.comm_volume(num_params, world_size, s, bytes_per_element)
              for s in theory.STAGES},
        activations=activations,
    )


def _gb(nbytes: float) -> str:
    # GPU memory is quoted in GB: 1,120 GB reads better next to 80 GB cards than 1.12 TB.
    if nbytes >= theory.TB:
        return f"{nbytes / theory.GB:,.0f} GB"
    return theory.format_bytes(nbytes, decimal=True)


def summary(calc: Calculation) -> str:
    """One sentence: what the selected stage holds per GPU, against DDP (and the activations)."""
    ddp, sel = calc.stages["DDP"].total, calc.selected.total
    if calc.stage == "DDP":
        text = f"DDP holds {_gb(sel)} per GPU, the same on each of the {calc.world_size} GPUs."
    else:
        text = (f"{calc.stage} holds {_gb(sel)} per GPU on {calc.world_size} GPUs "
                f"(DDP: {_gb(ddp)}, {ddp / sel:.3g}x less).")
    if (act := calc.activations) is not None:
        text += (f" Activations of {act.micro_batch} x {act.seq_len:,} tokens add "
                 f"{_gb(act.nbytes)} on every GPU, whatever the stage "
                 f"({CHECKPOINT_TEXT[act.checkpoint]}).")
    return text


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
    if (act := calc.activations) is not None:
        gpu = _gb(act.gpu_memory)
        rows[4:4] = [
            ("activations (not sharded)", lambda s: _gb(act.nbytes)),
            ("<b>states + activations</b>",
             lambda s: f"<b>{_gb(calc.stages[s].total + act.nbytes)}</b>"),
            (f"longest s that fits in {gpu}", lambda s: f"{act.longest[s]:,}"),
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
    if (act := calc.activations) is not None:
        sh = act.shape
        caption = caption.replace("model states only (no activations)", (
            f"model states, and the activations of {act.micro_batch} x {act.seq_len:,} tokens "
            f"({act.shape_name} shape: h = {sh.hidden}, {sh.num_layers} layers, "
            f"{sh.num_heads} heads, vocabulary {sh.vocab_size:,}; {act.attention} attention, "
            f"{act.bytes_per_element} bytes per element, {CHECKPOINT_TEXT[act.checkpoint]})"))
    return (f'<div class="zerolab-calculator"><p>{caption}</p>'
            f"<p><b>{html.escape(summary(calc))}</b></p>"
            f'<table style="border-collapse:collapse"><thead><tr><th></th>{head}</tr></thead>'
            f"<tbody>{body}</tbody></table></div>")


def figure(calc: Calculation) -> Figure:
    """Stacked bars per stage (per GPU, in GB), every bar in the legend's colours; the selected
    stage is outlined (a legend entry of its own) and its name is bold. With a sequence length,
    the activations are stacked on top of every stage."""
    extra = {} if calc.activations is None else {"activations": calc.activations.nbytes}
    what = "model states" if calc.activations is None else "model states + activations"
    rows = [{**calc.stages[s].as_dict(), **extra} for s in theory.STAGES]
    fig = plots.memory_bars(
        rows,
        title=f"{calc.model}, {PRECISION_LABELS[calc.precision]}, {calc.world_size} GPUs: "
              f"{what} per GPU",
        labels=list(theory.STAGES),
        xlabel="stage",
        decimal=True,
    )
    ax = fig.axes[0]
    unit = fig.byte_unit
    selected = theory.STAGES.index(calc.stage)
    # Fading the other stages would show colours the legend does not: outline the chosen one.
    outline = Rectangle((selected - 0.36, 0), 0.72, sum(rows[selected].values()) / unit[1],
                        fill=False, edgecolor="black", linewidth=2.2, zorder=3,
                        label=f"selected: {calc.stage}")
    ax.add_patch(outline)
    ax.get_xticklabels()[selected].set_fontweight("bold")
    ax.set_ylabel(plots.byte_label("bytes per GPU", unit))
    act = calc.activations
    tallest = max(sum(row.values()) for row in rows)
    if act is not None and tallest > act.gpu_memory / 4:  # the GPU, where it is in range
        ax.axhline(act.gpu_memory / unit[1], color="black", linestyle="--", linewidth=1)
        ax.text(0.99, act.gpu_memory / unit[1], f"{_gb(act.gpu_memory)} GPU", ha="right",
                va="bottom", transform=ax.get_yaxis_transform(), fontsize=8)
        ax.set_ylim(top=max(ax.get_ylim()[1], act.gpu_memory / unit[1] * 1.1))
    legend = ax.get_legend()
    legend_outside(ax, handles=[*legend.legend_handles, outline],
                   labels=[*(t.get_text() for t in legend.get_texts()), outline.get_label()])
    return fig


def activation_figure(calc: Calculation) -> Figure:
    """The selected stage's bytes per GPU against the sequence length: model states alone, and
    with the activations under each checkpointing; the GPU's memory dashed. Needs seq_len."""
    act = calc.activations
    if act is None:
        raise ValueError("no activations: calculate(..., seq_len=...) first")
    states = calc.selected.total
    curves = {"model states": lambda s: states}
    for mode, label in CHECKPOINT_LABELS.items():
        curves[f"+ activations, {label.split(' (')[0]}"] = (
            lambda s, mode=mode: states + act.of(int(s), mode))
    chosen = f"+ activations, {CHECKPOINT_LABELS[act.checkpoint].split(' (')[0]}"
    # With fused attention, selective checkpointing keeps within a fraction of a percent of
    # none: the two curves coincide, and the legend says so rather than hide one.
    grid = [float(s) for s in SEQ_LENS]
    close = activation_plots.close_curves({k: [f(s) for s in grid] for k, f in curves.items()})
    names = {k: f"{k} (within 1% of {close[k].rsplit(', ', 1)[-1]})" if k in close else k
             for k in curves}
    curves, chosen = {names[k]: f for k, f in curves.items()}, names[chosen]
    return activation_plots.curves(
        {chosen: {act.seq_len: states + act.nbytes}}, curves,
        f"{calc.model}, {calc.stage}, N = {calc.world_size}, micro-batch {act.micro_batch}: "
        "per GPU", ylabel="bytes per GPU", x_range=(SEQ_LENS[0], SEQ_LENS[-1]), logx=True,
        logy=True, decimal=True, hlines={f"{_gb(act.gpu_memory)} GPU": act.gpu_memory},
        kinds=("", "this setting"))


def _png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, metadata={"Software": None})
    return buf.getvalue()


def _figure_html(calc: Calculation) -> str:
    data = base64.b64encode(_png(figure(calc))).decode("ascii")
    out = f'<img src="data:image/png;base64,{data}" alt="model-state memory per stage"/>'
    if calc.activations is not None:
        data = base64.b64encode(_png(activation_figure(calc))).decode("ascii")
        out += f'<img src="data:image/png;base64,{data}" alt="memory per GPU against s"/>'
    return out


def calculator_static(model: str | float = "7B", **settings: Any) -> Calculation:
    """The calculator without widgets: `calculate(model, **settings)`, which displays as the
    table and the figure (useful in exported notebooks and for pinned numbers)."""
    return calculate(model, **settings)


# What the interactive calculator starts with: `calculate`'s keywords. No sequence length: model
# states only, as notebooks 01-07 use it; pick one (seq_len=16384) to add the activations.
START = {"world_size": 8, "stage": "ZeRO-3", "precision": "fp32", "optimizer": "adam",
         "fp32_grad_accum": False, "seq_len": None, "micro_batch": 1, "checkpoint": "none",
         "attention": "sdpa", "gpu_memory": 80e9}


class Calculator(ipw.VBox):
    """The interactive calculator (an ipywidgets VBox). `.calculation` and `.table_html` hold
    what it shows now; `.controls` maps names to the control widgets."""

    def __init__(self, model: str | float = "7B", **settings: Any) -> None:
        """settings: `calculate`'s keywords, START's by default (seq_len=None: states only)."""
        if unknown := set(settings) - set(START):
            raise TypeError(f"unknown settings {sorted(unknown)}; expected some of {list(START)}")
        start = {**START, **settings}
        world_size, seq_len, gpu_memory = (start["world_size"], start["seq_len"],
                                           start["gpu_memory"])
        style = {"description_width": "110px"}
        preset = model if isinstance(model, str) else "custom"
        billions = (PRESETS[model] if isinstance(model, str) else model) / 1e9
        seq_lens = sorted({*SEQ_LENS, seq_len or SEQ_LENS[0]})
        gpus = {**GPU_MEMORY, _gb(gpu_memory): gpu_memory}
        self.controls = {
            "model": ipw.Dropdown(options=[*PRESETS, "custom"], value=preset,
                                description="model", style=style),
            "billions": ipw.BoundedFloatText(value=billions, min=1e-6, max=1e6, step=0.1,
                                           description="Ψ (billions)", style=style),
            "world_size": ipw.Dropdown(options=sorted({*WORLD_SIZES, world_size}),
                                     value=world_size, description="GPUs (N)", style=style),
            "stage": ipw.ToggleButtons(options=list(theory.STAGES),
                                     value=theory.stage_name(start["stage"]),
                                     description="stage", style=style),
            "precision": ipw.Dropdown(options=[(v, k) for k, v in PRECISION_LABELS.items()],
                                    value=theory.precision_name(start["precision"]),
                                    description="precision", style=style),
            "optimizer": ipw.Dropdown(options=[(v, k) for k, v in OPTIMIZERS.items()],
                                    value=start["optimizer"], description="optimizer",
                                    style=style),
            "fp32_grad_accum": ipw.Checkbox(value=start["fp32_grad_accum"],
                                          description="fp32 grad accumulation (+4Ψ, mixed only)",
                                          indent=False),
            # Activations: 0 = off (model states only, as in notebooks 01-07)
            "seq_len": ipw.Dropdown(options=[("off", 0), *((f"{t:,}", t) for t in seq_lens)],
                                  value=seq_len or 0, description="sequence length",
                                  style=style),
            "micro_batch": ipw.BoundedIntText(value=start["micro_batch"], min=1, max=4096,
                                            description="micro-batch", style=style),
            "attention": ipw.Dropdown(options=[("fused (SDPA)", "sdpa"),
                                             ("explicit softmax(QK^T)", "explicit")],
                                    value=start["attention"], description="attention",
                                    style=style),
            "checkpoint": ipw.ToggleButtons(options=[(v, k) for k, v in CHECKPOINT_LABELS.items()],
                                          value=theory.checkpoint_name(start["checkpoint"]),
                                          description="checkpointing", style=style),
            "gpu_memory": ipw.Dropdown(options=list(gpus.items()), value=gpu_memory,
                                     description="GPU memory", style=style),
        }
        self.table = ipw.HTML()
        self.image = ipw.Image(format="png", layout=ipw.Layout(max_width="800px"))
        self.activation_image = ipw.Image(format="png", layout=ipw.Layout(max_width="800px"))
        c = self.controls
        super().__init__([
            ipw.HBox([ipw.VBox([c["model"], c["billions"], c["world_size"]]),
                    ipw.VBox([c["precision"], c["optimizer"], c["fp32_grad_accum"]]),
                    ipw.VBox([c["seq_len"], c["micro_batch"], c["attention"],
                              c["gpu_memory"]])]),
            c["stage"], c["checkpoint"], self.table, self.image, self.activation_image,
        ])
        c["model"].observe(self._on_preset, names="value")
        c["billions"].observe(self._on_billions, names="value")
        for name in ("world_size", "stage", "precision", "optimizer", "fp32_grad_accum",
                     "seq_len", "micro_batch", "attention", "checkpoint", "gpu_memory"):
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
        return PRESETS[preset] / 1e9

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
            "seq_len": c["seq_len"].value or None,
            "micro_batch": c["micro_batch"].value,
            "attention": c["attention"].value,
            "checkpoint": c["checkpoint"].value,
            "gpu_memory": c["gpu_memory"].value,
        }

    def _update(self, change: dict | None = None) -> None:
        c = self.controls
        c["fp32_grad_accum"].disabled = c["precision"].value == "fp32"
        for name in ("micro_batch", "attention", "checkpoint", "gpu_memory"):
            c[name].disabled = not c["seq_len"].value
        self.calculation = calculate(**self.values())
        self.table.value = table_html(self.calculation)
        self.image.value = _png(figure(self.calculation))
        with_activations = self.calculation.activations is not None
        self.activation_image.layout.display = None if with_activations else "none"
        if with_activations:
            self.activation_image.value = _png(activation_figure(self.calculation))

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


def calculator(model: str | float = "7B", **settings: Any) -> Calculator:
    """The interactive memory calculator (a VBox). Display it as the last line of a cell.

    settings: `Calculator`'s (world_size, stage, precision, optimizer, fp32_grad_accum,
    seq_len (None: model states only), micro_batch, checkpoint, attention, gpu_memory).
    """
    return Calculator(model, **settings)
