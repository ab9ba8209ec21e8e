"""Calling a function exercise on one case, in the process that holds the function, and
measuring what it did: its named outputs, the read-only arguments it changed, and (on ranks)
the zerolab.comm collectives it issued and the bytes they sent. All of it as data
(zerolab.grading.data), to be compared in the grader's own process.

A learner's function is called here only in a learner's process (zerolab.grading.worker); the
solution of a plain exercise is called the same way in the grader's process, so that both sides
are measured by the same code.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from zerolab import comm
from zerolab.grading import flight
from zerolab.grading.data import encode
from zerolab.grading.defaults import SOLUTIONS_DIR
from zerolab.grading.exercise import BadReturn, Case, Exercise
from zerolab.grading.storage import snapshot_of, what_changed


def positions(ex: Exercise) -> dict[str, int]:
    """The exercise's read-only arguments, by name -> position in the solution's signature."""
    names = _parameters(ex.module, ex.function)
    return {name: names.index(name) for name in ex.read_only}


@functools.cache
def _parameters(module: str, function: str) -> list[str]:
    """The names of a solution function's parameters, read from its source (not imported)."""
    tree = ast.parse((SOLUTIONS_DIR / f"{module}.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return [a.arg for a in node.args.args]


def call(ex: Exercise, fn: Callable, case: Case, positions: dict[str, int], rank: int = 0,
         world_size: int = 1, group: dist.ProcessGroup | None = None,
         flight_path: str | None = None) -> dict[str, Any]:
    """Call `fn` on the case's fresh arguments; what it did, as data:
    {"outputs": {name: value}, "changed": {argument: how}, "collectives": [...]}, or
    {"bad return": why} when it returned something of the wrong kind. An exception of `fn`
    propagates. flight_path: where to write each collective as it is issued (flight.py)."""
    args = case.make(rank)
    before = {name: snapshot_of(args[i]) for name, i in positions.items()}
    collectives: list[dict] = []
    if not ex.distributed:
        result = fn(*args)
    else:
        with comm.record_comm(group=group, align=False) as log:
            stream = flight.streamed(log, flight_path) if flight_path else None
            try:
                result = fn(*args, rank, world_size, group)
            finally:
                if stream is not None:
                    stream.close()
        collectives = [{"op": e.op, "tag": e.tag, "nbytes": e.nbytes, "dtype": e.dtype}
                       for e in log.events]
    try:
        outputs = ex.outputs(result, args)
    except BadReturn as e:
        return {"bad return": str(e)}
    if ex.distributed and ex.comm_checked:
        outputs["comm ops"] = sorted({e["op"] for e in collectives})
        outputs["bytes sent"] = log.total_ring_bytes()
    changed = {name: why for name, i in positions.items()
               if (why := what_changed(before[name], args[i])) is not None}
    return {"outputs": encode(outputs), "changed": changed, "collectives": collectives}
