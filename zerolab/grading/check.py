"""Judging one case of a function exercise, in the grader's process: every rank's outputs
against the reference's, then the arguments the contract says to leave unchanged, and (on
ranks) whether every rank issued the same collectives. A difference is explained by the
exercise's known mistakes where one fits.

What is compared is data (zerolab.grading.data): the learner's function ran in a process of its
own (worker.py) and sent back what it returned. Also here: importing a file by path, and the
learner's own lines of a traceback, which the learner's processes use.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from zerolab.grading import flight
from zerolab.grading.compare import compare_values
from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.mistakes import (
    COLLECTIVES_DIFFER,
    COLLECTIVES_REORDERED,
    DTYPES_MIXED,
    NON_CONTIGUOUS_VIEW,
    Evidence,
    Mistake,
    diagnose,
    input_changed_hint,
)


def load_module(path: Path, prefix: str = "_zerolab_graded") -> ModuleType:
    """Import a file by path, under a name of its own (a learner's copy never clashes; nor,
    with another prefix, the same file imported as a learner's and as a solution)."""
    name = f"{prefix}_{zlib.crc32(str(path).encode()):08x}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def is_stub(e: BaseException) -> bool:
    return isinstance(e, NotImplementedError) and str(e).startswith("Exercise ")


def learner_traceback(e: BaseException, learner_file: str) -> str:
    """The traceback lines in the learner's own file, then the exception: not our internals."""
    mine = os.path.realpath(learner_file)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.realpath(f.filename) == mine]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(e), e))


def _wrong(output: str, message: str, mistake: Mistake | None, **where: Any) -> dict[str, Any]:
    record = {"status": "wrong", "output": output, "message": message, **where}
    if mistake is not None:
        record.update(mistake=mistake.kind, hint=mistake.hint)
    return record


def judge_case(ex: Exercise, case: Case, world_size: int, expected: list[dict],
               got: list[dict], solution: Callable | None) -> dict[str, Any]:
    """The verdict on one case that returned on every rank. expected, got: per rank, what
    call.call measured. solution: a plain exercise's solution, to try other inputs."""
    if world_size > 1 and (cross := _collectives(expected, got)) is not None:
        return cross
    for rank in range(world_size):
        found = _judge_rank(ex, case, rank, world_size, expected[rank], got[rank], solution)
        if found is not None:
            return {**found, "rank": rank}
    return {"status": "passed"}


def _collectives(expected: list[dict], got: list[dict]) -> dict[str, Any] | None:
    """Every rank issued the same collectives with the same sizes, in the same order, and
    sent and received data of the dtypes the reference did."""
    per_rank = [g.get("collectives", []) for g in got]
    difference = flight.first_difference(per_rank, finished=True)
    if difference is not None:
        reordered = flight.reordered(per_rank) or difference.tags_differ
        mistake = COLLECTIVES_REORDERED if reordered else COLLECTIVES_DIFFER
        return _wrong("collectives", difference.describe(), mistake, rank=None)
    want = flight.dtypes([e.get("collectives", []) for e in expected])
    have = flight.dtypes(per_rank)
    if len(have) > 1 and len(want) <= 1:
        return _wrong("collectives", f"the ranks moved {' and '.join(have)} data, where the "
                      f"reference moved {' and '.join(want) or 'nothing'}", DTYPES_MIXED,
                      rank=None)
    return None


def _judge_rank(ex: Exercise, case: Case, rank: int, world_size: int, expected: dict,
                got: dict, solution: Callable | None) -> dict[str, Any] | None:
    if "bad return" in got:
        return {"status": "wrong", "output": "return value", "message": got["bad return"]}
    mine = got["outputs"]
    for name, value in expected["outputs"].items():
        why = compare_values(value, mine.get(name))
        if why is None:
            continue
        if name in ("comm ops", "bytes sent"):
            why += " (the grader sees what goes through zerolab.comm)"
        evidence = Evidence(name, value, mine.get(name), expected["outputs"], mine, rank,
                            world_size, case.make, solution, case.label)
        return _wrong(name, why, diagnose(ex.mistakes, evidence))
    for name, why in got["changed"].items():
        output = f"input {name}"
        known = next((m for m in ex.mistakes if m.output == output), None)
        return _wrong(output, f"changed by your function: {why}",
                      known or Mistake("input changed", input_changed_hint(name)))
    return None


def judge_raised(ex: Exercise, case: Case, rank: int, world_size: int, message: str,
                 expected: dict | None, solution: Callable | None) -> Mistake | None:
    """The kind of mistake an exception shows, if the exercise knows it."""
    outputs = expected["outputs"] if expected and "outputs" in expected else {}
    evidence = Evidence("raised", None, message, outputs, {}, rank, world_size, case.make,
                        solution, case.label)
    return diagnose((*ex.mistakes, NON_CONTIGUOUS_VIEW), evidence)
