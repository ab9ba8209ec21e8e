"""The memory calculator: the pure numbers, then the widget reacting to its controls."""

import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

pytest.importorskip("ipywidgets")

from zerolab import plots, theory  # noqa: E402
from zerolab.plots import calculator as widgets  # noqa: E402


def text(html: str) -> str:
    """The table's visible text, tags stripped, spaces collapsed."""
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


# --- the pure part -------------------------------------------------------------------------------


def test_calculate_seeds_7b():
    calc = widgets.calculate("7B", world_size=8, stage="ZeRO-2")
    assert calc.k == 8
    assert calc.selected.total == pytest.approx(38.5e9)
    shown = text(widgets.table_html(calc))
    for figure in ("112 GB", "63 GB", "38.5 GB", "14 GB", "8Ψ + 8Ψ/N", "16Ψ/N"):
        assert figure in shown
    assert "ZeRO-2 holds 38.5 GB per GPU on 8 GPUs (DDP: 112 GB, 2.91x less)" in shown


def test_calculate_paper_row():
    calc = widgets.calculate(7.5e9, world_size=64, stage="ZeRO-3", precision="mixed")
    assert calc.k == 12
    shown = text(widgets.table_html(calc))
    for figure in ("120 GB", "31.4 GB", "16.6 GB", "1.88 GB", "4Ψ + 12Ψ/N"):
        assert figure in shown
    assert calc.model == "7.5B params"


def test_calculate_communication_row():
    calc = widgets.calculate("125M", world_size=4)
    shown = text(widgets.table_html(calc))
    assert "2Ψ elements" in shown and "3Ψ elements" in shown
    # ZeRO-3 ring bytes per GPU: 3Ψ x 4 B x 3/4 = 1.125 GB
    assert calc.comm["ZeRO-3"].ring_sent_bytes == pytest.approx(1.125e9)


def test_fp32_grad_accum_only_for_mixed():
    assert widgets.calculate(fp32_grad_accum=True).fp32_grad_accum is False  # ignored for fp32
    calc = widgets.calculate("7B", 8, "ZeRO-2", precision="mixed", fp32_grad_accum=True)
    assert calc.selected.total == pytest.approx(theory.deepspeed_zero2_bytes(7e9, 8))
    assert "2Ψ + 18Ψ/N" in text(widgets.table_html(calc))


def bar_patches(ax):
    """The stacked bars (the selected stage's outline is a patch too)."""
    return [p for p in ax.patches if p.get_fill()]


def test_figure_highlights_the_selected_stage_as_its_legend_says():
    fig = widgets.figure(widgets.calculate(stage="ZeRO-1"))
    ax = fig.axes[0]
    assert ax.get_xticklabels()[1].get_fontweight() == "bold"
    # Every bar in full colour, the colour its category has in the legend: nothing faded.
    assert {p.get_alpha() for p in bar_patches(ax)} == {None}
    legend = ax.get_legend()
    entries = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
    assert list(entries) == ["optimizer", "grads", "params", "selected: ZeRO-1"]
    bar_colours = {matplotlib.colors.to_hex(p.get_facecolor()) for p in bar_patches(ax)}
    legend_colours = {matplotlib.colors.to_hex(entries[c].get_facecolor())
                      for c in ("optimizer", "grads", "params")}
    assert bar_colours == legend_colours == {plots.CATEGORY_COLORS[c]
                                             for c in ("params", "grads", "optimizer")}
    # The selected stage: one outline around its whole stack (63 GB), drawn over stage 1 only.
    (outline,) = [p for p in ax.patches if not p.get_fill()]
    assert outline.get_x() < 1 < outline.get_x() + outline.get_width()
    assert outline.get_height() == pytest.approx(63)
    assert ax.get_ylabel() == "bytes per GPU (GB)"
    assert [t.get_text() for t in ax.texts] == ["112 GB", "63 GB", "38.5 GB", "14 GB"]


def test_static_display_has_table_and_figure():
    calc = widgets.calculator_static("1.3B", world_size=16, stage="DDP")
    html = calc._repr_html_()
    assert "<table" in html and "data:image/png;base64," in html
    assert "DDP holds 20.8 GB per GPU" in text(html)


def test_static_display_in_ipython_is_two_outputs(monkeypatch):
    pytest.importorskip("IPython")
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    widgets.calculator_static()._ipython_display_()
    assert isinstance(shown[0], IPython.display.HTML) and "<table" in shown[0].data
    assert isinstance(shown[1], IPython.display.Image)


# --- the widget ----------------------------------------------------------------------------------


def test_calculator_builds_and_shows_the_seeds_numbers():
    import ipywidgets

    calc = widgets.calculator()
    assert isinstance(calc, ipywidgets.VBox)
    assert "ZeRO-3 holds 14 GB per GPU on 8 GPUs" in text(calc.table_html)
    assert bytes(calc.image.value).startswith(b"\x89PNG")
    assert set(calc.controls) == {"model", "billions", "world_size", "stage", "precision",
                                  "optimizer", "fp32_grad_accum", "seq_len", "micro_batch",
                                  "attention", "checkpoint", "gpu_memory"}


def test_calculator_updates_when_controls_change():
    calc = widgets.calculator()
    png = bytes(calc.image.value)

    calc.controls["world_size"].value = 64
    assert "ZeRO-3 holds 1.75 GB per GPU on 64 GPUs" in text(calc.table_html)
    assert bytes(calc.image.value) != png  # the figure was redrawn

    calc.controls["stage"].value = "ZeRO-1"
    assert "ZeRO-1 holds 56.9 GB per GPU" in text(calc.table_html)

    calc.controls["precision"].value = "mixed"
    assert "K = 12" in text(calc.table_html)
    assert "ZeRO-1 holds 29.3 GB per GPU" in text(calc.table_html)  # 4Ψ + 12Ψ/64

    calc.controls["optimizer"].value = "sgd"
    assert "K = 4" in text(calc.table_html)


def test_preset_and_custom_size_follow_each_other():
    calc = widgets.calculator()
    calc.controls["model"].value = "70B"
    assert calc.controls["billions"].value == 70
    assert "DDP: 1,120 GB" in text(calc.table_html)

    calc.controls["billions"].value = 3.5  # typing a size leaves the preset
    assert calc.controls["model"].value == "custom"
    assert calc.calculation.num_params == pytest.approx(3.5e9)
    assert "DDP: 56 GB" in text(calc.table_html)

    calc.controls["model"].value = "125M"
    assert calc.controls["billions"].value == pytest.approx(0.125)
    assert calc.calculation.model == "125M"


def test_each_change_recomputes_once(monkeypatch):
    calc = widgets.calculator()
    calls = []
    real = widgets.calculate
    monkeypatch.setattr(widgets, "calculate", lambda **kw: calls.append(kw) or real(**kw))
    calc.controls["model"].value = "1.3B"  # also writes the size box: still one recompute
    calc.controls["billions"].value = 2.0  # also switches the preset to custom: one
    calc.controls["model"].value = "1.3B"
    assert len(calls) == 3


def test_fp32_grad_checkbox_enabled_only_for_mixed():
    calc = widgets.calculator()
    box = calc.controls["fp32_grad_accum"]
    assert box.disabled
    calc.controls["precision"].value = "mixed"
    assert not box.disabled
    box.value = True
    assert "2Ψ + 18Ψ/N" in text(calc.table_html)


def test_calculator_falls_back_to_static_html():
    calc = widgets.calculator(model="7B", world_size=8, stage="ZeRO-2")
    bundle = calc._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # widget frontends
    assert "<table" in bundle["text/html"] and "data:image/png" in bundle["text/html"]
    assert "ZeRO-2 holds 38.5 GB" in text(bundle["text/html"])
    assert calc.show_static() is calc.calculation


# --- activations (notebook 08) -------------------------------------------------------------------


def test_without_a_sequence_length_the_calculator_is_unchanged():
    calc = widgets.calculate("7B", world_size=8, stage="ZeRO-3")
    assert calc.activations is None
    shown = text(widgets.table_html(calc))
    assert "model states only (no activations)" in shown and "activations (not" not in shown
    assert len(bar_patches(widgets.figure(calc).axes[0])) == 3 * 4  # params, grads, optim.


def test_activations_are_the_same_for_every_stage():
    calc = widgets.calculate("8B", world_size=8, stage="ZeRO-3", precision="mixed",
                             seq_len=8192)
    act = calc.activations
    shape = theory.MODEL_SHAPES["8B"]
    assert act.shape == shape and act.bytes_per_element == 2
    assert act.nbytes == theory.model_activation_bytes(shape, 8192, bytes_per_element=2)
    shown = text(widgets.table_html(calc))
    assert shown.count(theory.format_bytes(act.nbytes, decimal=True)) >= 4  # one per stage
    assert "ZeRO-3 holds 16 GB per GPU on 8 GPUs (DDP: 128 GB, 8x less)." in shown
    assert "add 36.6 GB on every GPU, whatever the stage (no checkpointing)" in shown
    assert "longest s that fits in 80 GB" in shown and "14,311" in shown  # ZeRO-3, N = 8
    assert act.longest["DDP"] == 0  # 128 GB of model states: nothing fits


def test_checkpointing_and_micro_batch_in_the_calculator():
    def nbytes(**kw):
        return widgets.calculate("8B", 8, "ZeRO-3", "mixed", seq_len=4096, **kw).activations.nbytes
    assert nbytes(micro_batch=2) == pytest.approx(2 * nbytes(), rel=1e-6)
    assert nbytes(checkpoint="full") < nbytes(checkpoint="selective") <= nbytes()
    assert nbytes(attention="explicit") > 2 * nbytes()
    assert nbytes(checkpoint="full") == nbytes(checkpoint="block")
    # a parameter count takes the shape of the nearest preset
    calc = widgets.calculate(7.2e9, seq_len=1024)
    assert calc.activations.shape_name == "7B"


def test_activation_figures():
    calc = widgets.calculate("8B", 8, "ZeRO-3", "mixed", seq_len=16384, checkpoint="full")
    bars = widgets.figure(calc).axes[0]
    assert len(bar_patches(bars)) == 4 * 4  # activations stacked on every stage
    ax = widgets.activation_figure(calc).axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["model states", "+ activations, none", "+ activations, full",
                      "+ activations, full, this setting",
                      "+ activations, selective (within 1% of none)", "80 GB GPU"]
    # selective lies on none (fused attention keeps no s^2 term): drawn thin on a wide none
    widths = {ln.get_label(): ln.get_linewidth() for ln in ax.lines}
    assert widths["+ activations, selective (within 1% of none)"] < widths["+ activations, none"]
    assert ax.get_yscale() == "log" and ax.get_ylabel() == "bytes per GPU (GB)"
    with pytest.raises(ValueError, match="no activations"):
        widgets.activation_figure(widgets.calculate())


def test_static_display_with_activations_is_three_outputs(monkeypatch):
    pytest.importorskip("IPython")
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    widgets.calculator_static("8B", seq_len=4096)._ipython_display_()
    assert [type(o).__name__ for o in shown] == ["HTML", "Image", "Image"]


def test_calculator_widget_activation_controls():
    calc = widgets.calculator("8B", precision="mixed", seq_len=16384)
    assert "add 73.3 GB on every GPU" in text(calc.table_html)
    png = bytes(calc.activation_image.value)
    calc.controls["checkpoint"].value = "block"
    assert "(full checkpointing)" in text(calc.table_html)
    assert bytes(calc.activation_image.value) != png
    calc.controls["seq_len"].value = 0  # off: model states only, as in notebooks 01-07
    assert calc.calculation.activations is None
    assert calc.activation_image.layout.display == "none"
    assert calc.controls["micro_batch"].disabled
    assert "model states only (no activations)" in text(calc.table_html)


def test_calculator_widget_starts_without_activations():
    calc = widgets.calculator()
    assert calc.controls["seq_len"].value == 0 and calc.calculation.activations is None
    calc.controls["seq_len"].value = 8192
    assert calc.calculation.activations.seq_len == 8192
    assert "add 70.1 GB on every GPU" in text(calc.table_html)  # 7B shape, fp32
    with pytest.raises(TypeError, match="unknown settings"):
        widgets.calculator(sequence=4)
