"""The collectives each rank issues, written down as they are issued, and compared across ranks.

Every rank must issue the same collectives, with the same sizes, in the same order: otherwise
gloo aborts the process (sizes differ) or pairs up the wrong tensors (the values differ), or a
rank waits forever. A rank that aborts cannot say what it was doing, so in the learner's
process `streamed(log, path)` makes a zerolab.comm log write each call to a file the moment it
is issued (a flight recorder). The grader's process then reads every rank's file and
`first_difference` says where the ranks parted: at which call, and what each rank issued.
Sends and receives are left out of the comparison: in a ring, ranks issue them in different
orders on purpose.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from zerolab.comm import CommEvent, CommLog

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier",
               "all_to_all")


class _Streamed(list):
    """A CommLog's list of events that also appends each event to a file, as it is issued."""

    def __init__(self, path: str):
        super().__init__()
        self._file = open(path, "a", buffering=1)  # a line at a time: an abort loses none

    def append(self, event: CommEvent) -> None:
        super().append(event)
        self._file.write(json.dumps({"op": event.op, "tag": event.tag, "nbytes": event.nbytes,
                                     "dtype": event.dtype}) + "\n")

    def close(self) -> None:
        self._file.close()


def streamed(log: CommLog, path: str) -> _Streamed:
    """Make `log` (of an open record_comm block) write each new call to `path`; close it
    after the block."""
    events = _Streamed(path)
    events.extend(log.events)
    log.events = events
    return events


def _call(line: str) -> dict | None:
    """A line as `streamed` writes it, or None (cut by the process's end, or not ours: a
    learner's code can write into its own process's files)."""
    try:
        call = json.loads(line)
    except ValueError:
        return None
    fields = {"op": str, "tag": str, "nbytes": int, "dtype": (str, type(None))}
    ok = isinstance(call, dict) and set(call) == set(fields) and all(
        isinstance(call[k], t) and type(call[k]) is not bool for k, t in fields.items())
    return call if ok else None


def read(path: str) -> list[dict]:
    """The calls a rank issued, from its file (none if it wrote none), up to the first line
    that is not one `streamed` writes."""
    if not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        out = []
        for line in f:
            call = _call(line)
            if call is None:
                break
            out.append(call)
        return out


@dataclass(frozen=True)
class Difference:
    """Where the ranks' collectives part: the call's index, and what each rank issued there
    (None: the rank issued fewer calls)."""

    index: int
    calls: list[dict | None]  # by rank

    def describe(self) -> str:
        def one(rank: int, call: dict | None) -> str:
            if call is None:
                return f"rank {rank} nothing more"
            return (f"rank {rank} {call['op']} of {call['nbytes']:,} bytes "
                    f"({call['dtype']}, tag '{call['tag']}')")
        return (f"The ranks' collectives differ at call {self.index + 1}: "
                + "; ".join(one(r, c) for r, c in enumerate(self.calls)))

    @property
    def tags_differ(self) -> bool:
        """The ranks were at different tensors there (another name), not just other sizes."""
        return len({c["tag"] for c in self.calls if c is not None}) > 1


def collectives(calls: list[dict]) -> list[dict]:
    return [c for c in calls if c["op"] in COLLECTIVES]


def first_difference(per_rank: list[list[dict]], finished: bool) -> Difference | None:
    """The first collective whose op or size differs between ranks. finished: every rank's
    list is complete (else a shorter list is no difference: that rank may have died first)."""
    seqs = [collectives(calls) for calls in per_rank]
    longest = max((len(s) for s in seqs), default=0)
    for i in range(longest):
        calls = [s[i] if i < len(s) else None for s in seqs]
        if None in calls and not finished:
            return None
        keys = {None if c is None else (c["op"], c["nbytes"]) for c in calls}
        if len(keys) > 1:
            return Difference(i, calls)
    return None


def reordered(per_rank: list[list[dict]]) -> bool:
    """Every rank issued the same collectives (op, size and tag), in different orders."""
    seqs = [sorted((c["op"], c["nbytes"], c["tag"]) for c in collectives(calls))
            for calls in per_rank]
    return all(s == seqs[0] for s in seqs)


def dtypes(per_rank: list[list[dict]]) -> list[str]:
    """The element types the ranks' calls moved (sends and receives included), sorted."""
    return sorted({c["dtype"] for calls in per_rank for c in calls if c["dtype"]})
