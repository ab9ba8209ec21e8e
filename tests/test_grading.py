"""The exercises and their grader.

- the stubs state a contract and one short hint; exercises/ holds what solutions/ generates,
  a learner's answers aside (a drift either way is caught; answers are not drift);
- your exercises/: each exercise's test fails only if it is wrong (not attempted is fine);
- every solution passes (exit status 0), every untouched stub is "not attempted" without a
  process started for it; a run that cannot start is retried, then the grader gives up;
- names, hints a level at a time, a learner's copy, a file that does not import;
- a learner's solved tree is green, and the mutation tool kills a sample.
Wrong answers: test_grading_wrong.py (functions), test_grading_engines.py (engines),
test_grading_adversarial.py (patches, exits, hangs, floods).
"""

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerolab import grading
from zerolab.grading import check, runner, session

REPO = Path(__file__).resolve().parent.parent
# The function exercises (engine exercises are tested in test_grading_engines.py).
FUNCTIONS = [i for i, ex in grading.EXERCISES.items() if ex.kind != "engine"]
SECTIONS = ("Inputs:", "Returns:", "Graded on:", "Hint:")


def run_grader(*args: str, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "zerolab.grade", *args], cwd=cwd, env=env,
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


def solution_functions() -> dict[str, tuple[str, ast.FunctionDef]]:
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
    assert set(FUNCTIONS) <= set(found) <= set(grading.EXERCISES)
    for exercise_id, (module, node) in found.items():
        ex = grading.EXERCISES[exercise_id]
        assert (ex.module, ex.function) == (module, node.name)
        assert exercise_id.split(".")[0] == ex.notebook.lstrip("0")
        assert ex.kind in ("plain", "ranks") and (ex.kind == "ranks") == ex.distributed
        if ex.distributed:  # explicit (..., rank, world_size, group=None)
            assert [a.arg for a in node.args.args[-3:]] == ["rank", "world_size", "group"]
            assert isinstance(node.args.defaults[-1], ast.Constant)


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_stub_states_a_contract_and_one_short_hint(exercise_id):
    """The contract, not the algorithm: sections in order, a hint of at most three lines, and
    more hints (and known mistakes) kept by the grader for after a wrong answer."""
    module, node = solution_functions()[exercise_id]
    doc = ast.get_docstring(node)
    positions = [doc.find(s) for s in SECTIONS]
    assert -1 not in positions and positions == sorted(positions), (exercise_id, positions)
    stub_hint = doc.split("Hint:")[1].strip()
    assert "\n\n" not in stub_hint and len(stub_hint.splitlines()) <= 3
    ex = grading.EXERCISES[exercise_id]
    levels = grading.hint_levels(exercise_id)
    assert len(levels) >= 3 and levels[0].lower() == " ".join(stub_hint.split()).lower()
    assert ex.mistakes and all(m.hint for m in ex.mistakes)
    assert set(ex.read_only) <= {a.arg for a in node.args.args}


def test_exercises_hold_what_the_solutions_generate():  # stubs, or a learner's answers
    assert grading.check_exercises() == []


def test_stubs_keep_docstrings_and_raise_the_exercise(stubs):
    for module, solution in solution_functions().values():
        tree = ast.parse((stubs / f"{module}.py").read_text())
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
    module = check.load_module(stubs / "ex07_scaling.py")
    with pytest.raises(NotImplementedError, match=r"^Exercise 7\.1: "):
        module.largest_model(80e9, 8, "ZeRO-3")


def solved(solution_text: str, wrong: dict[str, tuple[str, str]] | None = None) -> str:
    """A learner's file: the stub with the solution's blocks in place of the raises (one
    exercise's block changed by `wrong`: id -> (old, new))."""
    def answer(exercise_id: str, block: str) -> str:
        old, new = (wrong or {}).get(exercise_id, ("", ""))
        return block.replace(old, new) if old else block
    return grading.exercise_source(solution_text, answer=answer)


def test_drift_is_caught_and_answers_are_not_drift(tmp_path, stubs):
    solutions = tmp_path / "solutions"
    shutil.copytree(REPO / "solutions", solutions)
    assert grading.check_exercises(solutions, stubs, exact=True) == []
    # A learner's answers, with a helper and an import of their own, are not drift ...
    path = stubs / "ex07_scaling.py"
    mine = solved((solutions / "ex07_scaling.py").read_text())
    mine = mine.replace("\ndef ring_time", "\ndef _helper():\n    return 1\n\n\ndef ring_time")
    path.write_text("import os  # mine\n" + mine)
    assert grading.check_exercises(solutions, stubs) == []
    assert "ex07_scaling.py differs" in grading.check_exercises(solutions, stubs, exact=True)[0]
    # ... a changed signature is, and so is a solution's docstring edited alone.
    path.write_text(mine.replace("def largest_model(memory_bytes", "def largest_model(memory"))
    [problem] = grading.check_exercises(solutions, stubs)
    assert "ex07_scaling.py: the signature or docstring of largest_model() differs" in problem
    assert "solutions/" not in problem  # the learner is not sent to the solutions
    path.write_text(mine)
    doc = solutions / "ex03_zero1.py"
    doc.write_text(doc.read_text().replace("Example: numels 6, 3 and 1", "Example: numels 6, 3"))
    [problem] = grading.check_exercises(solutions, stubs)
    assert "ex03_zero1.py: the signature or docstring of flat_shard() differs" in problem
    # Regenerating fixes it; an exercise without a solution, or one that does not parse, too.
    grading.make_exercises(solutions, stubs)
    assert grading.check_exercises(solutions, stubs) == []
    (stubs / "ex07_scaling.py").write_text("def largest_model(:\n")
    assert "does not parse" in grading.check_exercises(solutions, stubs)[0]
    (stubs / "ex99_extra.py").write_text("")
    assert "has no solution" in grading.check_exercises(solutions, stubs)[-1]


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


# ---- your exercises/ ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def your_report() -> grading.Report:
    return grading.grade()


@pytest.mark.parametrize("exercise_id", list(grading.EXERCISES))
def test_your_exercise_is_not_wrong(your_report, exercise_id):
    """What the notebooks' grade cells say, as tests: an exercise you solved must pass;
    one not attempted yet is fine. A failure here is the grader's verdict on your answer."""
    result = your_report[exercise_id]
    print(f"exercise {exercise_id}: {result.status}")  # read by the solved-copy test (-rP shows it)
    if result.status not in ("passed", "not attempted"):
        pytest.fail("\n" + str(result), pytrace=False)


# ---- grading ------------------------------------------------------------------------------------


def test_the_command_line_grades_the_folder_it_is_given():
    """`--path solutions --world-sizes 2`: one plain and one distributed exercise (that every
    solution passes, engines too, is the solved-copy test's: it grades each one from the
    solution's text)."""
    chosen = ["3.1", "2.1"]
    assert {grading.EXERCISES[i].distributed for i in chosen} == {False, True}
    proc = run_grader(*chosen, "--path", "solutions", "--world-sizes", "2", "--timeout", "240")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert status_lines(proc.stdout) == {i: "passed" for i in chosen}, proc.stdout


def test_a_script_that_grades_at_its_top_level_unguarded_grades_once(tmp_path):
    """A learner's script calls grade() with no `if __name__ == "__main__":` guard. A launched
    rank runs the main script again first (how it finds functions defined there); the grader's
    processes must not, or each would grade again (minutes, seen: 170 s against 8 s)."""
    (tmp_path / "grade_it.py").write_text(
        "import os\n"
        "from zerolab.grading import grade\n"
        "open(f'ran-{os.getpid()}', 'w').close()\n"
        f"print(grade('7.1', path={str(REPO / 'solutions')!r}))\n")
    proc = subprocess.run([sys.executable, "grade_it.py"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert status_lines(proc.stdout) == {"7.1": "passed"}, proc.stdout
    assert len(list(tmp_path.glob("ran-*"))) == 1  # the script ran in its own process only


def test_untouched_stubs_are_not_attempted_without_a_process(stubs, monkeypatch):
    """The stub as generated is told from its text: no process is started for it."""
    monkeypatch.setattr(runner.session, "run", lambda *args, **kwargs: pytest.fail("a run"))
    report = grading.grade(path=stubs)
    assert {r.id: r.status for r in report.results} == dict.fromkeys(grading.EXERCISES,
                                                                    "not attempted")
    assert report.ok
    proc = run_grader("--path", str(stubs))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_run_that_never_started_is_retried_not_blamed(monkeypatch):
    """Ranks that die before the learner's code is loaded (a machine short of memory) are not
    the learner's fault: the run is started again, and after three failures the grader gives
    up, saying so."""
    calls = []

    def never(tasks, world_size, timeout, references=None, judge=None):
        calls.append(world_size)
        return session.Run(world_size, {}, {}, {}, {}, session.Stop("startup", output="boom"),
                           list(tasks))

    monkeypatch.setattr(runner.session, "run", never)
    with pytest.raises(RuntimeError, match="could not run 2 rank"):
        runner.grade_tasks([session.Task("a", grading.EXERCISES["2.1"], "x.py")], (2,), 5.0)
    assert calls == [2, 2, 2]


# ---- names, hints, paths, notebooks -------------------------------------------------------------


def test_names_and_kinds(capsys):
    assert grading.main(["--list"]) == 0
    # The code exercises, then the predictions under their own line (tests/test_predictions.py)
    listing = capsys.readouterr().out.split("\npredictions: ")[0].splitlines()
    assert [line.split()[0] for line in listing] == list(grading.EXERCISES)
    assert [line.split()[2] for line in listing] == [e.kind for e in grading.EXERCISES.values()]
    assert [e.id for e in grading.select("ex03")] == ["3.1", "3.2", "3.3"]
    assert [e.id for e in grading.select(["ex03_zero1.py", "7"])] == ["3.1", "3.2", "3.3",
                                                                       "7.1", "7.2"]
    assert [e.id for e in grading.select("ring_time")] == ["7.2"]
    with pytest.raises(ValueError, match="no exercise called 'ex99'"):
        grading.select("ex99")
    with pytest.raises(ValueError, match="kind 'gpu'"):
        grading.Exercise("9.9", "ex09_x", "f", "", "", list, kind="gpu")
    proc = run_grader("ex99")
    assert proc.returncode == 2 and "no exercise called" in proc.stderr


def test_hints_come_a_level_at_a_time(capsys, monkeypatch):
    monkeypatch.setattr("zerolab.grading.hints._SHOWN", {})
    levels = grading.hint_levels("5.2")
    for n in range(1, len(levels) + 1):
        grading.hint("5.2")
        out = capsys.readouterr().out
        assert out.startswith(f"Hint {n} of {len(levels)} for 5.2 (reshard):")
        assert " ".join(out.split()[7:]) == " ".join(levels[n - 1].split())
    grading.hint("reshard")
    assert "No more hints for 5.2" in capsys.readouterr().out
    grading.hint("5.2", all_levels=True)
    out = capsys.readouterr().out
    assert out.count("Hint ") == len(levels) and "flat_param given a new tensor" in out
    assert grading.main(["--hints", "7.1"]) == 0
    assert "rounded up or to the nearest" in capsys.readouterr().out


def test_notebook_cell_and_a_learners_copy(stubs):
    """What a notebook does: grade one file, in exercises/ or in a copy of one's own."""
    copy = stubs
    (copy / "ex07_scaling.py").write_text(solved((REPO / "solutions" / "ex07_scaling.py")
                                                 .read_text()))
    mine = grading.grade("ex07", path=copy)
    assert [r.status for r in mine.results] == ["passed", "passed"] and mine.ok
    assert "7.1  ex07_scaling.largest_model" in repr(mine)
    assert grading.load("7.1", path=copy)(80e9, 8, "ZeRO-3", "mixed") == 40e9

    # A file that does not import, and a missing function.
    (copy / "ex01_memory.py").write_text("def model_state_bytes(:\n")
    broken = grading.grade(["1.1", "1.2"], path=copy)
    assert [r.status for r in broken.results] == ["wrong", "wrong"]
    assert "SyntaxError" in broken["1.1"].traceback and not broken.ok
    (copy / "ex01_memory.py").write_text("def model_state_bytes():\n    pass\n")
    partial = grading.grade(["1.1", "1.2"], path=copy)
    assert partial["1.1"].status == "wrong"  # called with 6 arguments: TypeError
    assert "TypeError" in partial["1.1"].message
    assert partial["1.2"].status == "not attempted"
    assert "no function distinct_storage_bytes" in partial["1.2"].message
    (copy / "ex01_memory.py").unlink()
    assert "no file" in grading.grade("1.1", path=copy)["1.1"].message


# ---- end to end: a learner's copy of the repository, and the mutation tool ----------------------


def test_a_solved_copy_is_green_but_for_a_wrong_answer(tmp_path):
    """The README's promise: a learner who solved the exercises runs the tests and gets
    green (the drift check and every exercise's verdict); one wrong answer fails its own
    test only, with the grader's message and hint."""
    copy = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # tests/workers: conftest.py's shared lesson launches import it.
    for folder in ("zerolab", "solutions", "exercises", "tests/workers"):
        shutil.copytree(REPO / folder, copy / folder, ignore=ignore)
    for file in ("pyproject.toml", "tests/test_grading.py", "tests/mutation.py",
                 "tests/conftest.py", "tests/patches.py"):
        shutil.copy(REPO / file, copy / file)
    grading.make_exercises(copy / "solutions", copy / "exercises")
    for module in {ex.module for ex in grading.EXERCISES.values()}:  # engines too
        text = (copy / "solutions" / f"{module}.py").read_text()
        wrong = {"7.1": ("math.floor(", "round(")}  # 19 parameters "fit" where 18 do
        (copy / "exercises" / f"{module}.py").write_text(solved(text, wrong))
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/test_grading.py", "-q", "-rfEP",
                           "-k", "your_exercise or hold_what"], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=1800)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "test_your_exercise_is_not_wrong[7.1]" in failed[0], out
    assert f"1 failed, {len(grading.EXERCISES)} passed" in out, out
    assert "rounded up or to the nearest, not down" in out, out
    # Every other exercise passed, graded from its solution's text: none "not attempted".
    statuses = dict(re.findall(r"^exercise (\S+): (.+)$", out, re.M))
    assert statuses == {i: "wrong" if i == "7.1" else "passed" for i in grading.EXERCISES}, out


def test_mutation_tool_on_a_sample():
    """tests/mutation.py makes every kind of mutant, and the grader kills a fixed sample."""
    mutation = check.load_module(REPO / "tests" / "mutation.py")
    kinds = {m.kind.split()[0] for i in FUNCTIONS for m in mutation.mutants_of(i)}
    assert {"operator", "comparison", "integer", "string", "rank", "slice", "statement",
            "keyword", ".clone()", "min"} <= kinds
    proc = subprocess.run([sys.executable, "tests/mutation.py", "3.1", "7.1", "--sample", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "killed 6 of 6 non-equivalent mutants (100%)" in proc.stdout, proc.stdout
