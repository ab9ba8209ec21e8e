"""The exercises and their grader.

- exercises/ is what solutions/ generates (and a drift either way is caught);
- every solution passes, every untouched stub is "not attempted";
- every exercise has at least two plausible wrong implementations (tests/grading_wrong/) that
  are reported wrong, naming the output that differed;
- a learner's exception shows the learner's own traceback lines; a hang is stopped at the
  timeout; the exit status of `python -m zerolab.grade` says whether anything is wrong.
"""

import ast
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerolab import grading
from zerolab.grading import check, runner

REPO = Path(__file__).resolve().parent.parent
WRONG = REPO / "tests" / "grading_wrong"

# (variant folder, exercise id) -> the output the report must name as differing, or the
# exception it must report ("raised ...").
CAUGHT = {
    ("v1", "1.1"): "result", ("v2", "1.1"): "result",
    ("v1", "1.2"): "result", ("v2", "1.2"): "result",
    ("v1", "2.1"): "result", ("v2", "2.1"): "result", ("v3", "2.1"): "comm ops",
    ("v1", "2.2"): "result", ("v2", "2.2"): "result", ("v3", "2.2"): "raised IndexError",
    ("v1", "2.3"): "result", ("v2", "2.3"): "raised RuntimeError", ("v3", "2.3"): "result",
    ("v1", "3.1"): "result", ("v2", "3.1"): "result",
    ("v1", "3.2"): "result", ("v2", "3.2"): "result",
    ("v1", "3.3"): "params", ("v2", "3.3"): "comm ops",
    ("v1", "4.1"): "grad_shard", ("v2", "4.1"): "freed .grad", ("v3", "4.1"): "grad_shard",
    ("v1", "5.1"): "comm ops", ("v2", "5.1"): "result",
    ("v1", "5.2"): "flat_param's storage bytes", ("v2", "5.2"): "params' numel",
    ("v1", "6.1"): "result", ("v2", "6.1"): "result",
    ("v1", "6.2"): "result", ("v2", "6.2"): "result",
    ("v1", "7.1"): "result", ("v2", "7.1"): "result",
    ("v1", "7.2"): "result", ("v2", "7.2"): "result",
}


def run_grader(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "zerolab.grade", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def status_lines(stdout: str) -> dict[str, str]:
    """Exercise id -> the status on its line of the printed report."""
    out = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] in grading.EXERCISES:
            out[parts[0]] = " ".join(parts[2:])
    return out


# ---- the exercises themselves -------------------------------------------------------------------


def solution_functions() -> dict[str, ast.FunctionDef]:
    """Exercise id -> its function in solutions/, found by the docstring's 'Exercise N.M:'."""
    found = {}
    for path in sorted((REPO / "solutions").glob("ex[0-9][0-9]_*.py")):
        for node in ast.parse(path.read_text()).body:
            doc = ast.get_docstring(node) if isinstance(node, ast.FunctionDef) else None
            if doc and doc.startswith("Exercise "):
                exercise_id = doc.split(":")[0].removeprefix("Exercise ")
                assert exercise_id not in found, f"two exercises {exercise_id}"
                found[exercise_id] = (path.stem, node)
    return found


def test_registry_matches_the_solutions():
    found = solution_functions()
    assert sorted(found) == sorted(grading.EXERCISES)
    assert len(found) >= 8
    assert {ex.notebook for ex in grading.EXERCISES.values()} == {f"0{i}" for i in range(1, 8)}
    for exercise_id, (module, node) in found.items():
        ex = grading.EXERCISES[exercise_id]
        assert (ex.module, ex.function) == (module, node.name)
        assert exercise_id.split(".")[0] == ex.notebook.lstrip("0")
        doc = ast.get_docstring(node)
        assert "Hint:" in doc, f"{exercise_id}: the docstring needs a hint"
        if ex.distributed:  # explicit (..., rank, world_size, group=None)
            assert [a.arg for a in node.args.args[-3:]] == ["rank", "world_size", "group"]
            assert isinstance(node.args.defaults[-1], ast.Constant)


def test_exercises_are_generated_from_the_solutions():
    assert grading.check_exercises() == []


def test_stubs_keep_docstrings_and_raise_the_exercise():
    for module, solution in solution_functions().values():
        tree = ast.parse((REPO / "exercises" / f"{module}.py").read_text())
        [stub] = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                  and n.name == solution.name]
        doc = ast.get_docstring(stub)
        assert doc == ast.get_docstring(solution)
        task = doc.splitlines()[0]  # "Exercise 2.1: Reduce-scatter as a ring ..."
        raises = [n for n in ast.walk(stub) if isinstance(n, ast.Raise)]
        assert len(raises) == 1
        call = raises[0].exc
        assert call.func.id == "NotImplementedError"
        assert call.args[0].value == task.replace('"', "'")
    # The stubs import (a learner runs them) and raise what the grader calls "not attempted".
    module = check._load_module(REPO / "exercises" / "ex07_scaling.py")
    with pytest.raises(NotImplementedError, match=r"^Exercise 7\.1: "):
        module.largest_model(80e9, 8, "ZeRO-3")


def test_drift_is_caught(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "exercises"
    shutil.copytree(REPO / "solutions", solutions)
    shutil.copytree(REPO / "exercises", exercises)
    assert grading.check_exercises(solutions, exercises) == []

    # A solution edited alone (its docstring: the stub keeps docstrings) ...
    path = solutions / "ex03_zero1.py"
    original = path.read_text()
    path.write_text(original.replace("Example: numels 6, 3 and 1", "Example: numels 6, 3, 1"))
    [problem] = grading.check_exercises(solutions, exercises)
    assert "ex03_zero1.py differs" in problem
    path.write_text(original)

    # ... or an exercise edited alone (a learner's answer left in exercises/) ...
    stub = exercises / "ex07_scaling.py"
    stub.write_text(stub.read_text().replace("raise NotImplementedError(", "return 0\n    (", 1))
    [problem] = grading.check_exercises(solutions, exercises)
    assert "ex07_scaling.py differs" in problem

    # ... and regenerating fixes it; an exercise without a solution is reported too.
    grading.make_exercises(solutions, exercises)
    assert grading.check_exercises(solutions, exercises) == []
    (exercises / "ex08_extra.py").write_text("")
    assert "has no solution" in grading.check_exercises(solutions, exercises)[0]


def test_generator_marks():
    def solution(body: str) -> str:
        return f'"""Module."""\n\n\ndef f(x):\n    """Exercise 9.1: Do it."""\n{body}'

    assert grading.exercise_source(solution(
        "    y = x\n    # BEGIN SOLUTION\n    y = y + 1\n    # END SOLUTION\n    return y\n")
    ).endswith('    y = x\n    raise NotImplementedError("Exercise 9.1: Do it.")\n    return y\n')
    with pytest.raises(ValueError, match="without its"):
        grading.exercise_source(solution("    # BEGIN SOLUTION\n    return x\n"))
    with pytest.raises(ValueError, match="without"):
        grading.exercise_source(solution("    return x\n    # END SOLUTION\n"))
    with pytest.raises(ValueError, match="must start with 'Exercise"):
        grading.exercise_source('def f():\n    """Nothing."""\n    # BEGIN SOLUTION\n'
                                '    pass\n    # END SOLUTION\n')


def test_every_exercise_has_two_wrong_variants_on_disk():
    for exercise_id, ex in grading.EXERCISES.items():
        variants = [v for (v, i) in CAUGHT if i == exercise_id]
        assert len(variants) >= 2, exercise_id
        for v in variants:
            assert "# BUG" in (WRONG / v / f"{ex.module}.py").read_text()


# ---- grading ------------------------------------------------------------------------------------


def test_solutions_pass(record_property):
    start = time.perf_counter()
    proc = run_grader("--path", "solutions")
    record_property("seconds", round(time.perf_counter() - start, 1))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses = status_lines(proc.stdout)
    assert statuses == {i: "passed" for i in grading.EXERCISES}, proc.stdout
    assert "15 exercises: 15 passed, 0 wrong, 0 not attempted" in proc.stdout


def test_untouched_stubs_are_not_attempted():
    proc = run_grader()  # exercises/ by default
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert status_lines(proc.stdout) == {i: "not attempted" for i in grading.EXERCISES}


@pytest.fixture(scope="module")
def wrong_reports() -> dict[str, grading.Report]:
    return {v: grading.grade(path=WRONG / v) for v in ("v1", "v2")}


@pytest.mark.parametrize("variant,exercise_id",
                         sorted(k for k in CAUGHT if k[0] in ("v1", "v2")))
def test_wrong_implementations_are_caught(wrong_reports, variant, exercise_id):
    result = wrong_reports[variant][exercise_id]
    expected = CAUGHT[variant, exercise_id]
    assert result.status == "wrong", str(result)
    if expected.startswith("raised"):
        assert result.message.startswith(expected)
        assert f"grading_wrong/{variant}/{result.exercise.module}.py" in result.traceback
    else:
        assert result.output == expected, str(result)
        assert "expected" in result.message and "got" in result.message
    assert result.hint
    if result.exercise.distributed:  # where: world size and rank
        assert result.world_size in (1, 2, 3) and result.rank in range(result.world_size)
    assert not result.timed_out


def test_report_reads_well(wrong_reports):
    text = repr(wrong_reports["v1"])
    assert text.splitlines()[0].startswith("Grading ")
    assert "2.1  ex02_collectives.ring_reduce_scatter   WRONG" in text
    assert "on 2 ranks, rank 0, case 'the seeds' example" in text
    assert "output 'result': shape (2,) as expected, max error" in text
    assert text.splitlines()[-1] == "15 exercises: 0 passed, 15 wrong, 0 not attempted"
    assert not wrong_reports["v1"].ok


def test_comm_bugs_crash_on_one_rank_and_exit_status():
    """Through the command line: right values over the wrong collective, a crash on one rank
    (the others wait for it in a collective), the learner's own traceback, exit status 1."""
    proc = run_grader("2.1", "2.2", "2.3", "4.1", "--path", "tests/grading_wrong/v3",
                      "--world-sizes", "1,2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert status_lines(out) == {"2.1": "WRONG", "2.2": "WRONG", "2.3": "WRONG", "4.1": "WRONG"}
    for text in ["output 'comm ops': expected [], got ['all_reduce']",
                 "on 2 ranks, rank 1, case 'shards of 1'",
                 "raised IndexError: tuple index out of range",
                 'grading_wrong/v3/ex02_collectives.py", line',
                 "ring_exchange(chunks[send_index], chunks[recv_index]",  # the line that raised
                 "output 'grad_shard'"]:
        assert text in out, out
    for text in ["zerolab/grading/", "zerolab/launch.py", "multiprocessing"]:  # internals
        assert text not in out, out


def test_a_hang_is_stopped_at_the_timeout(record_property):
    timeout = 3.0
    start = time.perf_counter()
    report = grading.grade(["2.2", "7.2"], path=WRONG / "hang", timeout=timeout,
                           world_sizes=(2,))
    elapsed = time.perf_counter() - start
    record_property("seconds", round(elapsed, 1))
    ring, loop = report["2.2"], report["7.2"]
    assert ring.status == "wrong" and ring.timed_out and ring.world_size == 2, str(ring)
    assert "timed out after 3 s: rank(s) [0, 1] never finished" in ring.message
    assert loop.status == "wrong" and loop.timed_out, str(loop)
    # Two timeouts, one launch (a few seconds, more on a loaded machine); not the launch's
    # own backstop (STARTUP_ALLOWANCE).
    assert elapsed < 2 * timeout + 60


def test_launch_timeout_is_reported_as_a_hang():
    """When the launch itself times out (no watchdog could fire), the running exercise hung."""
    ex = grading.EXERCISES["2.1"]
    result = runner._verdict(ex, 3, [], "timeout: ranks [0, 1, 2] were still running", 5.0)
    assert result.status == "wrong" and result.timed_out
    crash = runner._verdict(ex, 3, [], "rank 1 exited with code -9", 5.0)
    assert crash.status == "wrong" and "rank 1 exited" in crash.message


def test_a_launch_that_never_started_is_retried_not_blamed(monkeypatch):
    """Ranks that die before starting an exercise (a machine short of memory) are not the
    learner's fault: the launch is run again, and after three failures the grader gives up."""
    calls = []

    def fake_launch(todo, files, n, timeout):
        calls.append([ex.id for ex in todo])
        if len(calls) == 1:
            return {}, "rank 1 exited with code -9 without a Python exception"
        return {ex.id: [{"id": ex.id, "rank": r, "final": True} for r in range(n)]
                for ex in todo}, None

    monkeypatch.setattr(runner, "_launch_batch", fake_launch)
    exercises = [grading.EXERCISES["2.1"], grading.EXERCISES["2.2"]]
    assert runner._grade_distributed(exercises, {}, (2,), 5.0) == {}  # both passed
    assert calls == [["2.1", "2.2"], ["2.1", "2.2"]]

    monkeypatch.setattr(runner, "_launch_batch", lambda *args: ({}, "rank 0 exited"))
    with pytest.raises(RuntimeError, match="could not run 2 ranks"):
        runner._grade_distributed(exercises, {}, (2,), 5.0)


# ---- names, paths, notebooks --------------------------------------------------------------------


def test_names(capsys):
    assert grading.main(["--list"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listing] == list(grading.EXERCISES)
    assert [e.id for e in grading.select("ex03")] == ["3.1", "3.2", "3.3"]
    assert [e.id for e in grading.select(["ex03_zero1.py", "7"])] == ["3.1", "3.2", "3.3",
                                                                       "7.1", "7.2"]
    assert [e.id for e in grading.select("3.2")] == ["3.2"]
    assert [e.id for e in grading.select("ring_time")] == ["7.2"]
    assert len(grading.select(None)) == len(grading.EXERCISES)
    with pytest.raises(ValueError, match="no exercise called 'ex99'"):
        grading.select("ex99")
    proc = run_grader("ex99")
    assert proc.returncode == 2 and "no exercise called" in proc.stderr


def test_notebook_cell_and_a_learners_copy(tmp_path):
    """What a notebook does: grade one file, in exercises/ or in a copy of one's own."""
    copy = tmp_path / "my_copy"
    shutil.copytree(REPO / "exercises", copy)
    shutil.copy(REPO / "solutions" / "ex07_scaling.py", copy / "ex07_scaling.py")  # "solved"
    mine = grading.grade("ex07", path=copy)
    assert [r.status for r in mine.results] == ["passed", "passed"] and mine.ok
    assert "7.1  ex07_scaling.largest_model" in repr(mine)
    theirs = grading.grade("ex07")  # the untouched exercises/, side by side
    assert [r.status for r in theirs.results] == ["not attempted", "not attempted"]
    assert grading.load("7.1", path=copy)(80e9, 8, "ZeRO-3", "mixed") == 40e9

    # A file that does not import, and a missing function.
    (copy / "ex01_memory.py").write_text("def model_state_bytes(:\n")
    broken = grading.grade("ex01", path=copy)
    assert [r.status for r in broken.results] == ["wrong", "wrong"]
    assert "SyntaxError" in broken["1.1"].traceback and not broken.ok
    (copy / "ex01_memory.py").write_text("def model_state_bytes():\n    pass\n")
    partial = grading.grade("ex01", path=copy)
    assert partial["1.1"].status == "wrong"  # called with 6 arguments: TypeError
    assert "TypeError" in partial["1.1"].message
    assert partial["1.2"].status == "not attempted"
    assert "no function distinct_storage_bytes" in partial["1.2"].message
    (copy / "ex01_memory.py").unlink()
    assert "no file" in grading.grade("1.1", path=copy)["1.1"].message
