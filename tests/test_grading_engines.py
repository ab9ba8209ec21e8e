"""The engine exercises (1.3 DDP, 4.2 ZeRO-2, 5.3 ZeRO-3) and their grader.

- they are registered as kind "engine", and their stubs are generated from the solutions;
- the model they train has what catches mistakes (a tied weight, a frozen parameter, uneven
  shards), and the verdict's diagnoses work on made-up evidence (no ranks needed);
- on ranks: the solutions pass, correct engines laid out differently pass, the untouched
  stubs are "not attempted", a method left unwritten is reported, and every wrong engine in
  tests/grading_wrong_engines/ (diffs against solutions/, see its README) is caught where it
  shows, naming its kind of mistake.

Grading trains small models on up to 3 ranks: the tests give each case a generous timeout, so
that a loaded machine makes them slow, not wrong.
"""

import ast
import re
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from patches import apply_diff, build_folder

from zerolab import grading
from zerolab.grading import engine_model, engine_verdict
from zerolab.grading.check import _load_module
from zerolab.grading.engine_check import Measure

REPO = Path(__file__).resolve().parent.parent
DIFFS = REPO / "tests" / "grading_wrong_engines"  # <folder>/<module>.diff against solutions/
ENGINES = {"1.3": "ex01_ddp_engine", "4.2": "ex04_zero2_engine", "5.3": "ex05_zero3_engine"}
TIMEOUT = 240.0  # seconds per case: a loaded machine is slow, not wrong

# (folder, exercise id) -> (world size it shows on, output named, kind of mistake)
CAUGHT = {
    ("v1", "1.3"): (2, "parameters after step 1", "gradients summed, not averaged"),
    ("v1", "4.2"): (1, "model-state bytes after step()", "full gradients kept after step()"),
    ("v1", "5.3"): (1, "peak params bytes during the step", "units not freed after forward"),
    ("v2", "1.3"): (1, "collectives by phase", "no overlap: all-reduce after backward"),
    ("v2", "4.2"): (2, "parameters after step 1", "a rank stepped another rank's shard"),
    ("v2", "5.3"): (1, "parameters after step 1", "a frozen parameter trained"),
    ("v3", "1.3"): (1, "model-state bytes after step()", "a tied weight held twice"),
    ("v3", "4.2"): (1, "collectives by phase", "all-reduce instead of reduce-scatter"),
    ("v4", "1.3"): (1, "collectives by phase", "no overlap: backward waits for each all-reduce"),
    ("v4", "5.3"): (1, "model-state bytes after step()", "units left gathered after step()"),
}


def _grade(path: Path, world_sizes=(1, 2, 3)) -> grading.Report:
    return grading.grade(list(ENGINES), path=path, timeout=TIMEOUT, world_sizes=world_sizes)


# ---- registry, stubs, model: no ranks ---------------------------------------------------------


def test_engine_exercises_are_registered(capsys):
    for ex_id, module in ENGINES.items():
        ex = grading.EXERCISES[ex_id]
        assert (ex.kind, ex.module, ex.distributed) == ("engine", module, True)
        assert ex.check is not None and ex.mistakes
        solution = _load_module(REPO / "solutions" / f"{module}.py")
        assert isinstance(getattr(solution, ex.function), type)
    assert grading.main(["--list"]) == 0
    listing = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert {line[0]: line[2] for line in listing if line[0] in ENGINES} == dict.fromkeys(
        ENGINES, "engine")
    assert [e.id for e in grading.select("ex04")] == ["4.1", "4.2"]


def _methods(path: Path) -> dict[str, ast.FunctionDef]:
    [cls] = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_a_diff_that_no_longer_fits_its_solution_is_refused(tmp_path):
    diff = (DIFFS / "v1" / "ex01_ddp_engine.diff").read_text()
    with pytest.raises(ValueError, match="appear 0 times, not once"):
        apply_diff("nothing of the solution\n", diff)
    with pytest.raises(ValueError, match="appear 2 times, not once"):
        apply_diff("abc\nabc\n", "@@ -1 +1 @@\n-abc\n+abd\n")
    with pytest.raises(ValueError, match="no hunk"):
        apply_diff("abc\n", "garbage\n")
    # git's headers name the function after the second @@: still a hunk.
    assert apply_diff("abc\n", "@@ -1 +1 @@ def f\n-abc\n+abd\n") == "abd\n"
    # Building a folder names the diff that does not fit.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "ex01_ddp_engine.diff").write_text("@@ -1 +1 @@\n-not there\n+x\n")
    with pytest.raises(ValueError, match="ex01_ddp_engine.diff does not fit "
                                         "solutions/ex01_ddp_engine.py: a hunk"):
        build_folder(tmp_path / "src", tmp_path / "out", REPO / "solutions")
    with pytest.raises(FileNotFoundError, match="no folder of wrong answers"):
        build_folder(tmp_path / "missing", tmp_path / "out", REPO / "solutions")


def test_every_wrong_engine_on_disk_is_checked():
    """A .diff added without an entry in CAUGHT would be built and never graded."""
    exercise_of = {module: ex_id for ex_id, module in ENGINES.items()}
    on_disk = {(p.parent.name, exercise_of[p.stem]) for p in DIFFS.glob("v*/*.diff")}
    assert on_disk == set(CAUGHT)


@pytest.mark.parametrize("ex_id", ENGINES)
def test_first_hint_is_the_stubs_own_hints_by_method(ex_id, stubs):
    """hint("1.3") starts where the stub does: each method's "Hint:" paragraph, named."""
    methods = _methods(stubs / f"{ENGINES[ex_id]}.py")
    hinted = {name: " ".join(ast.get_docstring(node).split("Hint:")[1].split("\n\n")[0].split())
              for name, node in methods.items() if "Hint:" in (ast.get_docstring(node) or "")}
    assert hinted, "the stub has hints"
    levels = grading.hint_levels(ex_id)
    assert levels[0] == " ".join(f"{name}: {text}" for name, text in hinted.items())
    assert len(levels) >= 3 and len(set(levels)) == len(levels)


@pytest.mark.parametrize("ex_id", ENGINES)
def test_stubs_state_the_contract_and_raise_the_exercise(ex_id, stubs):
    module = ENGINES[ex_id]
    solution, stub = REPO / "solutions" / f"{module}.py", stubs / f"{module}.py"
    assert stub.read_text() == grading.exercise_source(solution.read_text())
    assert len(solution.read_text().splitlines()) < 250
    [cls] = [n for n in ast.parse(stub.read_text()).body if isinstance(n, ast.ClassDef)]
    contract = ast.get_docstring(cls)
    stage = grading.EXERCISES[ex_id].check.args[0]
    for words in ("state_tensors()", f'"{stage}/', "Measured", "Ψ"):
        assert words in contract, words
    methods = _methods(stub)
    assert {"__init__", "__call__", "step", "zero_grad", "full_state_dict",
            "state_tensors"} <= set(methods)
    init = methods["__init__"].args
    assert [a.arg for a in init.args] == ["self", "model", "optimizer_cls"]
    # ZeRO-3 reduces a unit at a time: its engine takes units, not a bucket size
    assert {"group", "units" if ex_id == "5.3" else "bucket_bytes"} <= {
        a.arg for a in init.kwonlyargs}
    assert init.kwarg.arg == "optimizer_kwargs"
    for name, node in methods.items():
        raises = [n for n in ast.walk(node) if isinstance(n, ast.Raise)]
        if name != "__call__":  # given: the model's forward (the hooks do the work)
            [raise_] = raises
            assert raise_.exc.args[0].value.startswith(f"Exercise {ex_id}: ")


def test_an_engine_solved_is_not_drift_but_a_changed_signature_is(tmp_path):
    """The bodies of an engine's exercise methods are the learner's, and so are methods they
    add; the class's docstring and the methods' signatures and docstrings are the course's."""
    folder = tmp_path / "exercises"
    grading.make_exercises(exercises_dir=folder)
    for module in ENGINES.values():
        (folder / f"{module}.py").write_text((REPO / "solutions" / f"{module}.py").read_text())
    assert grading.check_exercises(exercises_dir=folder) == []
    path = folder / "ex04_zero2_engine.py"
    solved = path.read_text()
    mine = "    def _mine(self):\n        return 1\n\n    def zero_grad(self)"
    path.write_text(solved.replace("    def zero_grad(self)", mine))
    assert grading.check_exercises(exercises_dir=folder) == []
    changed = "the signature or docstring of ZeRO2Engine.zero_grad() differs"
    for old, new, problem_names in [
        ("def zero_grad(self)", "def zero_grad(self, set_to_none=True)", changed),
        ("ZeRO-2: shard the", "ZeRO-2: split the", "`class ZeRO2Engine:` differs"),
        ('"Exercise 4.2: Zero this', '"Exercise 4.2: Clear this', changed),  # its docstring
        ("def zero_grad(self)", "def zero_grads(self)", changed),  # renamed
        ("self.module(*args, **kwargs)", "self.module(*args)",  # a given method changed
         "`def __call__(self, *args, **kwargs):` in ZeRO2Engine differs"),
    ]:
        path.write_text(solved.replace(old, new))
        [problem] = grading.check_exercises(exercises_dir=folder)
        assert problem_names in problem, (new, problem)


def test_the_model_has_what_catches_mistakes():
    model = engine_model.make_model()
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in names and model.lm_head.weight is model.wte.weight  # tied
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == [engine_model.FROZEN]
    assert model.get_parameter(engine_model.FROZEN).abs().min() > 0  # weight decay moves it
    sizes = engine_model.Sizes.of(model, 3)
    units = [sum(p.numel() for p in u.params) for u in engine_model.make_units(model)]
    assert all(n % 3 for n in units)  # every unit's shards padded on 3 ranks
    assert sizes.tied == {"wte.weight = lm_head.weight": 61 * 20 * 4}
    # The bounds leave room for the stage, not for its mistakes: ZeRO-2 keeping every full
    # gradient, or ZeRO-3 gathering every unit, is far above them.
    assert sizes.trainable > 2 * sizes.bucket
    assert sizes.params > sizes.root + 2 * sizes.unit + sizes.slack
    assert engine_model.GLOBAL_BATCH % 2 == engine_model.GLOBAL_BATCH % 3 == 0


def _measure(ops: dict, held: dict | None = None, blocking: dict | None = None) -> Measure:
    return Measure(held or {}, {}, Counter(ops), Counter(blocking or {}),
                   [(p, o, "ddp/bwd/b") for p, o in ops], 0)


def test_verdict_diagnoses_made_up_evidence():
    ddp, zero2 = engine_model.STAGES["ddp"], engine_model.STAGES["zero2"]
    sizes = engine_model.Sizes.of(engine_model.make_model(), 3)
    before, right = torch.zeros(4, 5), torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    kinds = {k: engine_verdict._update(ddp, sizes, "w", before, right, k * right)[1].kind
             for k in (3, 1 / 3, 2, 0)}
    assert kinds == {3: "gradients summed, not averaged", 1 / 3: "gradients averaged twice",
                     2: "a gradient counted twice", 0: "a parameter not stepped"}
    shuffled = right.flip(0)
    assert engine_verdict._update(zero2, sizes, "w", before, right, shuffled)[1] is \
        zero2.mistakes["spread"]
    assert engine_verdict._update(ddp, sizes, engine_model.FROZEN, before, right, right)[1] is \
        engine_verdict.FROZEN_TRAINED

    right_ops = _measure({("backward", "all_reduce"): 8})
    late = engine_verdict._phases(ddp, sizes, right_ops, _measure({("step", "all_reduce"): 8}))
    assert late["mistake"] == "no overlap: all-reduce after backward"
    assert "expected all_reduce x8 in backward, got all_reduce x8 in step" in late["message"]
    many = engine_verdict._phases(ddp, sizes, right_ops, _measure({("backward", "all_reduce"): 60}))
    assert many["mistake"] == "too many collectives"
    assert engine_verdict._phases(ddp, sizes, right_ops, right_ops) is None
    waits = _measure({("backward", "all_reduce"): 8}, blocking={("backward", "all_reduce"): 8})
    assert engine_verdict._phases(ddp, sizes, right_ops, waits)["mistake"] == \
        "no overlap: backward waits for each all-reduce"

    held = {"params": 86_640, "grads": 86_616, "optimizer": 173_324}
    tied = engine_verdict._held(ddp, sizes, _measure({}, held),
                                _measure({}, {**held, "grads": held["grads"] + 4_880}))
    assert tied["mistake"] == "a tied weight held twice" and "(+4,880)" in tied["message"]
    padding = {**held, "grads": held["grads"] - 56}  # no padding in the learner's buffers
    assert engine_verdict._held(ddp, sizes, _measure({}, held), _measure({}, padding)) is None
    mistagged = Measure({}, {}, Counter(), Counter(), [("backward", "all_reduce", "grads")], 0)
    assert engine_verdict._tags(ddp, sizes, right_ops, mistagged)["output"] == "comm tags"


# ---- grading on ranks --------------------------------------------------------------------------


def test_solutions_pass(record_property):
    start = time.perf_counter()
    report = _grade(REPO / "solutions")
    record_property("seconds", round(time.perf_counter() - start, 1))
    assert [r.status for r in report.results] == ["passed"] * 3, str(report)


def test_engines_laid_out_otherwise_pass(wrong_engines):
    """Other buckets (13 instead of zerolab's 8, so other padding and summation order),
    gathers in flight together, a unit gathered ahead: the contract allows them."""
    report = _grade(wrong_engines / "right_other_layout", world_sizes=(3,))
    assert [r.status for r in report.results] == ["passed"] * 3, str(report)


def test_untouched_stubs_are_not_attempted_without_starting_ranks(monkeypatch, stubs):
    from zerolab.grading import grader

    def no_ranks(tasks, world_sizes, timeout):
        assert not tasks, [t.key for t in tasks]  # a notebook's grade cell stays instant
        return {}

    monkeypatch.setattr(grader, "_grade_distributed", no_ranks)
    report = _grade(stubs, world_sizes=(1,))
    assert [r.status for r in report.results] == ["not attempted"] * 3, str(report)


def test_a_method_left_unwritten_is_reported(tmp_path):
    source = (REPO / "solutions" / "ex01_ddp_engine.py").read_text()
    body = "        self.optimizer.step()\n"
    assert source.count(body) == 1
    stub = '        raise NotImplementedError("Exercise 1.3: Wait, then step the optimizer.")\n'
    (tmp_path / "ex01_ddp_engine.py").write_text(source.replace(body, stub))
    result = grading.grade("1.3", path=tmp_path, timeout=TIMEOUT, world_sizes=(1,))["1.3"]
    assert result.status == "wrong", str(result)
    assert result.message == ("raised NotImplementedError: Exercise 1.3: Wait, then step the "
                              "optimizer. (a method still to write)")
    assert "in step" in result.traceback and "ex01_ddp_engine.py" in result.traceback


@pytest.fixture(scope="module")
def wrong_reports(wrong_engines) -> dict[str, grading.Report]:
    """Each folder's wrong engines, on 1 rank, then 2, ... up to the largest world size where
    one of them shows (the grader stops at the first world size that finds an engine wrong, so
    more ranks would not change these results, only make the suite slower)."""
    reports = {}
    for variant in sorted({v for v, _ in CAUGHT}):
        ids = [i for v, i in sorted(CAUGHT) if v == variant]
        top = max(CAUGHT[variant, i][0] for i in ids)
        reports[variant] = grading.grade(ids, path=wrong_engines / variant, timeout=TIMEOUT,
                                         world_sizes=tuple(range(1, top + 1)))
    return reports


@pytest.mark.parametrize("variant,ex_id", sorted(CAUGHT))
def test_wrong_engines_are_caught(wrong_engines, wrong_reports, variant, ex_id):
    world_size, output, mistake = CAUGHT[variant, ex_id]
    # the diff adds the bug, marked where it is
    assert re.search(r"^\+.*# BUG:", (DIFFS / variant / f"{ENGINES[ex_id]}.diff").read_text(), re.M)
    result = wrong_reports[variant][ex_id]
    assert result.status == "wrong" and not result.timed_out, str(result)
    assert (result.world_size, result.output, result.mistake) == (world_size, output, mistake), \
        str(result)
    assert result.rank in range(world_size) and result.hint and result.message


def test_report_reads_well(wrong_reports):
    text = str(wrong_reports["v1"])
    words = " ".join(text.split())  # the report wraps long lines
    for line in ["1.3 ex01_ddp_engine.DDPEngine WRONG",
                 "on 2 ranks, rank 0, case 'SGD, 3 steps'",
                 "your update is 2.00x the right one",
                 "looks like: gradients summed, not averaged",
                 "got 173,120 (+86,560)",
                 "hint: More than the root and two units were gathered at once"]:
        assert line in words, text
    assert "zerolab/grading" not in text

