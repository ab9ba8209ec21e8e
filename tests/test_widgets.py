"""The memory calculator: the pure numbers, then the widget reacting to its controls."""

import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

pytest.importorskip("ipywidgets")

from zerolab import theory, widgets  # noqa: E402


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


def test_figure_highlights_the_selected_stage():
    fig = widgets.figure(widgets.calculate(stage="ZeRO-1"))
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bytes held (GB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == list(theory.STAGES)
    alphas = {round(p.get_x() + p.get_width() / 2): p.get_alpha() for p in ax.patches}
    assert alphas == {0: 0.35, 1: None, 2: 0.35, 3: 0.35}


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
                                  "optimizer", "fp32_grad_accum"}


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
