"""Prediction exercises: scoring, reading the learner's number from a notebook without running
it, each measurement against the formula its notebook teaches, and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerolab import grading, models, theory
from zerolab.grading import predictions as graded
from zerolab.lessons import (
    measured,
    n01_ddp,
    n04_zero2,
    n05_zero3,
    n06_fsdp2,
    n07_scaling,
    n09_nodes,
)
from zerolab.lessons.predictions import PREDICTIONS, score, shown, withheld
from zerolab.units import make_units

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"

# ---- scoring ----------------------------------------------------------------------------------


def test_scores_say_right_wrong_or_not_attempted_with_the_miss():
    assert score(1024, 1024, "bytes").message == "right: predicted 1,024 B, measured 1,024 B"
    near = score(1000, 1024, "bytes", rounding=1024)
    assert near.ok and "too low by 24 B" in near.message
    high = score(2048, 1024, "bytes", rounding=1024)
    assert not high.ok and high.message.startswith("too high by 1,024 B (+100.0%)")
    low = score(17, 18, "count")
    assert not low.ok and low.message.startswith("too low by 1 (-5.6%)")
    slow = score(0.0162, 0.01, "seconds", band=0.35)
    assert not slow.ok and "1.62x the measurement (+62%), outside the ±35% band" in slow.message
    assert score(0.012, 0.01, "seconds").ok
    none = score(None, 18, "count")
    assert not none.ok and none.message.startswith("not attempted")


def test_a_measurement_is_withheld_until_predicted(capsys):
    with withheld("08.p1", None) as visible:
        print("264,192 B")  # the code runs (a learner's error would show) ...
        ran = True
    assert ran and visible is False
    assert capsys.readouterr().out == (  # ... but only this line shows
        "withheld until you predict 08.p1: write your number in the cell above, run it, then "
        "run this cell again\n")
    with withheld("08.p1", 0) as visible:  # any number, even 0, is a prediction
        print("264,192 B")
    assert visible is True and capsys.readouterr().out == "264,192 B\n"
    with pytest.raises(ZeroDivisionError), withheld("08.p1", None):
        raise ZeroDivisionError("a learner's error in the block")
    with pytest.raises(KeyError, match="no prediction '08.p9'"), withheld("08.p9", None):
        pass
    # A figure is a cell's value: shown(...) gives it back once predicted, else None.
    figure = object()
    assert shown("08.p1", None, figure) is None
    assert capsys.readouterr().out.startswith("withheld until you predict 08.p1")
    assert shown("08.p1", 264_192, figure) is figure and capsys.readouterr().out == ""


def test_the_stored_notebooks_show_no_answer_under_a_question():
    """From each prediction's cell to the cell that scores it, the stored outputs (what nbval
    compares, what a learner sees before running anything) say only that the measurement is
    withheld and the prediction not attempted: no number, no figure."""
    asked = 0
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        for i, cell in enumerate(cells):
            if cell["cell_type"] != "code" or not "".join(cell["source"]).startswith("predicted_"):
                continue
            asked += 1
            scored = next(k for k in range(i + 1, len(cells))
                          if "PREDICTIONS[" in "".join(cells[k]["source"]))
            for k in range(i + 1, scored + 1):
                for out in cells[k].get("outputs", []):
                    text = "".join(out.get("text", "")) or str(out.get("data", ""))
                    lines = [line for line in text.splitlines()
                             if not line.startswith(("withheld until you predict",
                                                     "not attempted: write your prediction"))]
                    assert not lines, f"{path.stem}, cell {k}: {text[:300]}"
    assert asked == len(PREDICTIONS)


# ---- reading the number from the notebook -----------------------------------------------------


def notebook(path: Path, *sources: str) -> Path:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": "**Predict** `x = 1`"}]
    cells += [{"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
               "source": s.splitlines(keepends=True)} for s in sources]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


@pytest.mark.parametrize(("source", "value"), [
    ("predicted_x = 448_624  # your prediction, in bytes", 448624),
    ("predicted_x = 16 * 28032 + 4 * 28", 16 * 28032 + 4 * 28),
    ("predicted_x = 2 * (3 - 1) / 3 * 49152", 65536.0),
    ("predicted_x = 1 << 20", 1 << 20),
    ("predicted_x = -(2 ** 10) + 0.5", -1023.5),
    ("%matplotlib inline\npredicted_x = 3e5", 3e5),
    ("predicted_x: int = 18", 18),
    ("predicted_x = None  # your prediction, in bytes", None),
])
def test_reads_numbers_and_arithmetic_of_numbers(tmp_path, source, value):
    assert graded.read_prediction(notebook(tmp_path / "n.ipynb", source), "predicted_x") == value


def test_the_last_assignment_counts(tmp_path):
    path = notebook(tmp_path / "n.ipynb", "predicted_x = None", "y = 1\npredicted_x = 7")
    assert graded.read_prediction(path, "predicted_x") == 7


@pytest.mark.parametrize("value", [
    "open('MARKER', 'w').write('ran')", "psi * 16", "__import__('os').system('touch MARKER')",
    "True", "'448624'", "10 ** 10 ** 10", "[1, 2]", "1 / 0"])
def test_anything_else_is_refused_unread(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    path = notebook(tmp_path / "n.ipynb", f"predicted_x = {value}")
    with pytest.raises(graded.NotANumber):
        graded.read_prediction(path, "predicted_x")
    assert not (tmp_path / "MARKER").exists()  # nothing was run
    result = graded.grade_prediction(PREDICTIONS["05.p1"], tmp_path,
                                     measure_fn=lambda p: pytest.fail("measured"))
    assert result.status == "error"  # no 05_zero3.ipynb there


def test_verdicts_without_a_measurement(tmp_path):
    p = PREDICTIONS["05.p1"]
    never = {"measure_fn": lambda p: pytest.fail("measured for nothing")}
    notebook(tmp_path / "05_zero3.ipynb", f"{p.name} = psi // 2")
    r = graded.grade_prediction(p, tmp_path, **never)
    assert (r.status, r.message.split(":")[0]) == ("not a number", f"{p.name} = psi // 2")
    assert "write a number (a count)" in r.message
    notebook(tmp_path / "05_zero3.ipynb", f"{p.name} = None")
    assert graded.grade_prediction(p, tmp_path, **never).status == "not attempted"
    notebook(tmp_path / "05_zero3.ipynb", "x = 1")
    assert "no cell of 05_zero3.ipynb assigns" in graded.grade_prediction(p, tmp_path,
                                                                          **never).message
    notebook(tmp_path / "05_zero3.ipynb", f"{p.name} = 20")
    r = graded.grade_prediction(p, tmp_path, measure_fn=lambda p: 18.0)
    assert (r.status, r.message) == ("wrong", "too high by 2 (+11.1%), beyond exact: "
                                              "predicted 20, measured 18")


def test_predictions_are_named_by_id_or_notebook():
    assert [p.id for p in graded.select(["05_zero3"])] == ["05.p1"]
    assert [p.id for p in graded.select(["10_bytes_to_seconds.ipynb", "01b.p1"])] == [
        "01b.p1", "10.1", "10.2", "10.3", "10.4", "10.5"]
    assert not any(graded.is_prediction(ex) for ex in grading.EXERCISES)  # 1.1 ... 9.3
    with pytest.raises(ValueError, match="no prediction called '13.p1'"):
        graded.select(["13.p1"])
    notebooks = {p.stem for p in graded.NOTEBOOKS_DIR.glob("*.ipynb")}
    assert {p.notebook for p in PREDICTIONS.values()} <= notebooks
    assert {p.notebook for p in PREDICTIONS.values()} >= notebooks - {"00_launch"}


# ---- each measurement, against the formula its notebook teaches ------------------------------


def psi(config=None) -> int:
    return models.num_params(models.GPT(config) if config else models.GPT())


def tensors(config=None) -> int:
    return len(list((models.GPT(config) if config else models.GPT()).parameters()))


def root_numel(config) -> int:
    """ZeRO-3's root unit (embeddings, final LayerNorm): gathered once a step."""
    return sum(p.numel() for p in make_units(models.GPT(config))[-1].params)


FORMULAS = {  # what a learner who worked it out from the notebook writes
    "01.p1": lambda: 4 * psi(n01_ddp.SWEEP_CONFIG),  # 4Ψ, whatever the buckets
    "01b.p1": lambda: 16 * psi(),  # 16Ψ (the step counters are below the rounding)
    "02.p1": lambda: theory.ring_sent_bytes("all_reduce", 49152, 3),  # 2(N-1)/N·S
    "03.p1": lambda: 8 * psi() / 4,  # 8Ψ/N
    "04.p1": lambda: 4 * psi(n04_zero2.MODEL) * (1 + 1 / 2),  # 4Ψ + 4Ψ/N
    # every unit in forward, again in backward but the root (kept gathered in between)
    "05.p1": lambda: 2 * (n05_zero3.MODEL.n_layer + 1) - 1,
    "06.p1": lambda: 16 * psi(n06_fsdp2.MODEL) / 2,  # 16Ψ/N
    "07.p1": lambda: theory.comm_volume(psi(n07_scaling.MODEL), 4, "ZeRO-3",
                                        root_numel=root_numel(n07_scaling.MODEL)).ring_sent_bytes,
    "08.p1": lambda: theory.activation_bytes(32, 2, 64, 4),
    "09.p1": lambda: theory.ring_sent_bytes("all_reduce", 4 * psi(n09_nodes.MODEL) / 2, 2),
    "09b.p1": lambda: 8 * psi(n09_nodes.MODEL) / 4,  # 8Ψ/N: param and grad shards
}


@pytest.fixture(scope="module")
def values() -> dict[str, float]:
    return measured.measured_many(list(measured.MEASURES))


def test_every_prediction_of_01_to_09_has_a_measurement():
    assert set(measured.MEASURES) == set(FORMULAS) == {
        p.id for p in PREDICTIONS.values() if p.measure == "zerolab.lessons.measured:measured_for"}


@pytest.mark.parametrize("id", list(FORMULAS))
def test_the_formula_is_right_and_a_miss_is_wrong(values, id):
    p, value, formula = PREDICTIONS[id], values[id], FORMULAS[id]()
    assert p.score(formula, value).ok, (id, formula, value)
    high = p.score(formula * 1.1, value)
    assert not high.ok and high.message.startswith("too high by")
    low = p.score(formula * 0.9, value)
    assert not low.ok and low.message.startswith("too low by")


def test_the_measurements_are_what_the_notebooks_print(values):
    assert values["01.p1"] == 4 * psi(n01_ddp.SWEEP_CONFIG)  # "== 4Ψ: True"
    assert values["01b.p1"] == 16 * psi() + 4 * tensors()  # "4 B x 28 parameter tensors"
    assert 1 <= values["02.p1"] / FORMULAS["02.p1"]() < 1.03  # "within 3% above"
    assert 0 < values["03.p1"] - 8 * psi() / 4 < 4 * tensors()  # "+ 4 B per bucket"
    assert values["04.p1"] == FORMULAS["04.p1"]()  # "peak == full gradient + shards"
    assert values["05.p1"] == 17  # "fwd: root blocks.0 ... blocks.7", back without the root
    assert values["06.p1"] == 16 * psi(n06_fsdp2.MODEL) / 2 + 4 * tensors(n06_fsdp2.MODEL)
    assert values["07.p1"] == FORMULAS["07.p1"]()
    assert values["08.p1"] == FORMULAS["08.p1"]()  # "every block equal to its formula"
    assert values["09.p1"] == FORMULAS["09.p1"]()
    assert values["09b.p1"] == FORMULAS["09b.p1"]()  # "kept: 8Ψ/N" (no unit is padded)


# ---- the command line -------------------------------------------------------------------------


def test_list_shows_every_prediction_with_its_kind(capsys):
    assert grading.main(["--list"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert {row[0]: row[2] for row in rows if row[0] in PREDICTIONS} == dict.fromkeys(
        PREDICTIONS, "prediction")
    assert [row[0] for row in rows].index("predictions:") == len(grading.EXERCISES)


def test_shipped_notebook_10_is_not_attempted(capsys):
    assert grading.main(["10_bytes_to_seconds"]) == 0  # every prediction None: no run at all
    out = capsys.readouterr().out
    assert out.count("not attempted") == 6 and "5 predictions: 0 right, 0 wrong" in out


def test_a_wrong_prediction_exits_nonzero_and_says_which_way(tmp_path, capsys):
    p = PREDICTIONS["08.p1"]
    notebook(tmp_path / "08_activations.ipynb", f"{p.name} = 2 * 264_192")
    assert grading.main(["08.p1", "--notebooks", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "08.p1" in out and "wrong: too high by 264,192 B (+100.0%)" in out
    notebook(tmp_path / "08_activations.ipynb", f"{p.name} = 64 * 32 * 2 * 4 * 16 + 2048")
    assert grading.main(["08_activations", "--notebooks", str(tmp_path)]) == 0
    assert "right: predicted 264,192 B, measured 264,192 B" in capsys.readouterr().out


def test_a_time_is_graded_against_this_machines_measurements(tmp_path):
    """10.3: measured five times here and scored against their median, within a band from
    their spread: a number copied from another machine's notebook (+32%) misses a quiet
    machine's band, and passes a noisy one's."""
    p = PREDICTIONS["10.3"]
    notebook(tmp_path / f"{p.notebook}.ipynb", f"{p.name} = 0.0132")
    quiet = iter([0.0100, 0.0101, 0.0099, 0.0100, 0.0102])
    r = graded.grade_prediction(p, tmp_path, measure_fn=lambda p: next(quiet))
    assert r.status == "wrong", r.message
    assert "5 measurements on this machine, median 10 ms, spread 3%: the band is ±10%" in \
        r.message
    noisy = iter([0.0070, 0.0100, 0.0130, 0.0100, 0.0095])
    r = graded.grade_prediction(p, tmp_path, measure_fn=lambda p: next(noisy))
    assert r.status == "right" and "the band is ±35%" in r.message, r.message


@pytest.mark.parametrize("pid, value, measured, words", [
    ("10.3", "10.0", 0.010, "written in milliseconds? The prediction is in seconds"),
    ("10.1", "4096", 4 << 20, "written in KiB? The prediction is in bytes"),
    ("10.3", "0.02", 0.010, ""),  # twice too slow: a miss, in the right unit
])
def test_a_prediction_in_another_unit_is_named(tmp_path, pid, value, measured, words):
    p = PREDICTIONS[pid]
    notebook(tmp_path / f"{p.notebook}.ipynb", f"{p.name} = {value}")
    r = graded.grade_prediction(p, tmp_path, measure_fn=lambda p: measured)
    assert r.status == "wrong", r.message
    assert (words in r.message) if words else "written in" not in r.message, r.message
