"""Grading a set of exercises: plain ones in this process, distributed ones on spawned ranks.

A plain exercise runs its cases here, each under a time limit. Distributed exercises run on
1, 2 and 3 ranks (zerolab.launch), one launch per world size for all those being graded; each
rank runs ranks._worker and compares its own outputs. The launch's own timeout is the
backstop for a rank that hangs where its watchdog cannot stop it. The ranks' records become
one verdict per exercise (the first failing case; the rank that caused it; for a rank killed
by a signal, the case it was in and the signal's likely cause).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

from zerolab.grading.check import _check_case
from zerolab.grading.crashes import _parse_crash
from zerolab.grading.defaults import GRACE, STARTUP_ALLOWANCE
from zerolab.grading.exercise import Exercise
from zerolab.grading.ranks import _worker
from zerolab.grading.report import Result, _result_from
from zerolab.launcher import LaunchError, LaunchTimeout, launch

# ---- plain exercises: in this process -----------------------------------------------------------


class _Timeout(BaseException):
    """Not an Exception, so that a learner's `except Exception` does not swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after `seconds` (SIGALRM: main thread on Unix only, else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> NoReturn:
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _grade_plain(ex: Exercise, learner: tuple[str, Callable], solution: Callable,
                 timeout: float) -> Result:
    for case in ex.cases():
        try:
            with _time_limit(timeout):
                record = _check_case(ex, learner, solution, case)
        except _Timeout:
            record = {"status": "timeout"}
        if record["status"] != "passed":
            return _result_from(ex, {**record, "label": case.label}, timeout=timeout)
    return Result(ex, "passed")


# ---- distributed exercises: on spawned ranks ----------------------------------------------------


@dataclass(frozen=True)
class _Task:
    """One learner file to grade on ranks for one exercise. `key` names it in the records (the
    exercise id; the mutation tool grades many files of one exercise in one launch)."""

    key: str
    exercise: Exercise
    learner: str  # file paths
    solution: str


def _launch_batch(tasks: list[_Task], world_size: int,
                  timeout: float) -> tuple[dict[str, list[dict]], str | None]:
    """One launch grading `tasks` at `world_size`: (records by task key, failure)."""
    workdir = tempfile.mkdtemp(prefix="zerolab-grade-")
    jobs = [(t.key, t.exercise.id, t.learner, t.solution) for t in tasks]
    failure = None
    try:
        launch(_worker, world_size, args=(jobs, workdir, timeout, GRACE), backend="gloo",
               timeout=STARTUP_ALLOWANCE + timeout * len(jobs))
    except LaunchTimeout as e:
        failure = f"timeout: {e}"
    except LaunchError as e:
        failure = str(e).splitlines()[0]
    records: dict[str, list[dict]] = {}
    for rank in range(world_size):
        path = os.path.join(workdir, f"records-{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        records.setdefault(r["id"], []).append(r)
    shutil.rmtree(workdir, ignore_errors=True)
    return records, failure


def _grade_distributed(tasks: list[_Task], world_sizes: Sequence[int],
                       timeout: float) -> dict[str, Result]:
    """Grade on each world size in turn; a task found wrong is not run again. Returns the
    results of the tasks found wrong, by key (a task missing from it passed)."""
    results: dict[str, Result] = {}
    for n in world_sizes:
        todo = [t for t in tasks if t.key not in results]
        retries = 0
        while todo:
            records, failure = _launch_batch(todo, n, timeout)
            finished = [t for t in todo
                        if sum(1 for r in records.get(t.key, []) if r.get("final")) == n]
            # If the launch died, the first unfinished task is the one that killed it ...
            stopped = next((t for t in todo if t not in finished), None)
            if stopped is not None and failure is not None and not records.get(stopped.key):
                # ... unless no rank even started it: the launch itself failed (a machine
                # short of memory or processes). Not the learner's fault: run it again.
                retries += 1
                if retries > 2:
                    raise RuntimeError(f"the grader could not run {n} ranks: {failure}")
                stopped = None
            elif stopped is not None and failure is None:
                failure = "the ranks ended before this exercise finished (a bug in the grader?)"
            resolved = finished + ([stopped] if stopped is not None else [])
            for t in resolved:
                verdict = _verdict(t.exercise, n, records.get(t.key, []),
                                   failure if t is stopped else None, timeout)
                if verdict is not None:
                    results[t.key] = verdict
            todo = [t for t in todo if t not in resolved]  # not reached: run them again
    return results


def _verdict(ex: Exercise, world_size: int, records: list[dict], failure: str | None,
             timeout: float) -> Result | None:
    """The exercise's result at one world size from its ranks' records (None: passed)."""
    if (crashed := _crash_verdict(ex, world_size, records, failure)) is not None:
        return crashed
    failing = [r for r in records if "status" in r and r["status"] != "passed"]
    if not failing:
        if failure is None:
            return None
        if failure.startswith("timeout"):
            return _result_from(ex, {"status": "timeout", "world_size": world_size},
                                timeout=timeout)
        return Result(ex, "wrong", world_size=world_size,
                      message=f"the ranks stopped before finishing: {failure}", hint=ex.hint)
    case = min(r["case"] for r in failing)
    at_case = sorted((r for r in failing if r["case"] == case), key=lambda r: r["rank"])
    record = at_case[0]
    for status in ("error", "raised", "timeout", "stub", "wrong"):
        chosen = [r for r in at_case if r["status"] == status]
        if chosen:
            # The first rank to raise is the cause: when it leaves, a rank that was waiting
            # for it may raise too (connection closed) before the launch kills it.
            record = min(chosen, key=lambda r: r["time"]) if status == "raised" else chosen[0]
            break
    if record["status"] == "timeout":
        done = {r["rank"] for r in records
                if r.get("case") == case and r.get("status", "timeout") != "timeout"}
        record = {**record, "stuck": sorted(set(range(world_size)) - done)}
    return _result_from(ex, {**record, "world_size": world_size}, timeout=timeout)


def _crash_verdict(ex: Exercise, world_size: int, records: list[dict],
                   failure: str | None) -> Result | None:
    """A rank killed by a signal inside the learner's function (it began a case and never
    recorded its outcome): the signal, the case, and the likely cause. The other ranks'
    errors (connection closed) are consequences, not shown."""
    crash = _parse_crash(failure)
    if crash is None:
        return None
    mine = [r for r in records if r.get("rank") == crash.rank]
    done = {r["case"] for r in mine if "status" in r}
    begun = [r for r in mine if r.get("begin") and r["case"] not in done]
    if not begun:
        return None
    label = begun[-1]["label"]
    known = next((m for m in ex.mistakes if m.signal == crash.signal), None)
    return Result(ex, "wrong", world_size=world_size, rank=crash.rank, case=label,
                  message=crash.message(label), hint=known.hint if known else ex.hint,
                  mistake=known.kind if known else "")
