"""zerolab.plots.peak_calculator: the predicted-peak calculator, its numbers and its widget,
on the course GPT (a fake run costs a fraction of a second there; the 7B's, seconds)."""

from __future__ import annotations

import re

import pytest

from zerolab import predict
from zerolab.models import GPT
from zerolab.plots import peak_calculator as pc

SMALL = {"model": "course GPT", "seq_len": 16, "world_size": 4}


def text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]*>", " ", html))


def test_calculate_is_predict_at_every_world_size():
    got = pc.calculate("course GPT", "fp32", 16, 2)
    assert list(got) == list(predict.STAGES)
    for stage, ps in got.items():
        assert [p.world_size for p in ps] == pc.WORLD_SIZES
        p4 = predict.peak(GPT, stage, 4, 2, seq_len=16, tile_numel=None, gloo=False)
        assert pc.at(got, 4)[stage].peak_bytes == p4.peak_bytes


def test_calculate_refuses_what_it_cannot_build():
    with pytest.raises(ValueError, match="unknown model 'GPT-5'"):
        pc.calculate("GPT-5", "fp32", 16, 1)
    with pytest.raises(ValueError, match=r"seq_len must be 1 to the model's block_size \(16\)"):
        pc.calculate("course GPT", "fp32", 17, 1)


def test_calculator_shows_the_predictions_it_computed():
    import ipywidgets

    calc = pc.peak_calculator(**SMALL)
    assert isinstance(calc, ipywidgets.VBox)
    assert set(calc.controls) == set(pc.START)
    zero3 = pc.at(calc.predictions, 4)["ZeRO-3"]
    shown = text(calc.table_html)
    assert f"ZeRO-3 peaks at {zero3.peak_bytes / 1e3:.3g} kB per GPU on 4 GPUs" in shown
    assert "on 80 GB it fits from N = 1" in shown
    assert bytes(calc.image.value).startswith(b"\x89PNG")


def test_changing_n_or_the_gpu_redraws_without_recomputing(monkeypatch):
    calc = pc.peak_calculator(**SMALL)
    png, calls = bytes(calc.image.value), []
    monkeypatch.setattr(pc.predict, "gpu_job", lambda *a, **k: calls.append(a) or {})
    calc.controls["world_size"].value = 16
    calc.controls["gpu_memory"].value = 24e9
    assert calls == []  # every world size was predicted at once
    assert "on 16 GPUs" in text(calc.table_html) and "in 24 GB" in text(calc.table_html)
    assert bytes(calc.image.value) != png


def test_the_seq_len_is_cut_to_the_models_block_size():
    calc = pc.peak_calculator(**SMALL)
    calc.controls["seq_len"].value = 4096  # the course GPT's block_size is 16
    assert pc.at(calc.predictions, 4)["DDP"].peak_bytes == pc.at(
        pc.calculate("course GPT", "bf16 mixed", 16, 1), 4)["DDP"].peak_bytes


def test_unknown_settings_are_refused():
    with pytest.raises(TypeError, match=r"unknown settings \['stage'\]"):
        pc.peak_calculator(stage="ZeRO-3")


def test_figure_stacks_each_stage_by_row():
    got = pc.calculate("course GPT", "fp32", 16, 2)
    fig = pc.figure(got, 4, 1e6)
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert "activations" in labels and not any("GPU" in label for label in labels)  # no line
    tops = {}
    for bar in ax.patches:
        x = round(bar.get_x(), 3)
        tops[x] = max(tops.get(x, 0), bar.get_y() + bar.get_height())
    peaks = [p.peak_bytes / 1e3 for p in pc.at(got, 4).values()]  # kB, the figure's unit
    assert sorted(tops.values()) == pytest.approx(sorted(peaks))
