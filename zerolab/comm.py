"""Every collective zerolab issues goes through this file, with a tag, and is recorded.

A tag names the stage, the phase and the unit or bucket (`zero3/fwd/blocks.2`), so that a log of
one training step reads like the algorithm. The wrappers add nothing to the algorithm; they
record, per call (a `CommEvent`):

- `nbytes`: S, the bytes of the *full* tensor the collective is about (the all-reduced tensor,
  the reduce-scatter's input, the all-gather's output, the all-to-all's input);
- `ring_bytes`: what this rank sends under the ring algorithm, the textbook model the formulas
  use: all-reduce 2(N-1)/N·S, reduce-scatter and all-gather (N-1)/N·S; all-to-all (N-1)/N·S
  (S its input: every chunk but a rank's own leaves it, whatever the algorithm);
- `wire_bytes`: what this rank actually wrote for the call, measured by the kernel's per-process
  byte counter (zerolab.wire.written) over the call's window; None where it cannot be measured
  (NCCL, not Linux), where a notebook then shows the ring model;
- `impl`: what ran (zerolab.wire.backends): on gloo an all-gather runs as N broadcasts and a
  reduce-scatter as N-1 send/recv pairs, both at the ring figure;
- `group_ranks`: the global ranks of the group it ran in.

In a rank of zerolab.launch, every call is also written to the rank's flight recorder
(zerolab.wire.flight: the last collectives, with their tags, readable after a hang or a crash).

Usage, inside a worker:

    with zerolab.record_comm() as log:
        ...                               # training code
    log.events, log.total_ring_bytes(), log.total_wire_bytes()
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerolab import theory
from zerolab.wire import backends, flight, written

__all__ = ["CommEvent", "CommLog", "Handle", "Span", "all_gather", "all_reduce", "all_to_all",
           "barrier", "broadcast", "record_comm", "recv", "reduce_scatter", "send", "span"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass
class CommEvent:
    """One collective (or point-to-point) call on one rank."""

    op: str  # "all_reduce", "reduce_scatter", "all_gather", "broadcast", "send", "recv", ...
    tag: str  # stage/phase/unit, e.g. "zero3/fwd/blocks.2"
    nbytes: int  # S: bytes of the full tensor (see module docstring)
    ring_bytes: int = 0  # ring-algorithm bytes this rank sends: the model
    start: float = 0.0  # seconds since the log's aligned start, when the call was issued
    end: float | None = None  # when it completed (async: when waited on); None if never waited
    async_op: bool = False
    dtype: str = ""  # element type on the wire, e.g. "float32", "bfloat16"
    wire_bytes: int | None = None  # measured: bytes this rank wrote in the call's window
    wire_exact: bool = True  # False: the window overlapped others' and was shared (see Note)
    impl: str = ""  # what ran, e.g. "all_gather as 3 broadcasts (gloo)"
    group_ranks: tuple[int, ...] = ()  # global ranks of the group the call ran in


@dataclass
class Span:
    """A named stretch of compute on one rank (forward, backward, step)."""

    name: str
    start: float
    end: float


def _sum_or_none(values: list[int | None]) -> int | None:
    # A sum with a hole in it would pass for a measurement: no sum at all instead.
    return None if None in values else sum(values)


@dataclass
class CommLog:
    """What one rank issued inside one `record_comm()` block. Picklable, so workers return it."""

    rank: int
    world_size: int
    events: list[CommEvent] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    t0: float = 0.0  # perf_counter() value all times are relative to

    def select(self, tag_prefix: str = "",
               group: tuple[int, ...] | None = None) -> list[CommEvent]:
        """Events whose tag starts with `tag_prefix` (and that ran in `group`, global ranks)."""
        return [e for e in self.events if e.tag.startswith(tag_prefix)
                and (group is None or e.group_ranks == tuple(group))]

    def total_ring_bytes(self, tag_prefix: str = "",
                         group: tuple[int, ...] | None = None) -> int:
        """Ring-model bytes this rank sent, over the selected events (see `select`)."""
        return sum(e.ring_bytes for e in self.select(tag_prefix, group))


    def total_wire_bytes(self, tag_prefix: str = "",
                         group: tuple[int, ...] | None = None) -> int | None:
        """Measured bytes this rank wrote over the selected events; None if any is unmeasured."""
        return _sum_or_none([e.wire_bytes for e in self.select(tag_prefix, group)])

    def bytes_by_op(self) -> dict[str, int]:
        """ring_bytes summed per op name."""
        out: dict[str, int] = {}
        for e in self.events:
            out[e.op] = out.get(e.op, 0) + e.ring_bytes
        return out

    def wire_bytes_by_op(self) -> dict[str, int | None]:
        """wire_bytes summed per op name (None for an op with an unmeasured event)."""
        ops = dict.fromkeys(e.op for e in self.events)
        return {op: _sum_or_none([e.wire_bytes for e in self.events if e.op == op])
                for op in ops}

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


# Note: how measured bytes are given to events. The kernel counts bytes written per process and
# per thread, not per collective, so the recorder reads the counters (zerolab.wire.written) at every
# boundary it sees, each issue and each completion, and gives what was written in between to
# the events open (issued, not yet seen complete) in that interval:
#
#   - one event open: all of it, and the event stays `wire_exact`;
#   - several open (async calls overlap): split in proportion to the bytes each is expected to
#     send (ring figure x what ran, see zerolab.wire.backends), and all of them lose `wire_exact`;
#   - none open: nobody's (the process wrote something that is not a collective).
#
# Every interval is given to exactly the events open in it, so the events of a step add up to
# exactly what the process wrote while any of them was open, whatever the overlaps: per-step
# totals are exact, per-event figures are exact only for events that ran alone. A window ends
# when the recorder sees the completion (Handle.wait()), which can be later than the last byte.
#
# Other writes must stay out. gloo writes collectives from its own threads (pt_gloo_runloop and
# gloo_tcp_loop, measured), send/recv partly from the calling thread (measured: the whole of an
# isend whose receive was already posted). While the recording thread is inside a zerolab call
# (a synchronous one, or issuing or waiting for an async one), everything the process writes is
# taken (that thread cannot print meanwhile); while it is outside one with async calls open, it
# runs user code that may print or save files, so its own writes are left out (process counter
# minus its thread counter). What cannot
# be told apart: another thread of the user's that writes (a logger thread) during a window;
# bytes of a collective issued before the block began, or from another thread than the one that
# opened it; and bytes not written by the process at all (NCCL: DMA, so wire_bytes is None).
# The recorder itself only reads /proc files, which counts as reading, not writing.


@dataclass(eq=False)
class _Open:
    """An event whose wire window is open in one recording."""

    event: CommEvent
    weight: float  # bytes it is expected to send: its share of an overlap
    blocking: bool  # a synchronous call: the recording thread is inside it until it completes


@dataclass(eq=False)
class _Recording:
    """One `record_comm()` block in progress: its log, the counters' last reading, open events."""

    log: CommLog
    thread: int  # native id of the thread that opened the block: whose writes are the user's
    last: written.Written | None
    open: list[_Open] = field(default_factory=list)
    inside: int = 0  # > 0 while that thread is inside a zerolab call: its writes are collectives'

    def advance(self, now: written.Written | None) -> None:
        """Give what was written since the previous boundary to the events open in between."""
        last, self.last = self.last, now
        measured = [o for o in self.open if o.event.wire_bytes is not None]
        if not measured:
            return
        if last is None or now is None:  # a reading failed: this interval cannot be counted
            for o in measured:
                o.event.wire_bytes = None
            return
        written = now.process - last.process
        if not self.inside and not any(o.blocking for o in self.open):
            written -= now.thread - last.thread  # the user's prints and saves meanwhile
        for o, share in zip(measured, _split(written, [o.weight for o in measured])):
            o.event.wire_bytes += share
        if len(self.open) > 1:
            for o in self.open:
                o.event.wire_exact = False


def _split(total: int, weights: list[float]) -> list[int]:
    """`total` as whole shares in proportion to `weights` (equal if all are 0), summing to it."""
    if sum(weights) == 0:
        weights = [1.0] * len(weights)
    # Round the running totals, not each share: the shares then add up to `total` exactly.
    bounds = [round(total * c / sum(weights)) for c in itertools.accumulate(weights)]
    return [b - a for a, b in zip([0, *bounds], bounds)]


# Note: `record_comm()` must see collectives issued deep inside the engines without every
# function taking a log argument, the same way torch.profiler sees every kernel. The recordings
# in progress are this module's one piece of state; nothing else in zerolab keeps globals.
_active: list[_Recording] = []


@contextlib.contextmanager
def _inside_zerolab() -> Iterator[None]:
    """The calling thread is in zerolab's code (issuing a collective, or waiting for one): what
    it writes meanwhile belongs to the collectives, not to the user (see the Note above)."""
    mine = [rec for rec in _active if rec.thread == threading.get_native_id()]
    _boundary(_active)  # the interval before: the user's code, its writes left out
    for rec in mine:
        rec.inside += 1
    try:
        yield
    finally:
        _boundary(_active)
        for rec in mine:
            rec.inside -= 1


def _boundary(recordings: list[_Recording]) -> None:
    """Read the counters (once per recording thread) and close the interval ending now."""
    readings: dict[int, written.Written | None] = {}
    for rec in recordings:
        if rec.thread not in readings:
            readings[rec.thread] = written.read(rec.thread)
        rec.advance(readings[rec.thread])


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    if not dist.is_initialized():
        return (0,)
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


@contextlib.contextmanager
def record_comm(group: dist.ProcessGroup | None = None, align: bool = True) -> Iterator[CommLog]:
    """Record every collective zerolab issues on this rank inside the block.

    align=True puts a barrier at entry, so every rank's clock starts at the same moment (to within
    the barrier's exit skew: microseconds on one machine). Every rank must then enter the block.
    An async call still open when the block ends keeps the bytes written until then, and is
    marked not `wire_exact`.
    """
    rank, world_size = _rank_and_size(group)
    if align and world_size > 1:
        dist.barrier(group)
    thread = threading.get_native_id()
    rec = _Recording(CommLog(rank=rank, world_size=world_size, t0=time.perf_counter()),
                     thread, written.read(thread))
    _active.append(rec)
    try:
        yield rec.log
    finally:
        _boundary([rec])
        for o in rec.open:
            o.event.wire_exact = False  # its window was cut here
        rec.open.clear()
        _active.remove(rec)


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """Mark a compute span (forward, backward, step) in every active log."""
    logs = [rec.log for rec in _active]
    starts = [log.now() for log in logs]
    try:
        yield
    finally:
        for log, start in zip(logs, starts):
            log.spans.append(Span(name, start, log.now()))


class Handle:
    """What a zerolab collective returns: `wait()` blocks until done (a no-op when synchronous)."""

    def __init__(self, work, finish: Callable[[], None], flown: int = -1):
        self._work = work  # torch's Work (or backends' stand-in); None: already complete
        self._finish = finish
        self._flown = flown  # its entry in the flight recorder (-1: none)
        if work is None:
            finish()

    def wait(self) -> None:
        if self._work is not None:
            with _inside_zerolab(), flight.calling(self._flown, blocking=True):
                self._work.wait()
                self._work = None
                self._finish()


def _open_events(op: str, tag: str, tensor: torch.Tensor | None, group, async_op: bool,
                 plan: backends.Plan, src: int,
                 sent: int | None = None) -> list[tuple[_Recording, _Open]]:
    """At issue: open one event in every active log (inside `_inside_zerolab`, whose first
    boundary has just closed the interval before the issue)."""
    if not _active:
        return []
    nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
    dtype = "" if tensor is None else str(tensor.dtype).removeprefix("torch.")
    rank, world_size = _rank_and_size(group)
    ring = theory.rank_sent_bytes(op, nbytes, world_size, rank, src) if sent is None else sent
    wire_start = 0 if backends.writes_through_os(group) else None
    ranks = _group_ranks(group)
    opened = []
    for rec in _active:
        event = CommEvent(op, tag, nbytes, ring, rec.log.now(), None, async_op, dtype,
                          wire_bytes=wire_start, impl=plan.impl, group_ranks=ranks)
        rec.log.events.append(event)
        entry = _Open(event, weight=ring * plan.ring_factor, blocking=not async_op)
        rec.open.append(entry)
        opened.append((rec, entry))
    return opened


def _close_events(opened: list[tuple[_Recording, _Open]]) -> None:
    """At completion: close the interval that ends now, and the events' windows."""
    _boundary(_active)
    for rec, entry in opened:
        entry.event.end = rec.log.now()
        if entry in rec.open:  # not when its block has ended since (its window was cut there)
            rec.open.remove(entry)


def _issue(op: str, tag: str, tensor: torch.Tensor | None, group, async_op: bool,
           plan: backends.Plan, then: Callable[[], object] | None = None, src: int = 0,
           peer: int = -1, reduce_op: str = "", sent: int | None = None) -> Handle:
    # The flight recorder's entry: a numbered collective, or a send/recv to or from `peer`,
    # with what the ranks must agree on (the reduce op as the caller named it: "avg" too).
    flown = flight.issue(op, tag, tensor, group, async_op, peer=src if op == "broadcast" else peer,
                         kind=flight.P2P if peer >= 0 else flight.COLLECTIVE,
                         reduce_op=reduce_op, comparable=sent is None)
    with _inside_zerolab(), flight.calling(flown, blocking=not async_op):
        opened = _open_events(op, tag, tensor, group, async_op, plan, src, sent)
        work = plan.call()

    def finish() -> None:
        if then is not None:
            then()
        if opened:
            _close_events(opened)
        flight.complete(flown)

    # A synchronous call has completed when it returns: its Handle is done at once.
    return Handle(work if async_op else None, finish, flown)


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
    plan = backends.native("all_reduce", group, lambda: dist.all_reduce(
        tensor, op=red, group=group, async_op=async_op))
    return _issue("all_reduce", tag, tensor, group, async_op, plan,
                  _average_after(tensor, op, group), reduce_op=op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, tag: str, op: str = "sum",
                   group: dist.ProcessGroup | None = None, async_op: bool = False,
                   scratch_input: bool = False) -> Handle:
    """input: (world_size * k,) on every rank; output: (k,), rank r's chunk of the reduction.

    gloo has no reduce-scatter of its own: zerolab sends chunk j of `input` straight to rank j
    and adds the chunks it receives to its own (zerolab.wire.backends); `output` may be this rank's
    own chunk of `input` (reduced in place). The event's wire_bytes are then the ring figure.
    A MAX or MIN reduce-scatter all-reduces instead, in place when the caller says it will not
    read `input` again (scratch_input=True), else on a copy.
    """
    red = _OPS["sum" if op == "avg" else op]
    plan = backends.reduce_scatter(output, input, red, group, async_op, scratch_input)
    return _issue("reduce_scatter", tag, input, group, async_op, plan,
                  _average_after(output, op, group), reduce_op=op)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, tag: str,
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle:
    """input: (k,) on every rank; output: (world_size * k,), the inputs in rank order.

    On gloo this runs as N broadcasts (zerolab.wire.backends, faster than torch's gloo all-gather);
    the event records one all-gather, whose measured bytes are the ring figure's.
    """
    plan = backends.all_gather(output, input, group, async_op)
    return _issue("all_gather", tag, output, group, async_op, plan)


def all_to_all(output: torch.Tensor, input: torch.Tensor, *, tag: str,
               group: dist.ProcessGroup | None = None, async_op: bool = False,
               output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> Handle:
    """input, output: (world_size, ...) or (world_size * k,), the same size on every rank: chunk
    j of this rank's input lands in chunk r of rank j's output (r: this rank). An all-gather
    sends every rank the same chunk; an all-to-all sends each rank its own one.

    S (nbytes) is the input's bytes; each rank sends every chunk but its own: (N-1)/N·S.
    With split sizes (1-D tensors, chunks of uneven lengths, torch's all_to_all_single): chunk
    j of input is input_split_sizes[j] elements, chunk i of output output_split_sizes[i]; the
    event's ring_bytes are then exactly the bytes of the chunks that leave this rank.
    """
    sent = None
    if input_split_sizes is not None:
        rank = _rank_and_size(group)[0]
        sent = (sum(input_split_sizes) - input_split_sizes[rank]) * input.element_size()
    plan = backends.all_to_all(output, input, group, async_op, output_split_sizes,
                               input_split_sizes)
    return _issue("all_to_all", tag, input, group, async_op, plan, sent=sent)


def broadcast(tensor: torch.Tensor, src: int, *, tag: str,
              group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle:
    """In place: every rank ends with rank `src`'s `tensor` (src is a global rank).

    ring_bytes models a pipelined ring (every rank but one forwards S); gloo runs a binomial
    tree instead, so its wire_bytes differ: the root sends S to each of its children.
    """
    plan = backends.native("broadcast", group, lambda: dist.broadcast(
        tensor, src, group=group, async_op=async_op))
    return _issue("broadcast", tag, tensor, group, async_op, plan, src=src)


def barrier(*, tag: str, group: dist.ProcessGroup | None = None) -> None:
    """Wait until every rank gets here (no payload: 0 ring bytes; wire_bytes shows gloo's few)."""
    _issue("barrier", tag, None, group, False,
           backends.native("barrier", group, lambda: dist.barrier(group=group)))


def send(tensor: torch.Tensor, dst: int, *, tag: str,
         group: dist.ProcessGroup | None = None) -> None:
    _issue("send", tag, tensor, group, False,
           backends.native("send", group, lambda: dist.send(tensor, dst, group=group)), peer=dst)


def recv(tensor: torch.Tensor, src: int, *, tag: str,
         group: dist.ProcessGroup | None = None) -> None:
    _issue("recv", tag, tensor, group, False,
           backends.native("recv", group, lambda: dist.recv(tensor, src, group=group)), peer=src)
