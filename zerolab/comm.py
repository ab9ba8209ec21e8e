"""Every collective zerolab issues goes through this file, with a tag.

A tag names the stage, the phase and the unit or bucket (`zero3/fwd/blocks.2`), so that a log of
one training step reads like the algorithm. The wrappers add nothing to the algorithm; they
record, per call, what was sent:

- `nbytes`: S, the bytes of the *full* tensor the collective is about (the all-reduced tensor,
  the reduce-scatter's input, the all-gather's output);
- `sent_bytes`: the bytes this rank sends under the ring algorithm, the textbook figure the
  formulas use: all-reduce 2(N-1)/N·S, reduce-scatter and all-gather (N-1)/N·S.

Backends do not always run the ring (gloo implements reduce-scatter as an all-reduce
underneath), so `sent_bytes` is the algorithmic figure, not a packet count.

Usage, inside a worker:

    with zerolab.record_comm() as log:
        ...                               # training code
    log.events, log.total_bytes()
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerolab import theory

# Note: torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single and warns on the old names; torch 2.6 only has the old ones. This is the
# one place that chooses.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class CommEvent:
    """One collective (or point-to-point) call on one rank."""

    op: str  # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", ...
    tag: str  # stage/phase/unit, e.g. "zero3/fwd/blocks.2"
    nbytes: int  # S: bytes of the full tensor (see module docstring)
    sent_bytes: int  # ring-algorithm bytes this rank sends
    start: float  # seconds since the log's aligned start, when the call was issued
    end: float | None  # when it completed (async: when waited on); None if never waited
    async_op: bool = False
    dtype: str = ""  # element type on the wire, e.g. "float32", "bfloat16"


@dataclass
class Span:
    """A named stretch of compute on one rank (forward, backward, step)."""

    name: str
    start: float
    end: float


@dataclass
class CommLog:
    """What one rank issued inside one `record_comm()` block. Picklable, so workers return it."""

    rank: int
    world_size: int
    events: list[CommEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    t0: float = 0.0  # perf_counter() value all times are relative to

    def total_bytes(self, tag_prefix: str = "") -> int:
        """Ring-algorithm bytes this rank sent, over events whose tag starts with `tag_prefix`."""
        return sum(e.sent_bytes for e in self.events if e.tag.startswith(tag_prefix))

    def bytes_by_op(self) -> dict[str, int]:
        """sent_bytes summed per op name."""
        out: dict[str, int] = {}
        for e in self.events:
            out[e.op] = out.get(e.op, 0) + e.sent_bytes
        return out

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Record a compute span: `with log.span("forward"): out = engine(x)`."""
        start = self.now()
        try:
            yield
        finally:
            self.spans.append(Span(name, start, self.now()))

    def chrome_trace_events(self) -> list[dict]:
        """This rank's events in Chrome/Perfetto trace format (pid = rank, microseconds)."""
        out = []
        for s in self.spans:
            out.append({"name": s.name, "cat": "compute", "ph": "X", "pid": self.rank,
                        "tid": "compute", "ts": s.start * 1e6, "dur": (s.end - s.start) * 1e6})
        for e in self.events:
            end = e.end if e.end is not None else e.start
            out.append({"name": e.tag, "cat": e.op, "ph": "X", "pid": self.rank, "tid": "comm",
                        "ts": e.start * 1e6, "dur": (end - e.start) * 1e6,
                        "args": {"op": e.op, "nbytes": e.nbytes, "sent_bytes": e.sent_bytes}})
        return out


def chrome_trace(logs: list[CommLog]) -> dict:
    """One Chrome/Perfetto trace (open in ui.perfetto.dev or chrome://tracing) for all ranks."""
    events = []
    for log in logs:
        events.append({"name": "process_name", "ph": "M", "pid": log.rank,
                       "args": {"name": f"rank {log.rank}"}})
        events.extend(log.chrome_trace_events())
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(path: str, logs: list[CommLog]) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(logs), f)


# Note: `record_comm()` must see collectives issued deep inside the strategies without every
# function taking a log argument, the same way torch.profiler sees every kernel. The active logs
# are this module's one piece of state; nothing else in zerolab keeps globals.
_active_logs: list[CommLog] = []


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@contextlib.contextmanager
def record_comm(group: dist.ProcessGroup | None = None, align: bool = True) -> Iterator[CommLog]:
    """Record every collective zerolab issues on this rank inside the block.

    align=True puts a barrier at entry, so every rank's clock starts at the same moment (to within
    the barrier's exit skew: microseconds on one machine). Every rank must then enter the block.
    """
    rank, world_size = _rank_and_size(group)
    if align and world_size > 1:
        dist.barrier(group)
    log = CommLog(rank=rank, world_size=world_size, t0=time.perf_counter())
    _active_logs.append(log)
    try:
        yield log
    finally:
        _active_logs.remove(log)


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Mark a compute span (forward, backward, step) in every active log."""
    logs = list(_active_logs)
    starts = [log.now() for log in logs]
    try:
        yield
    finally:
        for log, start in zip(logs, starts):
            log.spans.append(Span(name, start, log.now()))


def ring_sent_bytes(op: str, nbytes: int, world_size: int, rank: int = 0, src: int = 0) -> int:
    """Bytes one rank sends for a collective over S=nbytes under the ring algorithm."""
    n = world_size
    if n == 1:
        return 0
    if op in ("all_reduce", "reduce_scatter", "all_gather"):  # the formulas live in theory.py
        return round(theory.ring_sent_bytes(op, nbytes, n))
    if op == "broadcast":  # pipelined ring from src: every rank but the last one forwards S
        return 0 if rank == (src - 1) % n else nbytes
    if op == "send":
        return nbytes
    if op in ("recv", "barrier"):
        return 0
    raise ValueError(f"unknown op {op!r}")


class Handle:
    """What a zerolab collective returns: `wait()` blocks until done (a no-op when synchronous)."""

    def __init__(self, work, events: list[CommEvent], then: Callable[[], None] | None = None):
        self._work = work
        self._events = events
        self._then = then
        self._done = work is None
        if self._done:
            self._finish()

    def _finish(self) -> None:
        if self._then is not None:
            self._then()
        for log, event in self._events:
            event.end = log.now()

    def wait(self) -> None:
        if not self._done:
            self._work.wait()
            self._done = True
            self._finish()


def _record(op: str, tag: str, nbytes: int, group, async_op: bool, src: int,
            dtype: torch.dtype | None) -> list:
    if not _active_logs:
        return []
    rank, world_size = _rank_and_size(group)
    sent = ring_sent_bytes(op, nbytes, world_size, rank, src)
    dtype_name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    events = []
    for log in _active_logs:
        event = CommEvent(op, tag, nbytes, sent, log.now(), None, async_op, dtype_name)
        log.events.append(event)
        events.append((log, event))
    return events


def _issue(op: str, tag: str, tensor: torch.Tensor | None, group, async_op: bool, call,
           then=None, src=0):
    nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
    events = _record(op, tag, nbytes, group, async_op, src,
                     None if tensor is None else tensor.dtype)
    work = call() if dist.is_initialized() else None
    # A synchronous call has completed when it returns: its Handle is done at once.
    return Handle(work if async_op else None, events, then)


def _average_after(tensor: torch.Tensor, op: str, group) -> Callable[[], None] | None:
    # "avg" is a sum followed by a division: every backend has SUM (gloo gained AVG only lately).
    if op != "avg":
        return None
    world_size = _rank_and_size(group)[1]
    return lambda: tensor.div_(world_size)


def all_reduce(tensor: torch.Tensor, *, tag: str, op: str = "sum",
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle:
    """In place: every rank ends with the reduction (sum or avg) of everyone's `tensor`."""
    red = _OPS["sum" if op == "avg" else op]
    return _issue("all_reduce", tag, tensor, group, async_op,
                  lambda: dist.all_reduce(tensor, op=red, group=group, async_op=async_op),
                  _average_after(tensor, op, group))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, tag: str, op: str = "sum",
                   group: dist.ProcessGroup | None = None, async_op: bool = False,
                   scratch_input: bool = False) -> Handle:
    """input: (world_size * k,) on every rank; output: (k,), rank r's chunk of the reduction.

    gloo has no reduce-scatter of its own: torch's gloo backend copies `input`, all-reduces the
    copy and keeps this rank's chunk. zerolab does the same here, and skips the copy (S bytes of
    memory and a pass over them) when the caller says it will not read `input` again
    (scratch_input=True): then `input` is all-reduced in place. The event records the
    reduce-scatter and its ring figure either way: the algorithm's cost, not gloo's.
    """
    red = _OPS["sum" if op == "avg" else op]
    if not dist.is_initialized():
        output.copy_(input)

    def call():
        if _is_gloo(group):
            return _reduce_scatter_by_all_reduce(output, input, red, group, async_op,
                                                 scratch_input)
        return _reduce_scatter_single(output, input, op=red, group=group, async_op=async_op)

    return _issue("reduce_scatter", tag, input, group, async_op, call,
                  _average_after(output, op, group))


def all_gather(output: torch.Tensor, input: torch.Tensor, *, tag: str,
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle:
    """input: (k,) on every rank; output: (world_size * k,), the inputs in rank order.

    On gloo, torch's all-gather goes through a temporary flat buffer and a copy out, and takes
    several times as long as N broadcasts, rank r sending its k elements straight into chunk r
    of everyone's `output`: the same (N-1)/N * S bytes per rank. So on gloo zerolab issues
    those broadcasts; the event records one all-gather.
    """
    if not dist.is_initialized():
        output.copy_(input)

    def call():
        if _is_gloo(group):
            return _all_gather_by_broadcasts(output, input, group, async_op)
        return _all_gather_single(output, input, group=group, async_op=async_op)

    return _issue("all_gather", tag, output, group, async_op, call)


# ---- gloo: reduce-scatter and all-gather from its fast collectives -----------------------------


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


class _Works:
    """Several collectives in flight as one: wait() waits for each, then runs `then` once."""

    def __init__(self, works: list, then: Callable[[], object] | None = None):
        self._works = works
        self._then = then

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._then is not None:
            self._then()
            self._then = None
        return True


def _finish_or_return(works: _Works, async_op: bool) -> _Works | None:
    if async_op:
        return works
    works.wait()
    return None


def _reduce_scatter_by_all_reduce(output: torch.Tensor, input: torch.Tensor, red, group,
                                  async_op: bool, scratch_input: bool) -> _Works | None:
    rank, k = _rank_and_size(group)[0], output.numel()
    buffer = input if scratch_input else input.clone()
    work = dist.all_reduce(buffer, op=red, group=group, async_op=True)
    own = buffer.view(-1)[rank * k:(rank + 1) * k]
    return _finish_or_return(_Works([work], lambda: output.view(-1).copy_(own)), async_op)


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group,
                              async_op: bool) -> _Works | None:
    rank, world_size = _rank_and_size(group)
    k = input.numel()
    chunks = [output.view(-1)[r * k:(r + 1) * k] for r in range(world_size)]
    chunks[rank].copy_(input.view(-1))
    works = [dist.broadcast(chunk, r if group is None else dist.get_global_rank(group, r),
                            group=group, async_op=True)
             for r, chunk in enumerate(chunks)]
    return _finish_or_return(_Works(works), async_op)


def broadcast(tensor: torch.Tensor, src: int, *, tag: str,
              group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle:
    """In place: every rank ends with rank `src`'s `tensor` (src is a global rank)."""
    return _issue("broadcast", tag, tensor, group, async_op,
                  lambda: dist.broadcast(tensor, src, group=group, async_op=async_op), src=src)


def barrier(*, tag: str, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank gets here (no payload: recorded with 0 bytes)."""
    _issue("barrier", tag, None, group, False, lambda: dist.barrier(group=group))


def send(tensor: torch.Tensor, dst: int, *, tag: str,
         group: dist.ProcessGroup | None = None) -> None:
    _issue("send", tag, tensor, group, False,
           lambda: dist.send(tensor, dst, group=group))


def recv(tensor: torch.Tensor, src: int, *, tag: str,
         group: dist.ProcessGroup | None = None) -> None:
    _issue("recv", tag, tensor, group, False,
           lambda: dist.recv(tensor, src, group=group))
