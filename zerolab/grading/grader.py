"""`grade` and `load`, what a notebook calls: grade the learner's files against the solutions
(in processes of their own: runner.py) and gather one Report. Also `grade_files`, for tools
that grade many versions of an exercise at once."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from zerolab.grading.borrowed import HINT as BORROWED_HINT
from zerolab.grading.borrowed import imports_solutions
from zerolab.grading.check import load_module
from zerolab.grading.defaults import (
    DEFAULT_TIMEOUT,
    DEFAULT_WORLD_SIZES,
    EXERCISES_DIR,
    SOLUTIONS_DIR,
)
from zerolab.grading.exercise import Exercise
from zerolab.grading.generate import exercise_source
from zerolab.grading.registry import EXERCISES, select
from zerolab.grading.report import Report, Result, shown_path
from zerolab.grading.runner import grade_tasks
from zerolab.grading.session import Task


def load(name: str, path: str | os.PathLike | None = None) -> Callable:
    """The learner's function for one exercise (id or function name), freshly imported into
    this process: to try it by hand. (Grading never imports a learner's file here.)"""
    found = select(name)
    if len(found) != 1:
        raise ValueError(f"{name!r} names several exercises; give an id such as 3.1")
    ex = found[0]
    folder = Path(path) if path is not None else EXERCISES_DIR
    return getattr(load_module(folder / f"{ex.module}.py"), ex.function)


def grade(names: Sequence[str] | str | None = None, path: str | os.PathLike | None = None,
          timeout: float = DEFAULT_TIMEOUT,
          world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES) -> Report:
    """Grade exercises (all by default) in `path` (default: exercises/) against solutions/.

    names: files (ex03), ids (3.1) or function names. timeout: seconds one case (or importing
    a file) may run. world_sizes: the numbers of ranks distributed exercises run on.
    """
    exercises = select(names)
    folder = Path(path) if path is not None else EXERCISES_DIR
    if not folder.is_dir():
        raise ValueError(f"no folder {folder}")
    results = _grade_items([(ex.id, ex, folder / f"{ex.module}.py") for ex in exercises],
                           timeout, world_sizes)
    return Report([results[ex.id] for ex in exercises], folder, tuple(world_sizes))


def grade_files(items: Sequence[tuple[str, str | os.PathLike]],
                timeout: float = DEFAULT_TIMEOUT,
                world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES) -> list[Result]:
    """Grade many learner files, each for one exercise: [(exercise id, file), ...] -> one
    Result each, in order. They share one run per world size, so that a tool grading many
    versions of an exercise (tests/mutation.py) pays for few of them."""
    chosen = [(str(i), EXERCISES[ex_id], Path(file)) for i, (ex_id, file) in enumerate(items)]
    results = _grade_items(chosen, timeout, world_sizes)
    return [results[key] for key, _, _ in chosen]


def _grade_items(items: list[tuple[str, Exercise, Path]], timeout: float,
                 world_sizes: Sequence[int]) -> dict[str, Result]:
    """Grade (key, exercise, learner file) items; results by key. What can be told from a
    file without running it (missing, not parsing, the untouched stub) is told here; the
    rest runs in processes of its own (runner.py)."""
    if not SOLUTIONS_DIR.is_dir():
        raise ValueError(f"no {SOLUTIONS_DIR}: the grader needs the course's repository "
                         f"(solutions/ next to zerolab/; install it with `pip install -e .`)")
    results: dict[str, Result] = {}
    tasks: list[Task] = []
    for key, ex, learner_file in items:
        found = _without_running(ex, learner_file)
        if found is not None:
            results[key] = found
        else:
            tasks.append(Task(key, ex, str(learner_file.resolve())))
    wrong = grade_tasks(tasks, world_sizes, timeout)
    for task in tasks:
        results[task.key] = wrong.get(task.key, Result(task.exercise, "passed"))
    return results


def _without_running(ex: Exercise, learner_file: Path) -> Result | None:
    """The verdict on a file that needs no running: missing, not parsing, importing solutions/
    (its text says so: borrowed.py), or the stub as it was generated. None: it must run."""
    if not learner_file.exists():
        return Result(ex, "not attempted", message=f"no file {shown_path(learner_file)}")
    try:
        source = learner_file.read_text()
        ast.parse(source, str(learner_file))
    except SyntaxError as e:
        where = f'  File "{learner_file}", line {e.lineno}\n    {(e.text or "").strip()}\n'
        return Result(ex, "wrong", message=f"{learner_file.name} does not import: SyntaxError",
                      traceback=f"{where}SyntaxError: {e.msg}",
                      hint="Fix the file so that `python " + learner_file.name + "` runs.")
    except (OSError, UnicodeDecodeError) as e:
        return Result(ex, "wrong", message=f"{learner_file.name} cannot be read: {e}")
    statement = imports_solutions(source)
    if statement is not None:
        return Result(ex, "uses the reference", hint=BORROWED_HINT,
                      message=f"{learner_file.name} imports the course's solutions ({statement}):"
                              f" an answer built on the reference shows nothing of yours")
    if _untouched(ex, learner_file, SOLUTIONS_DIR / f"{ex.module}.py"):
        return Result(ex, "not attempted")  # the stub as generated: no process for it
    return None


def _untouched(ex: Exercise, learner_file: Path, solution_file: Path) -> bool:
    """The learner's function (or engine class) is the stub exactly as generated from the
    solution (comments and blank lines aside)."""
    def definition(source: str) -> str | None:
        return next((ast.dump(n) for n in ast.parse(source).body
                     if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == ex.function),
                    None)

    try:
        stub = definition(exercise_source(solution_file.read_text()))
        return stub is not None and stub == definition(learner_file.read_text())
    except (OSError, SyntaxError, ValueError):
        return False
