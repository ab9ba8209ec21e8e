"""The verdicts: one Result per exercise (passed / not attempted / wrong / error, with where,
what, the learner's own traceback lines, the kind of mistake when the grader recognised it,
and a hint: the one for that kind, else the exercise's general hint), and the Report `grade`
returns.

A record is what checking a case produced ({"status": ..., "label": ..., ...}, as written by
a rank); `result_from` turns it into a Result.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from zerolab.grading.defaults import DEFAULT_WORLD_SIZES
from zerolab.grading.exercise import Exercise

_NOT_PASSED = ("wrong", "uses the reference", "error")  # the verdicts shown with their reasons


@dataclass
class Result:
    """One exercise's verdict."""

    exercise: Exercise
    # "passed", "not attempted", "wrong", "uses the reference" (built on solutions/, zerolab's
    # engines or torch's: not passed) or "error" (the grader's own fault)
    status: str
    world_size: int | None = None  # distributed: on how many ranks it went wrong
    rank: int | None = None  # which rank
    case: str | None = None  # which input
    output: str | None = None  # which output differed ("result", "comm ops", "input tensor")
    message: str = ""  # what differed: expected against got; or the exception
    traceback: str = ""  # the learner's own lines of the traceback, when it raised
    hint: str = ""
    timed_out: bool = False
    mistake: str = ""  # the kind of mistake, when the grader recognised it ("" otherwise)
    printed: str = ""  # the first lines the learner's process printed, when it was stopped

    @property
    def id(self) -> str:
        return self.exercise.id

    def lines(self) -> list[str]:
        ex = self.exercise
        status = self.status.upper() if self.status in _NOT_PASSED else self.status
        head = f"  {ex.id:<4} {ex.module + '.' + ex.function:<38} {status}"
        if self.status == "not attempted" and self.message:
            head += f" ({self.message})"
        if self.status not in _NOT_PASSED:
            return [head]
        where = []
        if self.world_size is not None:
            where.append(f"on {self.world_size} rank{'s' if self.world_size > 1 else ''}")
        if self.rank is not None and self.world_size is not None:
            where.append(f"rank {self.rank}")
        if self.case:
            where.append(f"case '{self.case}'")
        out = [head]
        if where:
            out.append("       " + ", ".join(where))
        if self.output and self.output.startswith("input "):  # an argument it changed
            out += _wrapped(f"{self.output}: {self.message}")
        elif self.output:
            out += _wrapped(f"output '{self.output}': {self.message}")
        elif self.message:
            out += _wrapped(self.message)
        out += ["         " + line for line in self.traceback.rstrip().splitlines()]
        if self.printed.strip():
            out.append("       its output began:")
            out += ["         | " + line for line in self.printed.rstrip().splitlines()]
        if self.mistake:
            out += _wrapped(f"looks like: {self.mistake}")
        if self.hint:
            out += _wrapped(f"hint: {self.hint}")
        if self.status == "wrong":
            out.append(f'       more hints: hint("{ex.id}") (from zerolab.grading import hint)')
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _wrapped(text: str) -> list[str]:
    """A line of the report, indented, wrapped at 100 characters (long words kept whole)."""
    return textwrap.wrap(text, width=100, initial_indent=" " * 7, subsequent_indent=" " * 9,
                         break_long_words=False, break_on_hyphens=False) or [""]


def result_from(ex: Exercise, record: dict, timeout: float) -> Result:
    status = record["status"]
    common = {"world_size": record.get("world_size"), "case": record.get("label")}
    if record.get("world_size") is not None and "rank" in record:
        common["rank"] = record["rank"]
    if status == "stub":
        return Result(ex, "not attempted")
    if status == "timeout":
        if not ex.distributed:
            why = "an endless loop?"
        else:
            stuck = record.get("stuck")
            why = (f"rank(s) {stuck} never finished: " if stuck else "") + \
                "a rank waiting for a message no other rank sends (or an endless loop)?"
        return Result(ex, "wrong", **{**common, "rank": None}, timed_out=True, hint=ex.hint,
                      message=f"timed out after {timeout:g} s: {why}")
    known = {"hint": record.get("hint") or ex.hint, "mistake": record.get("mistake", "")}
    if status == "raised":
        return Result(ex, "wrong", **common, message=f"raised {record['message']}",
                      traceback=record.get("traceback", ""), **known)
    if status == "error":
        return Result(ex, "error", **common, message=record["message"],
                      traceback=record.get("traceback", ""))
    return Result(ex, "wrong", **common, output=record.get("output"),
                  message=record.get("message", ""), **known)


@dataclass
class Report:
    """What `grade` returns: one Result per exercise; prints (and displays) as a table."""

    results: list[Result]
    path: Path
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    counts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = {s: sum(r.status == s for r in self.results)
                       for s in ("passed", "wrong", "not attempted", "uses the reference",
                                 "error")}

    @property
    def ok(self) -> bool:
        """No exercise wrong, built on the reference or in error (not attempted is fine)."""
        return all(self.counts[s] == 0 for s in _NOT_PASSED)

    def __getitem__(self, exercise_id: str) -> Result:
        return next(r for r in self.results if r.id == exercise_id)

    def __str__(self) -> str:
        sizes = ", ".join(map(str, self.world_sizes))
        lines = [f"Grading {shown_path(self.path)}/ (distributed exercises on {sizes} ranks)"]
        for r in self.results:
            lines += r.lines()
        summary = ", ".join(f"{v} {k}" for k, v in self.counts.items()
                            if v or k in ("passed", "wrong", "not attempted"))
        lines.append(f"{len(self.results)} exercises: {summary}")
        return "\n".join(lines)

    __repr__ = __str__


def shown_path(path: Path) -> str:
    """`path` relative to the working directory when it shares the same parent tree (a notebook
    in notebooks/ shows ../exercises, not this machine's absolute path), else as it is."""
    full, here = path.resolve(), Path.cwd().resolve()
    try:
        return str(full.relative_to(here))
    except ValueError:
        pass
    if full.parent == here.parent:  # a sibling folder: exercises/ seen from notebooks/
        return os.path.join("..", full.name)
    return str(path)
