"""From bytes to seconds: a link model, fitted on this machine (notebook 10).

    link = cost.fit(cost.measure(world_size=2, sizes=[1 << k for k in range(14, 25, 2)]))
    link.alpha, link.beta                             # seconds per message, seconds per byte
    link.predict("all_reduce", nbytes, world_size)    # seconds, for a tensor of S = nbytes

`measure` runs inside ranks (every rank of the job calls it under zerolab.launch): it times
all-reduce, reduce-scatter, all-gather and broadcast over a sweep of sizes, each call timed by
zerolab.comm's own record (the start and end of its CommEvent), the slowest rank's time kept,
repeated in a shuffled order and summarised by the median. `fit` is least squares over the
sweep. Algorithm and bus bandwidth follow nccl-tests (`algbw`, `busbw`).

Note: the model (Hockney's alpha-beta, the model of the ring lessons). A collective is
messages: the busiest rank sends `count` of them one after another and `nbytes` bytes in all
(zerolab.wire.messages: what runs, backend by backend). Each message costs alpha seconds (the
call, the system calls, the wake-ups: latency) and each byte beta (the copies: 1/bandwidth):

    t(op, S, N) = alpha · count(op, N) + beta · sent(op, S, N)

A ring all-reduce: alpha · 2(N-1) + beta · 2(N-1)/N · S; a reduce-scatter or an all-gather half
of each. On gloo, zerolab's reduce-scatter and all-gather send as many messages and bytes as
the ring; gloo's broadcast is a tree whose root sends ceil(log2 N) copies of S.

The fit is weighted least squares on relative errors (each size counts alike, from 16 KiB to
16 MiB), done twice: one alpha and beta shared by the three collectives the engines run, and
one pair per op. `Link.model` says which `predict` uses: the shared pair, unless the per-op
pairs predict each measured point from a fit that left it out (leave-one-out) clearly better,
so the data decide. `Link.alpha` and `Link.beta` are the shared pair either way. Broadcast
always has its own pair: a rank sends or receives, not both, so a byte costs it differently.

Timed back to back, in bursts (`measure`): on gloo a send waits until the receiver has
posted its receive (a rendezvous, gloo/transport/tcp/pair.cc), so zerolab's reduce-scatter
(sends) and all-gather (tree broadcasts) called one after another wait on the slower rank
each time, and cost more than the same call timed alone from a barrier; a step issues its
buckets back to back, and the fit should price what a step sees (`burst_bytes` caps a burst:
notebook 10 times calls of 3 MiB and more one at a time).

On one machine the "link" is the cores: every byte is copied by the sender's and the
receiver's CPU. With more ranks than cores, ranks wait for a core, and beta grows with N: fit
at the world size you predict for (notebook 10 measures by how much).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.wire.messages import OPS, Messages, messages

__all__ = ["OPS", "SHARED_OPS", "SIZES", "Fit", "Link", "Sweep", "Timing", "algbw",
           "bus_factor", "busbw", "fit", "measure", "messages"]

SHARED_OPS = ("all_reduce", "reduce_scatter", "all_gather")  # what the engines run
SIZES = tuple(1 << k for k in range(14, 25, 2))  # 16 KiB to 16 MiB, 4x apart
PER_OP_MARGIN = 0.75  # per-op fits are used when they predict left-out points 25% better


# --- bandwidth, as nccl-tests defines it (doc/PERFORMANCE.md) --------------------------------


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw: all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N, broadcast 1.

    The factor turns S/t into the bandwidth each rank's link carried under the ideal algorithm,
    comparable with the hardware's peak whatever N (nccl-tests' "bus bandwidth")."""
    n = world_size
    factors = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n,
               "all_gather": (n - 1) / n, "broadcast": 1.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    return factors[op]


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth, bytes per second: S / t, S the full tensor's bytes."""
    return nbytes / seconds


def busbw(op: str, nbytes: float, seconds: float, world_size: int) -> float:
    """Bus bandwidth, bytes per second: algbw · bus_factor(op, N)."""
    return algbw(nbytes, seconds) * bus_factor(op, world_size)


# --- measuring -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """One collective at one size, measured: the slowest rank's seconds in each repeat."""

    op: str
    nbytes: int  # S: the full tensor's bytes (fp32, a multiple of 4N)
    world_size: int
    backend: str
    seconds: tuple[float, ...]  # per repeat: the slowest rank's mean over a burst of calls
    wire_bytes: int | None  # measured: most bytes one rank wrote in a call (median of repeats)
    impl: str  # what ran (CommEvent.impl), e.g. "all_gather as 2 broadcasts (gloo)"
    calls: int = 1  # calls back to back in each repeat's burst (`seconds` is their mean)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """Interquartile range over the median: 0.1 means the middle half within 10%."""
        if len(self.seconds) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.seconds, n=4, method="inclusive")
        return (q3 - q1) / self.median

    @property
    def messages(self) -> Messages:
        """What the model says the busiest rank sends (compare `wire_bytes`)."""
        return messages(self.op, self.nbytes, self.world_size, self.backend)

    @property
    def algbw(self) -> float:
        return algbw(self.nbytes, self.median)

    @property
    def busbw(self) -> float:
        return busbw(self.op, self.nbytes, self.median, self.world_size)


@dataclass(frozen=True)
class Sweep:
    """Every timing of one `measure` call: the same on every rank."""

    world_size: int
    backend: str
    timings: tuple[Timing, ...]

    def of(self, op: str) -> list[Timing]:
        """This op's timings, smallest size first."""
        return sorted((t for t in self.timings if t.op == op), key=lambda t: t.nbytes)

    @property
    def ops(self) -> list[str]:
        return [op for op in OPS if self.of(op)]

    def only(self, nbytes: Iterable[int]) -> Sweep:
        """The timings whose S is one of `nbytes` (as measured: fp32, a multiple of 4N)."""
        keep = {_numel(s, self.world_size) * 4 for s in nbytes}
        return Sweep(self.world_size, self.backend,
                     tuple(t for t in self.timings if t.nbytes in keep))


def measure(world_size: int | None = None, sizes: Sequence[int] = SIZES,
            ops: Sequence[str] = OPS, repeats: int = 7, warmup: int = 2, burst: int = 4,
            group: dist.ProcessGroup | None = None, burst_bytes: int | None = None) -> Sweep:
    """Time each op at each size on `world_size` ranks (every rank of the job calls this).

    world_size: ranks 0..N-1 of the job form a group and are timed (default: all of them); the
    result comes back on every rank of the job. Or pass `group` instead: its ranks call this,
    and get the result. sizes: S in bytes (rounded down to fp32 elements, a multiple of N).
    repeats: timed rounds; warmup: rounds run first and dropped. Each round runs every
    (op, size) once, in a shuffled order (the same on every rank), so that a burst of load
    elsewhere hits all cases alike: `burst` calls back to back from a barrier, each on fresh
    buffers, as a step issues its buckets one after another (nccl-tests also times
    back-to-back iterations); their mean is the round's time for that case. A round ends with
    one all-reduce of its times (MAX): a collective's time is its slowest rank's.
    burst_bytes: at most this many bytes of S in one burst, at least one call (None: `burst`
    calls at every size). A burst averages out the microseconds that a small call's time
    moves by; a call of many MiB takes milliseconds, and most of a sweep's time goes into its
    largest sizes.
    """
    if not dist.is_initialized():
        raise RuntimeError("cost.measure times collectives between ranks: call it on every rank "
                           "inside zerolab.launch (or a torchrun job)")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown collectives {unknown}; expected some of {OPS}")
    if repeats < 1 or warmup < 0 or burst < 1:
        raise ValueError(f"repeats and burst must be >= 1, warmup >= 0; got {repeats}, "
                         f"{burst}, {warmup}")
    if group is not None and world_size is not None:
        raise ValueError("pass world_size or group, not both")
    share, root, inside = group, 0, True
    if group is None:
        job = dist.get_world_size()
        n = job if world_size is None else world_size
        if not 1 <= n <= job:
            raise ValueError(f"world_size={n}, but this job has {job} ranks")
        group = None if n == job else dist.new_group(list(range(n)))  # every rank must call it
        inside = dist.get_rank() < n
    else:
        root = dist.get_global_rank(group, 0)
    sweep = _sweep(group, sizes, ops, repeats, warmup, burst, burst_bytes) if inside else None
    box = [sweep]
    dist.broadcast_object_list(box, src=root, group=share)  # bookkeeping, not a lesson's traffic
    return box[0]


def _sweep(group, sizes: Sequence[int], ops: Sequence[str], repeats: int, warmup: int,
           burst: int, burst_bytes: int | None) -> Sweep:
    n, backend = dist.get_world_size(group), dist.get_backend(group)
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    root = 0 if group is None else dist.get_global_rank(group, 0)
    cases = [(op, s) for s in sizes for op in ops]
    calls = {s: burst if burst_bytes is None else max(1, min(burst, burst_bytes // s))
             for s in sizes}
    seconds: dict = {c: [] for c in cases}
    wire: dict = {c: [] for c in cases}
    impl: dict = {}
    for r in range(warmup + repeats):
        order = list(cases)
        random.Random(r).shuffle(order)  # seeded alike on every rank: the same order
        bursts = [_timed(op, s, n, calls[s], root, group, device) for op, s in order]
        times = torch.tensor([sum(e.end - e.start for e in b) / len(b) for b in bursts],
                             dtype=torch.float64)
        wrote = torch.tensor([-1 if None in (w := [e.wire_bytes for e in b])
                              else statistics.median(w) for b in bursts], dtype=torch.float64)
        both = torch.cat([times, wrote]).to(device)
        comm.all_reduce(both, op="max", tag="cost/slowest", group=group)
        both = both.cpu()
        if r < warmup:
            continue
        for i, (case, b) in enumerate(zip(order, bursts)):
            seconds[case].append(both[i].item())
            wire[case].append(both[len(order) + i].item())
            impl[case] = b[0].impl
    timings = tuple(
        Timing(op, _numel(s, n) * 4, n, backend, tuple(seconds[(op, s)]),
               None if min(wire[(op, s)]) < 0 else round(statistics.median(wire[(op, s)])),
               impl[(op, s)], calls[s])
        for op, s in cases)
    return Sweep(n, backend, timings)


def _numel(nbytes: int, n: int) -> int:
    """fp32 elements for about `nbytes`, a multiple of N (at least N)."""
    return max(n, nbytes // 4 // n * n)


def _buffers(nbytes: int, n: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """full (k·N,), shard (k,), gathered (k·N,): fp32, k·N ≈ nbytes / 4."""
    numel = _numel(nbytes, n)
    return (torch.zeros(numel, device=device), torch.zeros(numel // n, device=device),
            torch.zeros(numel, device=device))


def _timed(op: str, nbytes: int, n: int, burst: int, root: int, group,
           device: torch.device) -> list[comm.CommEvent]:
    """`burst` synchronous calls back to back, from a barrier, each on buffers of its own,
    inside one recording: their CommEvents (comm's start and end of each)."""
    buffers = [_buffers(nbytes, n, device) for _ in range(burst)]  # (full, shard, gathered)
    comm.barrier(tag="cost/start", group=group)
    tag = f"cost/{op}"
    with comm.record_comm(group, align=False) as log:
        for full, shard, gathered in buffers:
            if op == "all_reduce":
                comm.all_reduce(full, tag=tag, group=group)
            elif op == "reduce_scatter":
                comm.reduce_scatter(shard, full, tag=tag, group=group)
            elif op == "all_gather":
                comm.all_gather(gathered, shard, tag=tag, group=group)
            else:
                comm.broadcast(full, root, tag=tag, group=group)
            if device.type == "cuda":  # NCCL returns once queued: the end is when it is done
                torch.cuda.synchronize(device)
                log.events[-1].end = log.now()
    return log.events


# --- fitting ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fit:
    """alpha and beta fitted to some ops' timings, with how well they fit."""

    ops: tuple[str, ...]
    alpha: float  # seconds per message
    beta: float  # seconds per byte sent
    alpha_se: float  # standard errors (in the relative-error least squares)
    beta_se: float
    r2: float  # 1 - sum (t - t̂)² / sum (t - mean t)², on the medians themselves
    errors: tuple[float, ...]  # per point: predicted / measured - 1
    held_out: float  # RMS of the errors predicting each point from a fit without it
    held_out_errors: tuple[float, ...] = ()  # those errors, point by point

    @property
    def rms_error(self) -> float:
        """Root mean square of the relative errors: 0.1 = the fit is off by 10% typically."""
        return _rms(self.errors)

    def seconds(self, m: Messages) -> float:
        return self.alpha * m.count + self.beta * m.nbytes


def _rms(errors: Sequence[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def _solve(rows: list[tuple[float, float, float]]) -> tuple[float, float, float, float]:
    """Least squares of t ≈ a·x1 + b·x2 in relative error: minimise Σ ((t - a·x1 - b·x2)/t)².

    Dividing each row by t turns it into ordinary least squares with target 1. Returns a, b
    and their standard errors. x1 = messages, x2 = bytes: a constant x1 (one op) is its
    intercept."""
    s11 = sum((x1 / t) ** 2 for x1, _, t in rows)
    s12 = sum(x1 * x2 / t ** 2 for x1, x2, t in rows)
    s22 = sum((x2 / t) ** 2 for _, x2, t in rows)
    y1 = sum(x1 / t for x1, _, t in rows)
    y2 = sum(x2 / t for _, x2, t in rows)
    det = s11 * s22 - s12 * s12
    if det <= 1e-12 * s11 * s22:
        raise ValueError("cannot fit alpha and beta: the sizes must differ (two at least)")
    a, b = (s22 * y1 - s12 * y2) / det, (s11 * y2 - s12 * y1) / det
    dof = len(rows) - 2
    rss = sum((1 - (a * x1 + b * x2) / t) ** 2 for x1, x2, t in rows)
    var = rss / dof if dof > 0 else 0.0
    return a, b, math.sqrt(var * s22 / det), math.sqrt(var * s11 / det)


def _rows(timings: Iterable[Timing]) -> list[tuple[float, float, float]]:
    return [(t.messages.count, t.messages.nbytes, t.median) for t in timings]


def _held_out(rows: list[tuple[float, float, float]]) -> list[float]:
    """Each point predicted by a fit of the others: predicted / measured - 1."""
    out = []
    for i, (x1, x2, t) in enumerate(rows):
        a, b, _, _ = _solve(rows[:i] + rows[i + 1:])
        out.append((a * x1 + b * x2) / t - 1)
    return out


def _fit(timings: list[Timing]) -> Fit:
    rows = _rows(timings)
    a, b, a_se, b_se = _solve(rows)
    times = [t for _, _, t in rows]
    mean = sum(times) / len(times)
    ss = sum((t - mean) ** 2 for t in times) or 1.0
    r2 = 1 - sum((t - a * x1 - b * x2) ** 2 for x1, x2, t in rows) / ss
    left_out = tuple(_held_out(rows)) if len(rows) > 2 else ()
    held = _rms(left_out) if left_out else math.inf
    return Fit(tuple(dict.fromkeys(t.op for t in timings)), a, b, a_se, b_se, r2,
               tuple((a * x1 + b * x2) / t - 1 for x1, x2, t in rows), held, left_out)


@dataclass(frozen=True)
class Link:
    """The link model: seconds for a collective from its messages and bytes (see the Note)."""

    alpha: float  # seconds per message (the shared fit's, or a published figure)
    beta: float  # seconds per byte sent (1 / bandwidth)
    world_size: int  # N it was fitted at (0: not fitted, built from figures)
    backend: str  # "gloo" or "nccl": decides what runs (zerolab.wire.messages)
    shared: Fit | None = None  # the fit over SHARED_OPS: alpha and beta above
    per_op: dict[str, Fit] = field(default_factory=dict)  # a fit per measured op
    model: str = "shared"  # which predict uses for SHARED_OPS: "shared" or "per op"

    @classmethod
    def from_figures(cls, alpha: float, bandwidth: float, backend: str = "nccl") -> Link:
        """A link from published figures: alpha seconds per message, bytes per second."""
        return cls(alpha, 1 / bandwidth, 0, backend)

    @property
    def bandwidth(self) -> float:
        """1 / beta: bytes per second each rank sends at."""
        return 1 / self.beta

    @property
    def band(self) -> float:
        """The acceptance band of a prediction at a size the fit never saw: the largest miss of
        the fit `predict` uses on a point it was fitted without (leave-one-out), over the
        engines' three collectives. Measured, not chosen: an unseen size that misses by more
        is one the model does not explain as well as it explains its own points."""
        fits = ([self.shared] if self.model == "shared" else
                [self.per_op[op] for op in SHARED_OPS if op in self.per_op])
        errors = [abs(e) for f in fits if f is not None for e in f.held_out_errors]
        if not errors:
            raise ValueError("no held-out errors: a link built from figures, or fitted on two "
                             "sizes, has no band")
        return max(errors)

    def alpha_beta(self, op: str) -> tuple[float, float]:
        """The alpha and beta `predict` uses for `op`."""
        own = self.per_op.get(op)
        if own is not None and (op not in SHARED_OPS or self.model == "per op"):
            return own.alpha, own.beta
        return self.alpha, self.beta

    def predict(self, op: str, nbytes: float, world_size: int | None = None) -> float:
        """Seconds for `op` over a tensor of S = nbytes bytes on world_size ranks (default:
        the N it was fitted at): alpha · messages + beta · bytes the busiest rank sends."""
        n = world_size or self.world_size
        m = messages(op, nbytes, n, self.backend)
        alpha, beta = self.alpha_beta(op)
        return alpha * m.count + beta * m.nbytes

    def predict_events(self, events: Iterable[comm.CommEvent]) -> float:
        """Seconds for a recorded list of collectives, one after another (their sum): each
        event's op, S (`nbytes`) and group size. Barriers, sends and receives are skipped."""
        return sum(self.predict(e.op, e.nbytes, len(e.group_ranks))
                   for e in events if e.op in OPS)


def fit(sweep: Sweep) -> Link:
    """Least squares for alpha and beta (see the Note), shared and per op. `model` is "per op"
    only if the per-op fits predict the left-out points clearly better: their leave-one-out
    RMS error below PER_OP_MARGIN times the shared fit's. One pair of parameters is the
    simpler claim; with it, six extra parameters must earn their place."""
    if sweep.world_size < 2:
        raise ValueError("nothing to fit at world_size 1: one rank sends nothing")
    per_op = {op: _fit(sweep.of(op)) for op in sweep.ops if len(sweep.of(op)) >= 2}
    shared_ops = [op for op in SHARED_OPS if sweep.of(op)]
    if not shared_ops:
        raise ValueError(f"fit needs timings of at least one of {SHARED_OPS}")
    shared = _fit([t for op in shared_ops for t in sweep.of(op)])
    model = "shared"
    if all(op in per_op and len(sweep.of(op)) > 2 for op in shared_ops):
        own = [e for op in shared_ops for e in _held_out(_rows(sweep.of(op)))]
        if _rms(own) < PER_OP_MARGIN * shared.held_out:
            model = "per op"
    return Link(shared.alpha, shared.beta, sweep.world_size, sweep.backend, shared, per_op,
                model)
