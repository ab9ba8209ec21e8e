"""What runs on each spawned rank: `_worker` grades a batch of distributed exercises, case by
case, appending each outcome to a records file as it happens.

Each exercise gets a fresh process group, and a rank that raises stops its exercise on every
rank (they agree through a file store), so one exercise cannot spoil the next. A case that
runs longer than `timeout` (a rank waiting for a message that never comes) is stopped by a
watchdog in the rank. `_worker` is launched by module and name (zerolab.launch pickles it), so
it stays at the top level of this module.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch.distributed as dist

from zerolab.grading.check import _check_case, _learner_traceback, _load_module
from zerolab.grading.registry import EXERCISES


@contextlib.contextmanager
def _watchdog(seconds: float, on_expire: Callable[[], None]) -> Iterator[None]:
    """Call on_expire (which ends the process) if the block is still running after `seconds`."""
    timer = threading.Timer(seconds, on_expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _agree(store: dist.Store, key: str, status: str, rank: int, world_size: int,
           wait: float) -> list[str] | None:
    """Post this rank's status for a case and read everyone's; None if some rank never posts."""
    store.set(f"{key}/{rank}", status)
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except Exception:  # a rank is still stuck in the learner's code
        return None
    return [store.get(k).decode() for k in keys]


def _worker(tasks: list[tuple[str, str, str, str]], workdir: str, timeout: float,
            grace: float) -> None:
    """One rank: grade each (key, exercise id, learner file, solution file) in turn.

    Every case's start and outcome are appended to records-<rank>.jsonl as they happen (under
    the task's key), so that the caller learns what finished, and in which case a rank died,
    even if the launch dies (a rank raised alone, hung, or was killed by a signal).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    records = os.path.join(workdir, f"records-{rank}.jsonl")
    modules: dict[str, ModuleType] = {}

    def record(**fields: Any) -> None:
        with open(records, "a") as f:
            f.write(json.dumps({"rank": rank, "time": time.time(), **fields}) + "\n")

    def function(path: str, name: str) -> Callable:
        if path not in modules:
            modules[path] = _load_module(Path(path))
        return getattr(modules[path], name)

    for key, ex_id, learner_file, solution_file in tasks:
        ex = EXERCISES[ex_id]
        group = dist.new_group()  # a fresh group: stray messages of one exercise stay there
        record(id=key, start=True)
        for index, case in enumerate(ex.cases(world_size)):
            def expire(key: str = key, index: int = index, label: str = case.label) -> None:
                record(id=key, case=index, label=label, status="timeout")
                os._exit(3)

            record(id=key, case=index, label=case.label, begin=True)
            with _watchdog(timeout, expire):
                try:
                    learner_fn = function(learner_file, ex.function)
                except Exception as e:
                    outcome = {"status": "raised", "message": f"{type(e).__name__}: {e}",
                               "traceback": _learner_traceback(e, learner_file)}
                else:
                    outcome = (ex.check or _check_case)(
                        ex, (learner_file, learner_fn), function(solution_file, ex.function),
                        case, rank, world_size, group)
                record(id=key, case=index, label=case.label, **outcome)
                # A rank that raised may have left the others waiting for its messages: it
                # gives them `grace` seconds, then ends the launch.
                failed = outcome["status"] in ("raised", "stub", "error")
                statuses = _agree(store, f"{key}/{index}", outcome["status"], rank,
                                  world_size, grace if failed else timeout + grace)
            if statuses is None:
                os._exit(1)
            if any(s != "passed" for s in statuses):
                break  # every rank saw the same statuses: all stop this exercise
        record(id=key, final=True)
