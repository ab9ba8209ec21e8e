"""What differs between a function exercise and an engine exercise, in one place: what runs
as the reference, how one case is run and measured (in the process that holds the code), and
how a case's results are judged (in the grader's process).

A function exercise (plain or on ranks): the reference is the solution's function (solutions/);
a case calls the function (call.py) and is judged output by output (check.py). An engine
exercise: the reference is zerolab's engine of the stage; a case trains the model with the
engine (engine_run.py) and is judged step by step, then on what the measured step held and
sent (engine_verdict.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from zerolab.grading import call, check, engine_run, engine_verdict
from zerolab.grading.check import load_module
from zerolab.grading.defaults import SOLUTIONS_DIR
from zerolab.grading.engine_model import STAGES
from zerolab.grading.exercise import Case, Exercise


def solution(ex: Exercise) -> Callable:
    """The solution's function (or class) of an exercise, from solutions/."""
    return _solution(ex.module, ex.function)


@functools.cache
def _solution(module: str, function: str) -> Callable:
    return getattr(load_module(SOLUTIONS_DIR / f"{module}.py"), function)


def forget_solutions() -> None:
    """Drop the solutions loaded so far (in a learner's process, once the references ran)."""
    _solution.cache_clear()


def prepare(ex: Exercise) -> None:
    """Read now what a case of `ex` reads from solutions/ (a function's parameter names), so
    that a process reads it before any learner's code runs there."""
    if ex.kind != "engine":
        call.positions(ex)


def reference(ex: Exercise) -> Any:
    """What the learner's answer is compared with: the solution, or zerolab's engine."""
    return STAGES[ex.stage].reference if ex.kind == "engine" else solution(ex)


def run(ex: Exercise, fn: Any, case: Case, rank: int = 0, world_size: int = 1,
        group: dist.ProcessGroup | None = None, flight_path: str | None = None,
        learner_file: str | None = None) -> Any:
    """One case of `fn` (a function, or an engine class), run here: what it did, as data.
    learner_file: `fn` is a learner's, from that file (an engine is then checked for the
    reference engines it holds: borrowed.in_engine)."""
    if ex.kind == "engine":
        return engine_run.run_case(ex.stage, fn, case, rank, world_size, group, flight_path,
                                   learner_file)
    return call.call(ex, fn, case, call.positions(ex), rank, world_size, group, flight_path)


def judge(ex: Exercise, case: Case, world_size: int, expected: list[Any],
          got: list[Any]) -> dict[str, Any]:
    """The verdict on one case from every rank's results (a record: status, and for a wrong
    answer the output, message, rank and kind of mistake)."""
    if ex.kind == "engine":
        [setting] = case.make(0)
        return engine_verdict.verdict(STAGES[ex.stage], setting, world_size, expected, got)
    plain = None if ex.distributed else solution(ex)
    return check.judge_case(ex, case, world_size, expected, got, plain)
