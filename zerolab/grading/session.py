"""One grading run, seen from the grader's process: start the ranks, read what they report,
and stop them from outside when they go wrong.

`run(tasks, world_size, timeout)` starts `world_size` processes (hosts.py) running
worker.serve, then watches them: their events files (worker.py), their exit, and the size of
their output. It reads every rank's references as soon as they are written and only then lets
the ranks load the learner's code. It kills every rank (SIGKILL to their process groups) when
a case or an import has run `timeout` seconds, when a rank has printed more than OUTPUT_LIMIT
bytes, or GRACE seconds after a rank has ended without finishing. Nothing a learner's code does
in its process can delay this: the clock and the kill are here.

What comes back (`Run`): the references, and per task the ranks' events and the data of every
case that returned; how the run stopped, if it stopped early (`Stop`: where, on which rank, and
how: a timeout, an exit, a signal, a flood of output); and the tasks it never reached.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerolab.grading import data, flight, hosts
from zerolab.grading.defaults import GRACE, OUTPUT_LIMIT, STARTUP_ALLOWANCE
from zerolab.grading.exercise import Exercise
from zerolab.grading.worker import serve
from zerolab.launcher.torchrun import default_threads

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

    how: str  # "timeout", "exited", "killed", "output", "tainted"
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


class _Rank:
    def __init__(self, workdir: Path, rank: int):
        self.rank, self.process, self.offset, self.partial = rank, None, 0, ""
        self.events_path = workdir / f"events-{rank}.jsonl"
        self.log = workdir / f"log-{rank}"
        self.events: list[dict] = []
        self.begun: tuple[dict, float] | None = None  # the case it is in, since when (ours)

    def read(self) -> None:
        """Take in the events written since the last look."""
        if not self.events_path.exists():
            return
        with open(self.events_path, errors="replace") as f:
            f.seek(self.offset)
            text = self.partial + f.read()
            self.offset = f.tell()
        *lines, self.partial = text.split("\n")
        for line in lines:
            event = json.loads(line)
            self.events.append(event)
            if event.get("event") == "begin":
                self.begun = (event, time.monotonic())
            elif event.get("event") in ("end", "done"):
                self.begun = None

    def last(self, *kinds: str) -> dict | None:
        return next((e for e in reversed(self.events) if e.get("event") in kinds), None)

    @property
    def finished(self) -> bool:
        return self.last("final", "tainted") is not None

    def output_head(self, lines: int = 12) -> str:
        try:
            with open(self.log, "rb") as f:
                text = f.read(4096).decode(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(line[:88] for line in text.splitlines()[:lines])


def run(tasks: list[Task], world_size: int, timeout: float) -> Run:
    """Grade `tasks` on `world_size` new processes; see the module docstring."""
    workdir = Path(tempfile.mkdtemp(prefix="zerolab-grade-"))
    settings = {"tasks": [{"key": t.key, "exercise": t.exercise.id, "learner": t.learner}
                          for t in tasks],
                "timeout": timeout, "threads": default_threads(world_size)}
    (workdir / "tasks.json").write_text(json.dumps(settings))
    ranks = [_Rank(workdir, r) for r in range(world_size)]
    try:
        for r in ranks:
            r.process = hosts.start(r.rank, serve, (str(workdir), r.rank, world_size), str(r.log))
        references, stop = _watch(ranks, tasks, workdir, timeout)
        return _collect(ranks, tasks, workdir, world_size, references, stop)
    finally:
        for r in ranks:
            if r.process is not None:
                hosts.kill(r.process)
                r.process.join(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def _watch(ranks: list[_Rank], tasks: list[Task], workdir: Path,
           timeout: float) -> tuple[dict[str, list[Any]], Stop | None]:
    """Watch the ranks until they finish or must be stopped; the references they computed."""
    references: dict[str, list[Any]] = {}
    ids = list(dict.fromkeys(t.exercise.id for t in tasks if t.exercise.distributed))
    go = False  # the references are read: the ranks may load the learner's code
    started = time.monotonic()
    ended_at: float | None = None  # when a rank was first seen ended without finishing
    stop: Stop | None = None
    while True:
        now = time.monotonic()
        for r in ranks:
            r.read()
            r.process.join(0)
        if not go and all(r.last("references") for r in ranks):
            references = {i: [data.load(str(workdir / f"ref-{i}-{r.rank}.pt")) for r in ranks]
                          for i in ids}
            (workdir / "go").touch()
            go = True
        if all(r.finished and r.process.exitcode is not None for r in ranks):
            break
        if stop is None:
            stop = _trouble(ranks, timeout, now)
        if stop is None and not go and now - started > STARTUP_ALLOWANCE:
            stop = Stop("startup")
        if stop is not None and stop.how in ("timeout", "output", "startup"):
            break
        # A rank ended early: the others get GRACE seconds to say how their case ended.
        if ended_at is None and any(r.process.exitcode is not None and not r.finished
                                    for r in ranks):
            ended_at = now
        if ended_at is not None and (now - ended_at > GRACE + 1
                                     or all(r.process.exitcode is not None for r in ranks)):
            break
        time.sleep(POLL)
    for r in ranks:
        hosts.kill(r.process)
    for r in ranks:
        r.process.join(timeout=10)
        r.read()
    if not go:
        stop = Stop("startup", output=ranks[0].output_head() if ranks else "")
    return references, stop


def _trouble(ranks: list[_Rank], timeout: float, now: float) -> Stop | None:
    """The first sign that the run must end early, or None."""
    for r in ranks:
        if r.log.exists() and r.log.stat().st_size > OUTPUT_LIMIT:
            return _stop_at(r, "output", output=r.output_head())
    for r in ranks:
        if r.begun is not None and now - r.begun[1] > timeout:
            stuck = [q.rank for q in ranks if q.begun is not None
                     and q.begun[0].get("key") == r.begun[0].get("key")
                     and q.begun[0].get("case") == r.begun[0].get("case")]
            return _stop_at(r, "timeout", stuck=stuck)
    dead = sorted((r for r in ranks if r.process.exitcode is not None and not r.finished
                   and not r.last("abandon")), key=lambda r: r.rank)
    if dead:
        r = dead[0]
        how = "killed" if r.process.exitcode < 0 else "exited"
        return _stop_at(r, how, code=r.process.exitcode, output=r.output_head())
    return None


def _stop_at(r: _Rank, how: str, **fields: Any) -> Stop:
    begun = r.begun[0] if r.begun is not None else (r.last("begin") or {})
    return Stop(how, r.rank, key=begun.get("key"), case=begun.get("case"),
                label=begun.get("label", ""), **fields)


def _collect(ranks: list[_Rank], tasks: list[Task], workdir: Path, world_size: int,
             references: dict[str, list[Any]], stop: Stop | None) -> Run:
    events: dict[str, list[dict]] = {}
    for r in ranks:
        for e in r.events:
            if "key" in e:
                events.setdefault(e["key"], []).append(e)
    got, flights = {}, {}
    for path in workdir.glob("got-*.pt"):
        key, case, rank = path.stem.removeprefix("got-").rsplit("-", 2)
        got[key, int(case), int(rank)] = data.load(str(path))
    for key in events:
        cases = {e["case"] for e in events[key] if isinstance(e.get("case"), int)}
        for case in cases:
            flights[key, case] = [flight.read(str(workdir / f"flight-{key}-{case}-{r}.jsonl"))
                                  for r in range(world_size)]
    tainted = any(r.last("tainted") for r in ranks)
    if stop is None and tainted:
        stop = Stop("tainted")
    unreached = [t for t in tasks if t.key not in events]
    return Run(world_size, references, events, got, flights, stop, unreached)
