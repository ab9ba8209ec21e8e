"""Recorded logs as a Chrome/Perfetto trace: one process row per rank, compute and comm lanes.

    zerolab.wire.trace.save_chrome_trace("trace.json", [r["log"] for r in results])

then open trace.json in ui.perfetto.dev (or chrome://tracing). Each collective carries its
bytes (S, the ring model's figure, the measured one) and what ran, in the event's args.
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class CommLog(Protocol):
    """What a trace reads of a recording (zerolab.comm.CommLog): the rank, its collectives
    (CommEvent: op, tag, start, end, bytes) and its compute spans (Span: name, start, end)."""

    rank: int
    events: list[Any]
    spans: list[Any]


def rank_events(log: CommLog) -> list[dict]:
    """One rank's spans and collectives as complete ("X") events (pid = rank, microseconds)."""
    out = []
    for s in log.spans:
        out.append({"name": s.name, "cat": "compute", "ph": "X", "pid": log.rank,
                    "tid": "compute", "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
    for e in log.events:
        end = e.end if e.end is not None else e.start  # never waited on: a zero-length mark
        out.append({"name": e.tag, "cat": e.op, "ph": "X", "pid": log.rank, "tid": "comm",
                    "ts": e.start * 1e6, "dur": (end - e.start) * 1e6,
                    "args": {"op": e.op, "nbytes": e.nbytes, "ring_bytes": e.ring_bytes,
                             "wire_bytes": e.wire_bytes, "wire_exact": e.wire_exact,
                             "impl": e.impl, "group_ranks": list(e.group_ranks)}})
    return out


def chrome_trace(logs: list[CommLog]) -> dict:
    """One trace for all ranks: a "rank r" name for each process row, then its events."""
    events = []
    for log in logs:
        events.append({"name": "process_name", "ph": "M", "pid": log.rank,
                       "args": {"name": f"rank {log.rank}"}})
        events.extend(rank_events(log))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(path: str, logs: list[CommLog]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(logs), f)
