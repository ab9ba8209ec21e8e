"""Checking one case: import a file by path, run the solution then the learner's function on
the same fresh inputs, and compare: the outputs (and, for a distributed exercise, the
zerolab.comm ops called and bytes sent), then the arguments the contract says to leave
unchanged. A difference is explained by the exercise's known mistakes where one fits. The
same code runs in this process (plain exercises) and on each spawned rank (distributed ones).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist

from zerolab import comm
from zerolab.grading.compare import _compare
from zerolab.grading.exercise import BadReturn, Case, Exercise
from zerolab.grading.mistakes import Evidence, Mistake, _diagnose, input_changed_hint
from zerolab.grading.storage import _snapshot, _what_changed


def _load_module(path: Path) -> ModuleType:
    """Import a file by path, under a name of its own (a learner's copy never clashes)."""
    name = f"_zerolab_graded_{zlib.crc32(str(path).encode()):08x}_{path.stem}"
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


def _is_stub(e: BaseException) -> bool:
    return isinstance(e, NotImplementedError) and str(e).startswith("Exercise ")


def _learner_traceback(e: BaseException, learner_file: str) -> str:
    """The traceback lines in the learner's own file, then the exception: not our internals."""
    mine = os.path.realpath(learner_file)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.realpath(f.filename) == mine]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(e), e))


@dataclass
class _Call:
    """One call of a function on a case: its named outputs, and the read-only arguments it
    changed (name -> how)."""

    outputs: dict[str, Any]
    changed: dict[str, str]
    args: tuple


def _run(ex: Exercise, fn: Callable, case: Case, rank: int, world_size: int,
         group: dist.ProcessGroup | None, watched: dict[str, int]) -> _Call:
    """Call `fn` on the case's fresh arguments; its named outputs, and what it changed among
    the `watched` arguments (name -> position)."""
    args = case.make(rank)
    before = {name: _snapshot(args[i]) for name, i in watched.items()}
    if not ex.distributed:
        outputs = ex.outputs(fn(*args), args)
    else:
        with comm.record_comm(group=group, align=False) as log:
            result = fn(*args, rank, world_size, group)
        outputs = ex.outputs(result, args)
        if ex.comm_checked:
            outputs["comm ops"] = sorted({e.op for e in log.events})
            outputs["bytes sent"] = log.total_ring_bytes()
    changed = {name: why for name, i in watched.items()
               if (why := _what_changed(before[name], args[i])) is not None}
    return _Call(outputs, changed, args)


def _watched(ex: Exercise, solution: Callable) -> dict[str, int]:
    """The exercise's read-only arguments, by name -> position in the solution's signature."""
    names = list(inspect.signature(solution).parameters)
    return {name: names.index(name) for name in ex.read_only}


def _wrong(output: str, message: str, mistake: Mistake | None) -> dict[str, Any]:
    record = {"status": "wrong", "output": output, "message": message}
    if mistake is not None:
        record.update(mistake=mistake.kind, hint=mistake.hint)
    return record


def _check_case(ex: Exercise, learner: tuple[str, Callable], solution: Callable, case: Case,
                rank: int = 0, world_size: int = 1,
                group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Run the solution, then the learner, on the same inputs. A record: status and details
    (for a wrong answer: which output, how it differs, and the kind of mistake if known)."""
    learner_file, learner_fn = learner
    watched = _watched(ex, solution)
    try:
        expected = _run(ex, solution, case, rank, world_size, group, watched)
        if expected.changed:
            raise AssertionError(f"the solution changed {expected.changed}")
    except Exception:
        return {"status": "error", "message": "the solution raised (a bug in the grader)",
                "traceback": traceback.format_exc()}
    try:
        got = _run(ex, learner_fn, case, rank, world_size, group, watched)
    except BadReturn as e:
        return {"status": "wrong", "output": "return value", "message": str(e)}
    except Exception as e:
        if _is_stub(e):
            return {"status": "stub"}
        message = f"{type(e).__name__}: {e}"
        record = {"status": "raised", "message": message,
                  "traceback": _learner_traceback(e, learner_file)}
        evidence = Evidence("raised", None, message, expected.outputs, {}, rank, world_size,
                            case.make, None if ex.distributed else solution)
        if (mistake := _diagnose(ex.mistakes, evidence)) is not None:
            record.update(mistake=mistake.kind, hint=mistake.hint)
        return record
    for name, value in expected.outputs.items():
        why = _compare(value, got.outputs[name])
        if why is not None:
            if name in ("comm ops", "bytes sent"):
                why += " (the grader sees what goes through zerolab.comm)"
            evidence = Evidence(name, value, got.outputs[name], expected.outputs, got.outputs,
                                rank, world_size, case.make,
                                None if ex.distributed else solution, got.args)
            return _wrong(name, why, _diagnose(ex.mistakes, evidence))
    for name, why in got.changed.items():
        output = f"input {name}"
        known = next((m for m in ex.mistakes if m.output == output), None)
        return _wrong(output, f"changed by your function: {why}",
                      known or Mistake("input changed", input_changed_hint(name)))
    return {"status": "passed"}
