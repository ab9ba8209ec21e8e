"""What each process of a grading run does: the only place a learner's code runs.

`serve(workdir, rank, world_size)` is rank `rank` of a run (hosts.py starts it). The run's
tasks, each a learner's file for one exercise, are in workdir/tasks.json. In order:

1. Limits: the process leads a process group of its own and adopts every orphan below it (a
   child subreaper: the grader kills it and all it started, new sessions included, from
   outside), it may map MEMORY_LIMIT bytes, use CPU_LIMIT CPU seconds a case and write no
   file past FILE_LIMIT bytes (each limit is named in the verdict when hit; the grader's
   process says which, read when the run starts), and it works in a
   scratch folder of its own (rank-<rank>, in the run's folder), never the project's: a
   relative path in a learner's code lands there.
2. The references, before any learner code is loaded: each distributed exercise's solution (an
   engine exercise: zerolab's engine of its stage) on every case, written to ref-<id>-<rank>.pt.
   The process then waits until the grader has read them all and removed their files (the file
   `go`): what the learner's answers are compared with is out of this process, and off the
   disk, before the learner's code is in it. What else of solutions/ a case reads is read now.
3. `tamper.snapshot()`, then each task: import the learner's file, run every case, write what
   it returned (as data, got-<key>-<case>-<rank>.pt) and how it ended, then check that nothing
   the grader measures with was replaced (at import or since: the task's verdict is then
   "tampered", whatever its cases showed), with the check as it was when the process started
   (`tamper.sealed()`). A replaced function ends the run (a fresh one
   grades the rest): the process is no longer the grader's.

Everything that happens is appended to events-<rank>.jsonl as it happens (begin and end of
each case, with its status), so that the grader knows where a process was when it stopped
answering, exited, crashed or printed too much. Ranks agree after each case (a FileStore):
when one raised, they all stop that task, and a rank left waiting for a peer that never comes
ends its process.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from zerolab.grading import borrowed, data, hosts, kinds, tamper
from zerolab.grading.check import is_stub, learner_traceback, load_module
from zerolab.grading.defaults import GRACE
from zerolab.grading.registry import EXERCISES


class _Events:
    """This rank's events file: one JSON object a line, written at once."""

    def __init__(self, path: str, rank: int):
        self._file = open(path, "a", buffering=1)
        self.rank = rank

    def write(self, **fields: Any) -> None:
        self._file.write(json.dumps({"rank": self.rank, "time": time.time(), **fields}) + "\n")


def _agree(store: dist.Store, key: str, status: str, rank: int, world_size: int,
           wait: float) -> list[str] | None:
    """Post this rank's status and read everyone's; None if a rank never posts."""
    store.set(f"{key}/{rank}", status)
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except Exception:  # a rank is still inside the learner's code
        return None
    return [store.get(k).decode() for k in keys]


def _limit_hit(e: BaseException, limits: dict[str, int]) -> str:
    """Which of the process's limits an exception shows it hit ("" for none)."""
    text = str(e)
    if isinstance(e, MemoryError) or "can't allocate memory" in text or \
            "Cannot allocate memory" in text:
        return f" (past the grader's memory limit: {limits['memory'] >> 20} MiB per process)"
    if isinstance(e, OSError) and e.errno == errno.EFBIG:
        return f" (past the grader's file-size limit: {limits['file'] >> 20} MiB)"
    return ""


def _limit(limits: dict[str, int]) -> None:
    """CPU time: `limits["cpu"]` seconds more from now (SIGXCPU past it), before each case."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime) + 1 + limits["cpu"]
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))


def _raised(e: BaseException, learner_file: str, limits: dict[str, int]) -> dict[str, str]:
    """How a case that raised ended: "stub" for the untouched exercise; an engine whose
    constructor ran but a method is still the stub is "raised", and says so; an engine the
    grader found built on a reference engine (borrowed.Borrowed) "uses the reference"."""
    if type(e) is borrowed.Borrowed:
        return {"status": "uses the reference", "message": str(e)}
    unwritten = getattr(e, "zerolab_unwritten", False)
    if is_stub(e) and not unwritten:
        return {"status": "stub"}
    todo = " (a method still to write)" if unwritten else ""
    return {"status": "raised",
            "message": f"{type(e).__name__}: {e}{todo}{_limit_hit(e, limits)}",
            "traceback": learner_traceback(e, learner_file)}


class _Run:
    """One rank's run of its tasks."""

    def __init__(self, workdir: str, rank: int, world_size: int):
        self.dir, self.rank, self.world_size = Path(workdir), rank, world_size
        settings = json.loads((self.dir / "tasks.json").read_text())
        self.tasks, self.timeout = settings["tasks"], settings["timeout"]
        self.limits: dict[str, int] = settings["limits"]
        self.reference_ids = settings["references"]  # the others, the grader has already
        torch.set_num_threads(settings["threads"])
        self.events = _Events(str(self.dir / f"events-{rank}.jsonl"), rank)
        self.distributed = any(EXERCISES[t["exercise"]].distributed for t in self.tasks)
        if self.distributed:
            store = dist.FileStore(str(self.dir / "rendezvous"), world_size)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=self.timeout * 4))
        self.store = dist.FileStore(str(self.dir / "agree"), world_size)
        self.modules: dict[str, ModuleType | dict] = {}
        self.modules_before: dict[str, set[str]] = {}  # learner file -> sys.modules before it
        self.hidden: dict[str, ModuleType] = {}  # the grader's modules, out of sys.modules

    def path(self, kind: str, *names: Any, suffix: str = "pt") -> str:
        return str(self.dir / f"{kind}-{'-'.join(map(str, (*names, self.rank)))}.{suffix}")

    # ---- 2. the references ------------------------------------------------------------------

    def references(self) -> None:
        for ex_id in self.reference_ids:
            ex = EXERCISES[ex_id]
            group = dist.new_group()  # every rank makes the same groups, in the same order
            try:
                reference = kinds.reference(ex)
                found = [kinds.run(ex, reference, case, self.rank, self.world_size, group)
                         for case in ex.cases(self.world_size)]
            except Exception:
                found = {"error": traceback.format_exc()}
            data.save(found, self.path("ref", ex_id))
        # The solutions the references ran leave this process's modules before any learner's
        # code comes in: a learner's file that imports one then imports it itself (borrowed).
        borrowed.forget_solutions(keep=[t["learner"] for t in self.tasks])
        kinds.forget_solutions()
        for task in self.tasks:
            kinds.prepare(EXERCISES[task["exercise"]])
        borrowed.prepare()
        self.hidden = tamper.hide_grader()  # nothing of the grader found by name from here on
        self.events.write(event="references")
        go = self.dir / "go"
        while not go.exists():  # the grader reads every rank's references, then writes `go`
            time.sleep(0.01)

    # ---- 3. the learner's files -------------------------------------------------------------

    def load(self, learner_file: str) -> ModuleType | dict:
        """The learner's module, imported once per run; or how importing it went wrong."""
        if learner_file not in self.modules:
            self.modules_before[learner_file] = set(sys.modules)
            try:
                self.modules[learner_file] = load_module(Path(learner_file),
                                                          prefix="_zerolab_learner")
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: a wrong answer
                self.modules[learner_file] = {"status": "import failed",
                                              "message": f"{type(e).__name__}: {e}",
                                              "traceback": learner_traceback(e, learner_file)}
        return self.modules[learner_file]

    def agree(self, key: str, index: Any, status: str, skippable: bool = False) -> list[str]:
        """Every rank's status for this case; "skip" for all when the grader has already
        found the task wrong (rank 0 looks, so that every rank decides alike)."""
        failed = status != "returned"
        statuses = _agree(self.store, f"{key}/{index}", status, self.rank, self.world_size,
                          GRACE if failed else self.timeout + GRACE)
        if statuses is None:  # a peer is stuck in the learner's code: the grader kills it
            self.events.write(event="abandon", key=key, case=index)
            os._exit(1)
        if skippable and all(s == "returned" for s in statuses):
            decided = f"{key}/{index}/skip"
            if self.rank == 0:
                self.store.set(decided, "1" if (self.dir / f"skip-{key}").exists() else "0")
            self.store.wait([decided], datetime.timedelta(seconds=self.timeout))
            if self.store.get(decided) == b"1":
                return ["skip"]
        return statuses

    def task(self, task: dict, baseline: tamper.Snapshot,
             replaced: Callable[[tamper.Snapshot], list[str]]) -> bool:
        """Grade one task on this rank; False when the process is no longer fit to go on."""
        key, ex, learner_file = task["key"], EXERCISES[task["exercise"]], task["learner"]
        group = dist.new_group() if ex.distributed else None  # its stray messages stay there
        self.events.write(event="begin", key=key, case="import", label="importing your file")
        _limit(self.limits)
        module = self.load(learner_file)
        outcome: dict[str, Any] = {"status": "returned"}
        if isinstance(module, dict):
            outcome = module
        elif not hasattr(module, ex.function):
            outcome = {"status": "missing"}
        elif uses := self.uses_reference(module, ex, learner_file):
            outcome = {"status": "uses the reference", "message": uses}
        self.events.write(event="end", key=key, case="import", **outcome)
        if any(s != "returned" for s in self.agree(key, "import", outcome["status"])):
            return outcome["status"] != "tampered"
        fn = getattr(module, ex.function)
        cases = ex.cases(self.world_size) if ex.distributed else ex.cases()
        for index, case in enumerate(cases):
            self.events.write(event="begin", key=key, case=index, label=case.label)
            _limit(self.limits)
            try:
                found = kinds.run(ex, fn, case, self.rank, self.world_size, group,
                                  self.path("flight", key, index, suffix="jsonl"),
                                  learner_file=learner_file)
                data.save(found, self.path("got", key, index))
                outcome = {"status": "returned"}
            except BaseException as e:  # SystemExit too: the learner's code called exit()
                outcome = _raised(e, learner_file, self.limits)
            self.events.write(event="end", key=key, case=index, **outcome)
            if any(s != "returned" for s in self.agree(key, index, outcome["status"], True)):
                break
        changed = replaced(baseline) + tamper.reimported(self.hidden)
        uses = "" if changed else self.uses_reference(module, ex, learner_file)  # lazily
        status = "tampered" if changed else "uses the reference" if uses else "returned"
        self.events.write(event="done", key=key, status=status,
                          message=", ".join(changed[:5]) or uses)
        borrowed.forget_solutions(keep=[t["learner"] for t in self.tasks])
        return "tampered" not in self.agree(key, "done", status)

    def uses_reference(self, module: ModuleType, ex: Any, learner_file: str) -> str:
        """What of the reference the learner's module uses, in words ("" when nothing)."""
        found = borrowed.in_module(module, getattr(module, ex.function, None), learner_file,
                                   ex.kind, self.modules_before[learner_file])
        return "; ".join(found[:3])


def serve(workdir: str, rank: int, world_size: int) -> None:
    """Rank `rank` of a grading run: see the module docstring."""
    # A process group of its own: the grader kills it and what it starts. (A rank forked by a
    # zygote leads one already; a spawned one does not.)
    if os.getsid(0) != os.getpid():
        os.setsid()
    limits = json.loads((Path(workdir) / "tasks.json").read_text())["limits"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file"], limits["file"]))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory"], limits["memory"]))
    hosts.adopt_orphans()  # every process it starts stays its descendant, sessions included
    scratch = Path(workdir) / f"rank-{rank}"  # started in the caller's folder: leave it
    scratch.mkdir(exist_ok=True)
    os.chdir(scratch)
    os.environ["PWD"] = str(scratch)
    replaced = tamper.sealed()  # the check, as it is before any learner code runs
    run = _Run(workdir, rank, world_size)
    run.references()
    baseline = tamper.snapshot()
    for task in run.tasks:
        if not run.task(task, baseline, replaced):
            run.events.write(event="tainted")
            break
    else:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        run.events.write(event="final", cpu=usage.ru_utime + usage.ru_stime)  # for the record
    hosts.kill_descendants(os.getpid())  # nothing the learner's code started outlives it
    os._exit(0)  # no exit handlers: nothing of the learner's runs after this
