"""Checking one case: import a file by path, run the solution then the learner's function on
the same fresh inputs, and compare. The same code runs in this process (plain exercises) and
on each spawned rank (distributed ones, whose zerolab.comm traffic is recorded too)."""

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

import torch.distributed as dist

from zerolab import comm
from zerolab.grading.compare import _compare
from zerolab.grading.exercise import BadReturn, Case, Exercise


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


def _run(ex: Exercise, fn: Callable, case: Case, rank: int, world_size: int,
         group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Call `fn` on the case's fresh arguments; return its named outputs."""
    args = case.make(rank)
    if not ex.distributed:
        return ex.outputs(fn(*args), args)
    with comm.record_comm(group=group, align=False) as log:
        result = fn(*args, rank, world_size, group)
    outputs = ex.outputs(result, args)
    if ex.comm_checked:
        outputs["comm ops"] = sorted({e.op for e in log.events})
        outputs["bytes sent"] = log.total_bytes()
    return outputs


def _check_case(ex: Exercise, learner: tuple[str, Callable], solution: Callable, case: Case,
                rank: int = 0, world_size: int = 1,
                group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Run the solution, then the learner, on the same inputs. A record: status and details."""
    learner_file, learner_fn = learner
    try:
        expected = _run(ex, solution, case, rank, world_size, group)
    except Exception:
        return {"status": "error", "message": "the solution raised (a bug in the grader)",
                "traceback": traceback.format_exc()}
    try:
        got = _run(ex, learner_fn, case, rank, world_size, group)
    except BadReturn as e:
        return {"status": "wrong", "output": "return value", "message": str(e)}
    except Exception as e:
        if _is_stub(e):
            return {"status": "stub"}
        return {"status": "raised", "message": f"{type(e).__name__}: {e}",
                "traceback": _learner_traceback(e, learner_file)}
    for name, value in expected.items():
        why = _compare(value, got[name])
        if why is not None:
            if name in ("comm ops", "bytes sent"):
                why += " (the grader sees what goes through zerolab.comm)"
            return {"status": "wrong", "output": name, "message": why}
    return {"status": "passed"}
