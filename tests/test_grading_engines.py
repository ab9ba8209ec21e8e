"""The engine exercises (1.3 DDP, 4.2 ZeRO-2, 5.3 ZeRO-3) and their grader.

- they are registered as kind "engine", and their stubs are generated from the solutions, with
  a contract that states measured targets;
- the model they train has what catches mistakes (a tied weight, a frozen layer, uneven
  shards), and the verdict's diagnoses work on made-up evidence (no ranks needed);
- on ranks, in one grading of everything below (one run per world size): the solutions and
  correct engines written otherwise pass; every wrong engine in tests/grading_wrong_engines/
  (one diff each) is caught on the world size where it shows, naming its kind of mistake, and
  the misdiagnoses a learner met are fixed (by their messages); the untouched stubs are "not
  attempted" without a process; a method left unwritten is reported.

Grading trains small models on up to 3 ranks: the tests give each case a generous timeout, so
that a loaded machine makes them slow, not wrong.
"""

import ast
import re
from pathlib import Path

import pytest
import torch
from patches import answers, apply_diff

from zerolab import grading
from zerolab.grading import engine_model, engine_verdict
from zerolab.grading.check import load_module

REPO = Path(__file__).resolve().parent.parent
DIFFS = REPO / "tests" / "grading_wrong_engines"  # <id>-<what>.diff against solutions/
ENGINES = {"1.3": "ex01_ddp_engine", "4.2": "ex04_zero2_engine", "5.3": "ex05_zero3_engine"}
TIMEOUT = 240.0  # seconds per case: a loaded machine is slow, not wrong

# answer -> (world size it shows on, output named, kind of mistake)
CAUGHT = {
    "1.3-after-backward": (1, "collectives by phase", "no overlap: all-reduce after backward"),
    "1.3-blocking": (1, "collectives by phase", "no overlap: backward waits for each all-reduce"),
    "1.3-averages-when-graded": (2, "parameters after step 1",
                                 "gradients summed, not averaged"),
    "1.3-clone": (1, "memory at the end of backward 1",
                  "gradient buffers copied for the all-reduce"),
    "1.3-divides-by-two": (1, "parameters after step 1", "divided by 2, not by N"),
    "1.3-forward-order": (1, "collectives' sizes", "buckets in forward order"),
    "1.3-live-state-dict": (1, "state dict of step 1",
                            "full_state_dict() returned live tensors, not a copy"),
    # A race too: the step whose parameters show it depends on when the all-reduce lands.
    "1.3-no-wait-before-forward": (2, None,
                                   "the second backward's gradients replaced the first's"),
    "1.3-register-hook": (2, None, "a parameter's gradient reduced before it was accumulated"),
    "1.3-sum": (2, "parameters after step 1", "gradients summed, not averaged"),
    "1.3-tied-twice": (1, "parameters after step 1", "a gradient counted twice"),
    "1.3-waits-in-hook": (1, "collectives by phase",
                          "no overlap: backward waits for each all-reduce"),
    "4.2-all-reduce": (1, "collectives by phase", "all-reduce instead of reduce-scatter"),
    "4.2-averages-when-graded": (2, "parameters after step 1",
                                 "gradients summed, not averaged"),
    "4.2-blocking": (1, "collectives by phase",
                     "no overlap: backward waits for each reduce-scatter"),
    "4.2-gather-in-forward": (1, "collectives by phase", "parameters gathered in forward"),
    "4.2-grads-kept": (1, "memory at the end of backward 1",
                       "full gradients not freed during backward"),
    "4.2-next-rank-shard": (2, "parameters after step 1", "a rank stepped another rank's shard"),
    "4.2-no-wait": (1, "memory at the end of backward 1",
                    "flattened gradients kept: a reduce-scatter not waited for"),
    "4.2-overwrites": (1, "parameters after step 1",
                       "the second backward's gradients replaced the first's"),
    "4.2-waits-in-hook": (1, "collectives by phase",
                          "no overlap: backward waits for each reduce-scatter"),
    "5.3-all-reduce": (1, "collectives by phase", "all-reduce instead of reduce-scatter"),
    "5.3-frozen-never-resharded": (1, "memory after step()", "frozen parameters never resharded"),
    "5.3-frozen-trained": (1, "parameters after step 1", "a frozen parameter trained"),
    "5.3-gathered-after-step": (1, "collectives by phase", "parameters gathered after step()"),
    "5.3-grads-held": (1, "memory at the end of backward 1",
                       "every unit's flattened gradient held until step()"),
    "5.3-no-reshard-after-backward": (1, "parameters after step 1",
                                      "units still gathered after backward: their parameters "
                                      "are stale"),
    "5.3-reduce-in-step": (1, "collectives by phase",
                           "every unit's gradient held until step(), reduced there"),
    "5.3-padding-nan": (3, "gradients after step 1", "padding not zeros"),
    "5.3-reshard-drops-references": (1, "memory at the end of forward 1",
                                     "reshard dropped references instead of freeing the storage"),
    "5.3-state-dict-gathers-all": (1, "memory inside full_state_dict()",
                                   "full_state_dict() gathers every unit at once"),
}
RIGHT = ["1.3-right-sum-then-divide", "4.2-right-gathers-together", "5.3-right-prefetch"]
# answer -> words its "uses the reference" verdict must hold: engines built on the reference
BORROWED = {
    "1.3-holds-torch-ddp": "your engine's torch_ddp is a DistributedDataParallel, torch's engine "
                           "in torch/nn/parallel/distributed.py",
    "4.2-built-on-zerolab": "ZeRO2Engine is built on ZeRO2, zerolab's engine in zerolab/zero2.py",
    "5.3-built-on-the-solution": "ZeRO3Engine is built on ZeRO3Engine, "
                                 "solutions/ex05_zero3_engine.py",
}


# ---- registry, stubs, model: no ranks ---------------------------------------------------------


def test_engine_exercises_are_registered(capsys):
    for ex_id, module in ENGINES.items():
        ex = grading.EXERCISES[ex_id]
        assert (ex.kind, ex.module, ex.distributed) == ("engine", module, True)
        assert ex.stage in engine_model.STAGES and ex.mistakes
        solution = load_module(REPO / "solutions" / f"{module}.py")
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
    diff = (DIFFS / "1.3-sum.diff").read_text()
    with pytest.raises(ValueError, match="appear 0 times, not once"):
        apply_diff("nothing of the solution\n", diff)
    with pytest.raises(ValueError, match="appear 2 times, not once"):
        apply_diff("abc\nabc\n", "@@ -1 +1 @@\n-abc\n+abd\n")
    with pytest.raises(ValueError, match="no hunk"):
        apply_diff("abc\n", "garbage\n")
    # git's headers name the function after the second @@: still a hunk.
    assert apply_diff("abc\n", "@@ -1 +1 @@ def f\n-abc\n+abd\n") == "abd\n"
    # Building answers names the diff that does not fit, or one that names no solution.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "1.3-x.diff").write_text(
        "--- solutions/ex01_ddp_engine.py\n+++ x\n@@ -1 +1 @@\n-not there\n+x\n")
    with pytest.raises(ValueError, match="1.3-x.diff does not fit "
                                         "solutions/ex01_ddp_engine.py: a hunk"):
        answers(tmp_path / "src", tmp_path / "out", REPO / "solutions")
    (tmp_path / "src" / "1.3-x.diff").write_text("@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(ValueError, match="no '--- solutions/<module>.py' line"):
        answers(tmp_path / "src", tmp_path / "out", REPO / "solutions")
    with pytest.raises(FileNotFoundError, match="no folder of answers"):
        answers(tmp_path / "missing", tmp_path / "out", REPO / "solutions")


def test_every_engine_answer_on_disk_is_checked():
    """A .diff added without an entry in CAUGHT (or RIGHT, or BORROWED) would be built and
    never graded; every exercise has at least three wrong answers of different kinds."""
    on_disk = {p.stem for p in DIFFS.glob("*.diff")}
    assert on_disk == set(CAUGHT) | set(RIGHT) | set(BORROWED)
    for ex_id in ENGINES:
        kinds = {m for n, (_, _, m) in CAUGHT.items() if n.startswith(ex_id)}
        assert len(kinds) >= 3, ex_id
    for name in CAUGHT:
        assert re.search(r"^\+.*# BUG", (DIFFS / f"{name}.diff").read_text(), re.M), name


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
def test_stubs_state_the_contract_and_measured_targets(ex_id, stubs):
    """The contract says what the grader measures (every live tensor, not the engine's
    report), and says where zerolab's engine is, to read once solved."""
    module = ENGINES[ex_id]
    solution, stub = REPO / "solutions" / f"{module}.py", stubs / f"{module}.py"
    assert stub.read_text() == grading.exercise_source(solution.read_text())
    assert len(solution.read_text().splitlines()) < 250
    tree = ast.parse(stub.read_text())
    assert "solve this first, then read it" in ast.get_docstring(tree)
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    contract = " ".join(ast.get_docstring(cls).split())
    stage = grading.EXERCISES[ex_id].stage
    for words in (f'"{stage}/', "Measured", "Ψ", "every live tensor on the rank",
                  "not what your engine", "peak", "two backward passes"):
        assert words in contract, words
    methods = _methods(stub)
    assert {"__init__", "__call__", "step", "zero_grad", "full_state_dict"} <= set(methods)
    assert "state_tensors" not in methods  # the grader measures memory itself
    init = methods["__init__"].args
    assert [a.arg for a in init.args] == ["self", "model", "optimizer_cls"]
    # ZeRO-3 reduces a unit at a time: its engine takes units, not a bucket size
    assert {"group", "units" if ex_id == "5.3" else "bucket_bytes"} <= {
        a.arg for a in init.kwonlyargs}
    assert init.kwarg.arg == "optimizer_kwargs"
    for node in methods.values():
        raises = [n for n in ast.walk(node) if isinstance(n, ast.Raise)]
        assert len(raises) <= 1
        for raise_ in raises:
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
    assert tuple(frozen) == engine_model.FROZEN  # a whole layer
    assert all(model.get_parameter(n).abs().min() > 0 for n in frozen)  # weight decay moves it
    sizes = engine_model.Sizes.of(model, 3)
    units = [sum(p.numel() for p in u.params) for u in engine_model.make_units(model)]
    assert all(n % 3 for n in units)  # every unit's shards padded on 3 ranks
    assert sizes.tied == {"wte.weight = lm_head.weight": 61 * 20 * 4}
    # The allowances leave room for the stage, not for its mistakes: every bucket's full
    # gradient, every unit gathered, or the frozen layer kept whole are far above them.
    assert sizes.trainable > 2 * sizes.allowance(engine_model.STAGES["zero2"])
    assert sizes.params > 3 * sizes.unit and sizes.frozen > 4 * sizes.slack
    assert engine_model.GLOBAL_BATCH % 2 == engine_model.GLOBAL_BATCH % 3 == 0
    assert all((engine_model.GLOBAL_BATCH // n) % 2 == 0 for n in (1, 2, 3))  # 2 micro-batches
    assert sum(engine_model.bucket_sizes(model)) == sizes.trainable
    assert engine_model.bucket_sizes(model) != engine_model.bucket_sizes(model, True)


def _step(calls: list[tuple[str, str, int, bool]], points=None, peak=None) -> dict:
    by = dict.fromkeys(engine_verdict.WORDS, 0)
    return {"calls": [{"phase": p, "op": o, "nbytes": b, "tag": f"ddp/{p[:3]}/b", "async": a}
                      for p, o, b, a in calls],
            "memory": {"points": points or [["after step()", by]], "peak": peak or [by, "step()"]},
            "ring bytes": 0}


def test_verdict_diagnoses_made_up_evidence():
    ddp, zero2, zero3 = (engine_model.STAGES[s] for s in ("ddp", "zero2", "zero3"))
    sizes = engine_model.Sizes.of(engine_model.make_model(), 3)
    sgd, adamw = engine_model.SGD, engine_model.ADAMW
    before, right = torch.zeros(4, 5), torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    kinds = {k: engine_verdict._update(ddp, sgd, sizes, "w", before, right, k * right)[1].kind
             for k in (3, 1 / 3, 2, 0)}
    assert kinds == {3: "gradients summed, not averaged", 1 / 3: "gradients averaged twice",
                     2: "a gradient counted twice", 0: "a parameter not stepped"}
    assert engine_verdict._update(zero3, sgd, sizes, "w", before, right, 0 * right)[1].kind == \
        "units still gathered after backward: their parameters are stale"
    shuffled = right.flip(0)
    assert engine_verdict._update(zero2, sgd, sizes, "w", before, right, shuffled)[1].kind == \
        "a rank stepped another rank's shard"
    accumulated = engine_model.ACCUMULATED
    assert "replaced the first's" in engine_verdict._update(
        zero2, accumulated, sizes, "w", before, right, shuffled)[1].kind
    assert engine_verdict._update(ddp, adamw, sizes, engine_model.FROZEN[0], before, right,
                                  right)[1].kind == "a frozen parameter trained"

    right_ops = _step([("backward", "all_reduce", 800, True)] * 8)
    late = engine_verdict._phases(ddp, sizes, right_ops,
                                  _step([("step", "all_reduce", 800, True)] * 8))
    assert late["mistake"] == "no overlap: all-reduce after backward"
    assert "expected all_reduce x8 in backward, got all_reduce x8 in step" in late["message"]
    assert engine_verdict._phases(ddp, sizes, right_ops, right_ops) is None
    waits = _step([("backward", "all_reduce", 800, False)] * 8)
    assert engine_verdict._blocking(ddp, sizes, right_ops, waits)["mistake"] == \
        "no overlap: backward waits for each all-reduce"
    many = engine_verdict._sizes(ddp, sizes, right_ops,
                                 _step([("backward", "all_reduce", 100, True)] * 64))
    assert many["output"] == "collectives' sizes" and "expected 8 of" in many["message"]
    # An all-gather in forward is named as such, not as a reduce-scatter after backward.
    zero2_ops = _step([("backward", "reduce_scatter", 800, True), ("step", "all_gather", 800,
                                                                   False)])
    forward = _step([("forward", "all_gather", 800, False),
                     ("backward", "reduce_scatter", 800, True), ("step", "all_gather", 800,
                                                                 False)])
    assert engine_verdict._phases(zero2, sizes, zero2_ops, forward)["mistake"] == \
        "parameters gathered in forward"

    by = dict.fromkeys(engine_verdict.WORDS, 0)
    held = {**by, "params": 86_640, "grads": 86_616, "optimizer": 173_324}
    tied = engine_verdict._memory(ddp, sizes, _step([], [["after step()", held]]),
                                  _step([], [["after step()", {**held, "grads": 86_616 + 4_880}]]))
    assert tied["mistake"] == "a tied weight held twice" and "4,880 bytes" in tied["message"]
    padding = {**held, "grads": held["grads"] - 56}  # less padding in the learner's buffers
    assert engine_verdict._memory(ddp, sizes, _step([], [["after step()", held]]),
                                  _step([], [["after step()", padding]])) is None
    kept = {**held, "kept params": 4 * sizes.unit}
    found = engine_verdict._memory(zero3, sizes, _step([], [["at the end of forward 1", held]]),
                                   _step([], [["at the end of forward 1", kept]]))
    assert found["mistake"] == "reshard dropped references instead of freeing the storage"
    assert "3.7Ψ more in all, the most in parameters that autograd's saved tensors keep" in \
        " ".join(found["message"].split())
    mistagged = {"calls": [{"phase": "backward", "op": "all_reduce", "nbytes": 8,
                            "tag": "grads", "async": True}]}
    assert engine_verdict._tags(ddp, sizes, right_ops, mistagged)["output"] == "comm tags"


# ---- grading on ranks --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, grading.Result]:
    """The solutions, the correct engines written otherwise and every wrong engine, in one
    grading: one run per world size (a wrong one is not run again once found wrong)."""
    made = answers(DIFFS, tmp_path_factory.mktemp("engines"), REPO / "solutions")
    items = {f"{ex_id}-solution": REPO / "solutions" / f"{m}.py" for ex_id, m in ENGINES.items()}
    items.update(made)
    names = sorted(items)
    results = grading.grade_files([(n.split("-")[0], items[n]) for n in names],
                                  timeout=TIMEOUT)
    return dict(zip(names, results))


@pytest.mark.parametrize("name", [*(f"{i}-solution" for i in ENGINES), *RIGHT])
def test_solutions_and_engines_written_otherwise_pass(graded, name):
    """Other ways the contract allows: a sum divided by hand, every all-gather in flight
    together, the next unit gathered ahead (one unit more at the peak: the allowance)."""
    assert graded[name].status == "passed", str(graded[name])


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_wrong_engines_are_caught(graded, name):
    world_size, output, mistake = CAUGHT[name]
    result = graded[name]
    assert result.status == "wrong" and not result.timed_out, str(result)
    assert result.world_size == world_size and result.mistake == mistake, str(result)
    if output is not None:  # register_hook shows where the race lands: another step each time
        assert result.output == output, str(result)
    assert result.hint and result.message
    assert result.rank is None or result.rank in range(world_size)


@pytest.mark.parametrize("name", sorted(BORROWED))
def test_engines_built_on_the_reference_are_named(graded, name):
    """Built on zerolab's engine or the solution's class (their MRO: at import, before any
    case), or holding torch's DDP (seen in the engine the grader built, in the first case)."""
    result = graded[name]
    assert result.status == "uses the reference" and result.world_size == 1, str(result)
    assert BORROWED[name] in " ".join(result.message.split()), str(result)


def test_misdiagnoses_are_fixed(graded):
    """What a learner met: register_hook called "gradients not averaged", an extra all-gather
    in forward "reduce-scatter after backward", no reshard after backward "units not freed
    after forward", an all-reduce in ZeRO-3 "collectives in the wrong phase"."""
    text = {n: " ".join(str(graded[n]).split()) for n in CAUGHT}
    assert "has a hook from register_hook" in text["1.3-register-hook"]
    assert "looks like: parameters gathered in forward" in text["4.2-gather-in-forward"]
    assert "all_gather x14 in forward" in text["4.2-gather-in-forward"]
    assert "not freed after forward" not in text["5.3-no-reshard-after-backward"]
    assert "reshard every unit after its backward" in text["5.3-no-reshard-after-backward"]
    assert "looks like: all-reduce instead of reduce-scatter" in text["5.3-all-reduce"]
    # Memory is named by what holds it, and when: the grader's own measure.
    assert "alive at the end of forward 1" in text["5.3-reshard-drops-references"]
    assert "parameters that autograd's saved tensors keep alive" in \
        text["5.3-reshard-drops-references"]
    assert "alive at the end of backward 1" in text["4.2-no-wait"]
    assert "flattened buffers, copies" in text["4.2-no-wait"]
    assert "alive after step()" in text["5.3-frozen-never-resharded"]


def test_report_reads_well(graded):
    text = str(graded["1.3-sum"])
    words = " ".join(text.split())  # the report wraps long lines
    for line in ["1.3 ex01_ddp_engine.DDPEngine WRONG",
                 "on 2 ranks, rank 0, case 'SGD, 3 steps'",
                 "your update is 2.00x the right one",
                 "looks like: gradients summed, not averaged"]:
        assert line in words, text
    assert "zerolab/grading" not in text
    assert all(len(line) <= 104 for line in text.splitlines() if "case '" not in line)


def test_untouched_stubs_are_not_attempted_without_a_process(monkeypatch, stubs):
    from zerolab.grading import runner

    monkeypatch.setattr(runner.session, "run", lambda *args, **kwargs: pytest.fail("a run"))
    report = grading.grade(list(ENGINES), path=stubs, world_sizes=(1,))
    assert [r.status for r in report.results] == ["not attempted"] * 3, str(report)


def test_a_method_left_unwritten_is_reported(tmp_path):
    source = (REPO / "solutions" / "ex01_ddp_engine.py").read_text()
    body = "        self._wait()\n        self.optimizer.step()\n"
    assert source.count(body) == 1
    stub = '        raise NotImplementedError("Exercise 1.3: Wait, then step the optimizer.")\n'
    (tmp_path / "ex01_ddp_engine.py").write_text(source.replace(body, stub))
    result = grading.grade("1.3", path=tmp_path, timeout=TIMEOUT, world_sizes=(1,))["1.3"]
    assert result.status == "wrong", str(result)
    assert result.message == ("raised NotImplementedError: Exercise 1.3: Wait, then step the "
                              "optimizer. (a method still to write)")
    assert "in step" in result.traceback and "ex01_ddp_engine.py" in result.traceback
