"""`grade` and `load`, what a notebook calls: import the learner's files and the solutions,
grade plain exercises here and distributed ones on ranks, and gather one Report."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from zerolab.grading.check import _learner_traceback, _load_module
from zerolab.grading.defaults import (
    DEFAULT_TIMEOUT,
    DEFAULT_WORLD_SIZES,
    EXERCISES_DIR,
    SOLUTIONS_DIR,
)
from zerolab.grading.exercise import Exercise
from zerolab.grading.registry import select
from zerolab.grading.report import Report, Result, _shown
from zerolab.grading.runner import _grade_distributed, _grade_plain


def load(name: str, path: str | os.PathLike | None = None) -> Callable:
    """The learner's function for one exercise (id or function name), freshly imported."""
    found = select(name)
    if len(found) != 1:
        raise ValueError(f"{name!r} names several exercises; give an id such as 3.1")
    ex = found[0]
    folder = Path(path) if path is not None else EXERCISES_DIR
    return getattr(_load_module(folder / f"{ex.module}.py"), ex.function)


def grade(names: Sequence[str] | str | None = None, path: str | os.PathLike | None = None,
          timeout: float = DEFAULT_TIMEOUT,
          world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES) -> Report:
    """Grade exercises (all by default) in `path` (default: exercises/) against solutions/.

    names: files (ex03), ids (3.1) or function names. timeout: seconds one case may run.
    world_sizes: the numbers of ranks distributed exercises run on.
    """
    exercises = select(names)
    if not SOLUTIONS_DIR.is_dir():
        raise ValueError(f"no {SOLUTIONS_DIR}: the grader needs the course's repository "
                         f"(solutions/ next to zerolab/; install it with `pip install -e .`)")
    folder = Path(path) if path is not None else EXERCISES_DIR
    if not folder.is_dir():
        raise ValueError(f"no folder {folder}")
    results: dict[str, Result] = {}
    files: dict[str, tuple[str, str]] = {}
    plain: list[tuple[Exercise, tuple[str, Callable], Callable]] = []
    solutions = {m: _load_module(SOLUTIONS_DIR / f"{m}.py") for m in {e.module for e in exercises}}
    learners: dict[str, ModuleType | Result] = {}
    for ex in exercises:
        learner_file = folder / f"{ex.module}.py"
        if ex.module not in learners:
            learners[ex.module] = _import_learner(ex, learner_file)
        module = learners[ex.module]
        if isinstance(module, Result):  # missing, or fails to import
            results[ex.id] = Result(ex, module.status, message=module.message,
                                    traceback=module.traceback, hint=module.hint)
        elif not hasattr(module, ex.function):
            results[ex.id] = Result(ex, "not attempted",
                                    message=f"no function {ex.function} in {learner_file.name}")
        elif ex.distributed:
            files[ex.id] = (str(learner_file.resolve()),
                            str((SOLUTIONS_DIR / f"{ex.module}.py").resolve()))
        else:
            plain.append((ex, (str(learner_file), getattr(module, ex.function)),
                          getattr(solutions[ex.module], ex.function)))
    for ex, learner, solution in plain:
        results[ex.id] = _grade_plain(ex, learner, solution, timeout)
    distributed = [ex for ex in exercises if ex.id in files]
    results.update(_grade_distributed(distributed, files, world_sizes, timeout))
    return Report([results.get(ex.id, Result(ex, "passed")) for ex in exercises], folder,
                  tuple(world_sizes))


def _import_learner(ex: Exercise, learner_file: Path) -> ModuleType | Result:
    if not learner_file.exists():
        return Result(ex, "not attempted", message=f"no file {_shown(learner_file)}")
    try:
        return _load_module(learner_file)
    except Exception as e:
        return Result(ex, "wrong", message=f"{learner_file.name} does not import: "
                                           f"{type(e).__name__}",
                      traceback=_learner_traceback(e, str(learner_file)),
                      hint="Fix the file so that `python " + learner_file.name + "` runs.")
