"""One grading run, seen from the grader's process: start the ranks, read what they report,
and stop them from outside when they go wrong.

`run(tasks, world_size, timeout, references, judge)` starts `world_size` processes (hosts.py)
running worker.serve, then watches them: their events files (worker.py), their exit, and the
size of their output. It reads the references the ranks computed as soon as they are written
(those it was given, computed by an earlier run, are not computed again), removes their files,
and only then lets the ranks load the learner's code: no learner's process finds them. It
kills every rank (SIGKILL to their process groups) when a case or an import has run `timeout`
seconds, when a rank has printed more than OUTPUT_LIMIT bytes, or when a rank has ended without
finishing: once every other rank has said how its case ended, or GRACE seconds after. Nothing
a learner's code does in its process can delay this: the clock and the kill are here.

As each case of a task ends on every rank, `judge(task, case, got)` may say the task is wrong
already: the ranks are told to skip its remaining cases (the file skip-<key>).

What comes back (`Run`): the references, and per task the ranks' events and the data of every
case that returned; how the run stopped, if it stopped early (`Stop`: where, on which rank, and
how: a timeout, an exit, a signal, a flood of output); and the tasks it never reached.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerolab.grading import data, defaults, flight, hosts
from zerolab.grading.defaults import GRACE, OUTPUT_LIMIT, STARTUP_ALLOWANCE
from zerolab.grading.exercise import Exercise
from zerolab.grading.worker import serve

POLL = 0.02  # seconds between looks at the ranks


@dataclass(frozen=True)
class Task:
    """One learner's file graded for one exercise; `key` names it in the run's files."""

    key: str
    exercise: Exercise
    learner: str  # the file's path


@dataclass
class Stop:
    """How a run ended early: which rank, how, and where it was (task key and case)."""

    how: str  # "timeout", "exited", "killed", "output", "tainted", "startup", "malformed"
    rank: int | None = None
    code: int | None = None  # the exit status; negative: the signal that killed it
    key: str | None = None
    case: int | str | None = None  # a case's index, or "import"
    label: str = ""
    stuck: list[int] = field(default_factory=list)  # timeout: the ranks still in the case
    output: str = ""  # the head of what the rank printed


@dataclass
class Run:
    """What one run found."""

    world_size: int
    references: dict[str, list[Any]]  # exercise id -> per rank: a list per case, or an error
    events: dict[str, list[dict]]  # task key -> every rank's events, in order
    got: dict[tuple[str, int, int], Any]  # (key, case, rank) -> what the case returned
    flights: dict[tuple[str, int], list[list[dict]]]  # (key, case) -> each rank's collectives
    stop: Stop | None
    unreached: list[Task]  # not started: to grade in another run


Judge = Callable[[Task, int, list[Any], dict[str, list[Any]]], bool]


# What worker.py writes, event by event: the fields and their types. A line that is not one of
# these was not written by the grader's code (a learner's code can write into the file).
_CASE = (int, str)
_EVENTS = {"begin": {"key": str, "case": _CASE, "label": str},
           "end": {"key": str, "case": _CASE, "status": str},
           "done": {"key": str, "status": str, "message": str},
           "abandon": {"key": str, "case": _CASE},
           "references": {}, "tainted": {}, "final": {}}
_STATUSES = {"end": {"returned", "raised", "stub", "missing", "import failed",
                     "uses the reference"},
             "done": {"returned", "tampered", "uses the reference"}}
_TEXT = ("message", "traceback", "label")  # optional, text when present


def _valid(event: Any, rank: int, keys: set[str]) -> bool:
    """Whether `event` is one worker.py writes for this rank and these tasks."""
    if not isinstance(event, dict) or event.get("rank") != rank or \
            type(event.get("time")) not in (int, float):
        return False
    fields = _EVENTS.get(event.get("event"))
    if fields is None or any(not isinstance(event.get(f), t) or type(event.get(f)) is bool
                             for f, t in fields.items()):
        return False
    if "key" in fields and event["key"] not in keys:
        return False
    if "case" in fields and isinstance(event["case"], str) and event["case"] != "import":
        return False
    status = _STATUSES.get(event["event"])
    return (status is None or event["status"] in status) and \
        all(isinstance(event.get(f, ""), str) for f in _TEXT)


class _Rank:
    def __init__(self, workdir: Path, rank: int, keys: set[str]):
        self.rank, self.process, self.offset, self.partial = rank, None, 0, ""
        self.keys = keys  # the run's task keys
        self.events_path = workdir / f"events-{rank}.jsonl"
        self.log = workdir / f"log-{rank}"
        self.events: list[dict] = []
        self.begun: tuple[dict, float] | None = None  # the case it is in, since when (ours)
        self.malformed = ""  # the first line of its events that the grader did not write

    def read(self) -> list[dict]:
        """Take in the events written since the last look; return them. From the first line
        that is not an event of the grader's (`malformed`), nothing more is taken in."""
        if not self.events_path.exists() or self.malformed:
            return []
        with open(self.events_path, errors="replace") as f:
            f.seek(self.offset)
            text = self.partial + f.read()
            self.offset = f.tell()
        *lines, self.partial = text.split("\n")
        new = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not _valid(event, self.rank, self.keys):
                self.malformed = line[:80] or "an empty line"
                break
            new.append(event)
        for event in new:
            self.events.append(event)
            if event.get("event") == "begin":
                self.begun = (event, time.monotonic())
            elif event.get("event") in ("end", "done"):
                self.begun = None
        return new

    def last(self, *kinds: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("event") in kinds), None)

    @property
    def finished(self) -> bool:
        return self.last("final", "tainted") is not None

    @property
    def ended(self) -> bool:
        return self.process.exitcode is not None

    @property
    def told(self) -> bool:
        """It has said how its last case ended, and begun no other."""
        return self.begun is None and bool(self.events) and \
            self.events[-1].get("event") in ("end", "abandon")

    def output_head(self, lines: int = 12) -> str:
        try:
            with open(self.log, "rb") as f:
                text = f.read(4096).decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(line[:88] for line in text.splitlines()[:lines])


class _Watch:
    """The grader's side of one run, while it runs."""

    def __init__(self, tasks: list[Task], world_size: int, timeout: float,
                 references: dict[str, list[Any]], judge: Judge | None):
        self.tasks, self.world_size, self.timeout, self.judge = tasks, world_size, timeout, judge
        # A name that says nothing of grading: the learner's process works in a folder in it.
        self.dir = Path(tempfile.mkdtemp(prefix="zerolab-run-"))
        self.references = dict(references)
        needed = dict.fromkeys(t.exercise.id for t in tasks if t.exercise.distributed)
        self.computed = [i for i in needed if i not in references]  # by the ranks, this run
        self.ranks = [_Rank(self.dir, r, {t.key for t in tasks}) for r in range(world_size)]
        self.ends: dict[tuple[str, int], int] = {}  # (key, case) -> ranks that returned it
        self.got: dict[tuple[str, int, int], Any] = {}
        self.skipped: set[str] = set()

    def start(self) -> None:
        settings = {"tasks": [{"key": t.key, "exercise": t.exercise.id, "learner": t.learner}
                              for t in self.tasks],
                    "references": self.computed, "timeout": self.timeout,
                    # One thread: the cases' tensors are tiny, and a second thread only spins
                    # (measured: 4x the CPU time of an engine exercise on one rank).
                    "threads": 1,
                    # Read now, not at import: a caller (a test) may set other limits.
                    "limits": {"memory": defaults.MEMORY_LIMIT, "cpu": defaults.CPU_LIMIT,
                               "file": defaults.FILE_LIMIT}}
        (self.dir / "tasks.json").write_text(json.dumps(settings))
        hosts.prepare(self.world_size)
        for r in self.ranks:
            r.process = hosts.start(r.rank, serve, (str(self.dir), r.rank, self.world_size),
                                    str(r.log), workdir=str(self.dir))

    def stop_all(self) -> None:
        for r in self.ranks:
            if r.process is not None:
                hosts.kill(r.process)
        for r in self.ranks:
            if r.process is not None:
                r.process.join(timeout=10)

    def _returned(self, event: dict) -> None:
        """A rank's case returned: once every rank's has, read it and maybe judge it."""
        key, case = event["key"], event["case"]
        count = self.ends.get((key, case), 0) + 1
        self.ends[key, case] = count
        if count < self.world_size:
            return
        got = [data.load_result(str(self.dir / f"got-{key}-{case}-{r}.pt"))
               for r in range(self.world_size)]
        for r, g in enumerate(got):
            self.got[key, case, r] = g
        task = next(t for t in self.tasks if t.key == key)
        if self.judge is not None and key not in self.skipped and self.judge(
                task, case, got, self.references):
            self.skipped.add(key)  # wrong already: the rest of its cases need not run
            (self.dir / f"skip-{key}").touch()

    def watch(self) -> Stop | None:
        """Watch until the ranks finish or must be stopped; how it stopped early, if it did."""
        go = False  # the references are read: the ranks may load the learner's code
        started = time.monotonic()
        ended_at: float | None = None  # when a rank was first seen ended without finishing
        stop: Stop | None = None
        while True:
            now = time.monotonic()
            for r in self.ranks:
                # Whether it ended first, then its events: a rank that ended after this read
                # would otherwise look ended without its last events (a "final" written just
                # before its exit), and a clean finish would pass for an exit.
                r.process.join(0)
                for event in r.read():
                    if (event.get("event") == "end" and isinstance(event.get("case"), int)
                            and event["status"] == "returned"):
                        self._returned(event)
            if not go and all(r.last("references") for r in self.ranks):
                for i in self.computed:  # written before any learner code ran: a file
                    self.references[i] = [  # that cannot be read is the grader's error
                        _reference(str(self.dir / f"ref-{i}-{r.rank}.pt")) for r in self.ranks]
                for path in self.dir.glob("ref-*"):  # out of the learner's reach from here on
                    path.unlink()
                (self.dir / "go").touch()
                go = True
            if all(r.finished and r.ended for r in self.ranks):
                break
            if stop is None:
                stop = _trouble(self.ranks, self.timeout, now)
            if stop is None and not go and now - started > STARTUP_ALLOWANCE:
                stop = Stop("startup")
            if stop is not None and stop.how in ("timeout", "output", "startup", "malformed"):
                break
            # A rank ended early: the others get GRACE seconds to say how their case ended
            # (once each has, nothing more is to come: they wait for the one that ended).
            if ended_at is None and any(r.ended and not r.finished for r in self.ranks):
                ended_at = now
            if ended_at is not None and (now - ended_at > GRACE + 1
                                         or all(r.ended or r.told for r in self.ranks)):
                break
            time.sleep(POLL)
        self.stop_all()
        for r in self.ranks:
            r.read()
        if not go:
            return Stop("startup", output=self.ranks[0].output_head())
        if stop is None and any(r.last("tainted") for r in self.ranks):
            return Stop("tainted")
        return stop

    def result(self, stop: Stop | None) -> Run:
        events: dict[str, list[dict]] = {}
        for r in self.ranks:
            for e in r.events:
                if "key" in e:
                    events.setdefault(e["key"], []).append(e)
        flights = {}
        for key in events:
            for case in {e["case"] for e in events[key] if isinstance(e.get("case"), int)}:
                flights[key, case] = [
                    flight.read(str(self.dir / f"flight-{key}-{case}-{r}.jsonl"))
                    for r in range(self.world_size)]
        unreached = [t for t in self.tasks if t.key not in events]
        return Run(self.world_size, self.references, events, self.got, flights, stop,
                   unreached)


def run(tasks: list[Task], world_size: int, timeout: float,
        references: dict[str, list[Any]] | None = None, judge: Judge | None = None) -> Run:
    """Grade `tasks` on `world_size` new processes; see the module docstring."""
    watch = _Watch(tasks, world_size, timeout, references or {}, judge)
    try:
        watch.start()
        return watch.result(watch.watch())
    finally:
        watch.stop_all()
        shutil.rmtree(watch.dir, ignore_errors=True)


def _reference(path: str) -> Any:
    found = data.load_result(path)
    return {"error": found.why} if isinstance(found, data.Malformed) else found


def _trouble(ranks: list[_Rank], timeout: float, now: float) -> Stop | None:
    """The first sign that the run must end early, or None."""
    for r in ranks:
        if r.malformed:
            return _stop_at(r, "malformed", output=r.malformed)
    for r in ranks:
        if r.log.exists() and r.log.stat().st_size > OUTPUT_LIMIT:
            return _stop_at(r, "output", output=r.output_head())
    for r in ranks:
        if r.begun is not None and now - r.begun[1] > timeout:
            stuck = [q.rank for q in ranks if q.begun is not None
                     and q.begun[0].get("key") == r.begun[0].get("key")
                     and q.begun[0].get("case") == r.begun[0].get("case")]
            return _stop_at(r, "timeout", stuck=stuck)
    dead = sorted((r for r in ranks if r.ended and not r.finished and not r.last("abandon")),
                  key=lambda r: r.rank)
    if dead:
        r = dead[0]
        how = "killed" if r.process.exitcode < 0 else "exited"
        return _stop_at(r, how, code=r.process.exitcode, output=r.output_head())
    return None


def _stop_at(r: _Rank, how: str, **fields: Any) -> Stop:
    begun = r.begun[0] if r.begun is not None else (r.last("begin") or {})
    return Stop(how, r.rank, key=begun.get("key"), case=begun.get("case"),
                label=begun.get("label", ""), **fields)
