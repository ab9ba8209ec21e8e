"""Grading a set of learner's files: runs on each world size, and a verdict per file.

No learner code runs in this process. Here: the references of plain exercises (the solution,
run on each case), the runs (session.py: the learner's code on processes of its own, plain
exercises on one process, distributed ones on 1, 2 and 3 ranks, one run per world size for all
of them), and the judging of what came back (kinds.judge), case by case, rank by rank. A task
found wrong on one world size is not run on the next. A run that stopped early (a timeout, an
exit, a crash, a flood of output) gives a wrong verdict to the task it stopped in, and the
tasks it never reached are run again; a run that could not even start is retried twice, then
the grader gives up (not the learner's fault).

The references are computed before any learner code runs: plain exercises' here, once the
course is read; distributed ones' by the ranks of each run, before its learner code (session.py).
The course's files (course.py) are read before any learner code runs, and compared after every
run: a change is put back, and is the verdict (WRONG) of the file whose run made it. A run of
several learners' files that changed the course is run again a file at a time, to tell which.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from zerolab.grading import borrowed, course, crashes, data, hosts, kinds, session
from zerolab.grading.check import judge_raised
from zerolab.grading.exercise import Exercise
from zerolab.grading.mistakes import Evidence
from zerolab.grading.registry import EXERCISES
from zerolab.grading.report import Result, result_from
from zerolab.grading.session import Run, Task


def grade_tasks(tasks: list[Task], world_sizes: Sequence[int],
                timeout: float) -> dict[str, Result]:
    """Grade every task; their results by key (a task missing from it passed)."""
    results: dict[str, Result] = {}
    plain = [t for t in tasks if not t.exercise.distributed]
    distributed = [t for t in tasks if t.exercise.distributed]
    sizes = list(world_sizes) if distributed else []
    if plain and 1 not in sizes:
        sizes = [1, *sizes]
    if sizes:  # the ranks' hosts import torch meanwhile: the runs need not wait for them
        hosts.warm(max(sizes))
    pristine = course.snapshot(t.learner for t in tasks)
    for ex_id in dict.fromkeys(t.exercise.id for t in plain):
        _plain_expected(ex_id)  # from the course as just read, before any learner code runs
    for n in sizes:
        todo = [t for t in distributed if t.key not in results]
        if n == 1:
            todo = plain + todo
        _grade_on(todo, n, timeout, results, pristine)
    return results


def _wrong_already(task: Task, index: int, got: list[Any],
                   references: dict[str, list[Any]]) -> bool:
    """Whether a case that returned on every rank shows the task wrong (session.Judge)."""
    ex, n = task.exercise, len(got)
    expected = _expected(ex, references)
    if isinstance(expected, Result) or any(isinstance(g, data.Malformed) for g in got):
        return True
    cases = ex.cases(n) if ex.distributed else ex.cases()
    record = _judge(ex, cases[index], n, [e[index] for e in expected], got)
    return record["status"] != "passed"


def _judge(ex: Exercise, case: Any, n: int, expected: list[Any], got: list[Any]) -> dict:
    """kinds.judge, on what a learner's process sent back: data of another shape than the
    grader's code writes (the learner's code can write its process's files) is a malformed
    result, never a traceback here."""
    bad = next((g for g in got if isinstance(g, data.Malformed)), None)
    if bad is not None:
        return _malformed(bad.why)
    try:
        return kinds.judge(ex, case, n, expected, got)
    except Exception as e:
        return _malformed(f"{type(e).__name__}: {e}"[:200])


def _malformed(why: str) -> dict:
    return {"status": "wrong", "output": None, "mistake": "a malformed result",
            "message": f"what your code's process sent back is not what the grader's code "
                       f"writes ({why}): was something of the grader's replaced or written "
                       f"over?",
            "hint": "Leave the grader's code and files alone: your answer returns its results, "
                    "the grader measures and records them."}


def _grade_on(todo: list[Task], world_size: int, timeout: float, results: dict[str, Result],
              pristine: course.Snapshot) -> None:
    """Run `todo` on `world_size` ranks until every task has a verdict there (the references
    computed by the first run serve the next ones)."""
    failures = 0
    references: dict[str, list[Any]] = {}
    while todo:
        run = session.run(todo, world_size, timeout, references, _wrong_already)
        course.drop_caches(pristine)
        if changed := course.changes(pristine):
            _course_changed(todo, world_size, timeout, results, pristine, changed)
            return
        references = run.references
        if run.stop is not None and run.stop.how == "startup":
            failures += 1
            if failures > 2:
                raise RuntimeError(f"the grader could not run {world_size} rank(s):\n"
                                   f"{run.stop.output}")
            continue
        for task in todo:
            if task in run.unreached:
                continue
            verdict = _verdict(task, run, timeout)
            if verdict is not None:
                results[task.key] = verdict
        todo = list(run.unreached)


def _course_changed(todo: list[Task], world_size: int, timeout: float,
                    results: dict[str, Result], pristine: course.Snapshot,
                    changed: list[course.Change]) -> None:
    """A run changed the course: put it back; with one learner's file in the run, that file's
    tasks are WRONG; with several, each file is run again on its own, to tell which did it."""
    failed = course.restore(pristine, changed)
    files = list(dict.fromkeys(t.learner for t in todo))
    if len(files) > 1:
        for file in files:
            _grade_on([t for t in todo if t.learner == file], world_size, timeout, results,
                      pristine)
        return
    what = ", ".join(map(str, changed[:5])) + (", ..." if len(changed) > 5 else "")
    back = (f"put back as they were but {'; '.join(failed)}: put those back yourself (git "
            f"checkout)" if failed else "put back as they were")
    for task in todo:
        results[task.key] = Result(
            task.exercise, "wrong", world_size=_shown(task.exercise, world_size),
            message=f"your code changed the course's files: {what} ({back}). A grade "
                    f"measures your answer against the course as it is",
            mistake="the course's files changed",
            hint="Leave solutions/, zerolab/ and the other exercises' files as they are: "
                 "your answer's code writes nothing but its own results.")


def _verdict(task: Task, run: Run, timeout: float) -> Result | None:
    """The task's result on this run's world size (None: passed)."""
    ex, n = task.exercise, run.world_size
    events = run.events.get(task.key, [])
    ends = {(e["case"], e["rank"]): e for e in events if e["event"] == "end"}
    expected = _expected(ex, run.references)
    if isinstance(expected, Result):
        return expected
    cases = ex.cases(n) if ex.distributed else ex.cases()
    done = [e for e in events if e["event"] == "done" and e["status"] == "tampered"]
    if done:  # whatever the cases showed, they were measured with replaced tools
        return _tampered(ex, n, done[0]["message"])
    done = [e for e in events if e["event"] == "done" and e["status"] == "uses the reference"]
    if done:  # imported lazily, while its cases ran
        return _uses_reference(ex, n, done[0]["message"])
    for index in ["import", *range(len(cases))]:
        mine = [ends.get((index, r)) for r in range(n)]
        label = "" if index == "import" else cases[index].label
        failed = [e for e in mine if e is not None and e["status"] != "returned"]
        causes = [e for e in failed if not _consequence(e)]
        stopped_here = (run.stop is not None and run.stop.key == task.key
                        and run.stop.case == index)
        if causes or (failed and not stopped_here):
            return _failed(ex, task, index, label, causes or failed, expected, run, cases)
        if None in mine or stopped_here:  # the run stopped in this case
            return _stopped(ex, task, index, label, run, timeout, cases)
        if index == "import":
            continue
        got = [run.got.get((task.key, index, r), data.Malformed("no result file"))
               for r in range(n)]
        record = _judge(ex, cases[index], n, [e[index] for e in expected], got)
        if record["status"] != "passed":
            return result_from(ex, {**record, "label": label, "world_size": _shown(ex, n)},
                                timeout)
    if not any(e["event"] == "done" for e in events):
        return _stopped(ex, task, "done", "", run, timeout, cases)
    return None


# What gloo raises on a rank whose peer has died: a consequence, never the cause.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "Read error", "Write error", "Connection refused")


def _consequence(end: dict) -> bool:
    return end["status"] == "raised" and any(w in end.get("message", "") for w in _PEER_GONE)


def _shown(ex: Exercise, world_size: int) -> int | None:
    return world_size if ex.distributed else None


@functools.cache
def _plain_expected(exercise_id: str) -> list[list[Any]]:
    """A plain exercise's solution on each of its cases, run here (it is the course's code)."""
    ex = EXERCISES[exercise_id]
    solution = kinds.solution(ex)
    return [[data.decode(kinds.run(ex, solution, case)) for case in ex.cases()]]


def _expected(ex: Exercise, references: dict[str, list[Any]]) -> list[list[Any]] | Result:
    """Per rank, the reference's results of each case (computed here for a plain exercise)."""
    if not ex.distributed:
        return _plain_expected(ex.id)
    per_rank = references.get(ex.id)
    bad = next((r for r in per_rank or [None] if not isinstance(r, list)), "missing")
    if per_rank is None or bad != "missing":
        trace = bad.get("error", "") if isinstance(bad, dict) else ""
        return Result(ex, "error", message="the reference raised (a bug in the grader)",
                      traceback=trace)
    return per_rank


def _failed(ex: Exercise, task: Task, index: Any, label: str, failed: list[dict],
            expected: list[list[Any]], run: Run, cases: list) -> Result:
    """A case (or the import) that did not return on some rank: its first cause."""
    n = run.world_size
    for status in ("tampered", "uses the reference", "import failed", "missing", "error",
                   "raised", "stub"):
        chosen = sorted((e for e in failed if e["status"] == status), key=lambda e: e["time"])
        if not chosen:
            continue
        e = chosen[0]  # the first to raise is the cause; the others may be its consequences
        if status == "tampered":
            return _tampered(ex, n, e.get("message", ""))
        if status == "uses the reference":
            return _uses_reference(ex, n, e.get("message", ""))
        if status == "import failed":
            name = task.learner.rsplit("/", 1)[-1]
            return Result(ex, "wrong", message=f"{name} does not import: {e['message']}",
                          traceback=e.get("traceback", ""),
                          hint=f"Fix the file so that `python {name}` runs.")
        if status == "missing":
            return Result(ex, "not attempted",
                          message=f"no {'class' if ex.kind == 'engine' else 'function'} "
                                  f"{ex.function} in {task.learner.rsplit('/', 1)[-1]}")
        if status == "stub":
            return Result(ex, "not attempted")
        record = {**e, "label": label, "world_size": _shown(ex, n)}
        if status == "raised" and index != "import":
            rank = e["rank"]
            mistake = judge_raised(ex, cases[index], rank, n, e["message"],
                                   expected[rank][index] if rank < len(expected) else None,
                                   None if ex.distributed else kinds.solution(ex))
            if mistake is not None:
                record.update(mistake=mistake.kind, hint=mistake.hint)
        return result_from(ex, record, timeout=0)
    raise AssertionError(failed)


def _tampered(ex: Exercise, world_size: int, what: str) -> Result:
    return Result(ex, "wrong", world_size=_shown(ex, world_size),
                  message=f"your code replaced {what} in its process: the grader measures with "
                          f"torch, zerolab and its own code as they are",
                  mistake="the grader's tools patched",
                  hint="Leave torch, zerolab and zerolab.grading as they are: write your answer "
                       "in your own function, without changing what the grader measures with.")


def _uses_reference(ex: Exercise, world_size: int, what: str) -> Result:
    return Result(ex, "uses the reference", world_size=_shown(ex, world_size),
                  message=f"{what}: an answer built on the reference shows nothing of yours",
                  hint=borrowed.HINT)


def _stopped(ex: Exercise, task: Task, index: Any, label: str, run: Run, timeout: float,
             cases: list) -> Result:
    """The run stopped while this task ran: a timeout, an exit, a crash, a flood."""
    stop = run.stop
    n = run.world_size
    if stop is None or stop.key not in (None, task.key):
        return Result(ex, "error", world_size=_shown(ex, n), case=label or None,
                      message="the ranks stopped before finishing this exercise, without a "
                              "cause the grader could see (a bug in the grader?)")
    flights = run.flights.get((task.key, index), []) if isinstance(index, int) else []
    evidence = None
    if isinstance(index, int):
        evidence = Evidence("crash", None, flights, {}, {}, stop.rank or 0, n,
                            cases[index].make, None, label)
    told = crashes.explain(stop, timeout, ex.mistakes, flights, evidence, ex.distributed)
    return Result(ex, "wrong", world_size=_shown(ex, n),
                  rank=stop.rank if ex.distributed and stop.how != "timeout" else None,
                  case=label or None, message=told.message, timed_out=told.timed_out,
                  printed=told.printed,
                  mistake=told.mistake.kind if told.mistake else "",
                  hint=told.mistake.hint if told.mistake else ex.hint)
