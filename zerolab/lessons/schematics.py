"""The data behind the course's schematic figures, gathered on real ranks (zerolab.plots draws).

Each function runs on every rank of a launch and returns small dataclasses, in seconds:

    runs = zerolab.launch(schematics.ring_all_reduce, world_size=4)
    plots.ring_all_reduce(schematics.ring_story(runs))

- `ring_all_reduce`: an all-reduce built from sends and receives around a ring, every message
  tagged with its phase, step and chunk; `ring_story` joins the ranks' logs into who sent
  which chunk to whom at each step, and what each chunk sums after it.
- `holdings` (zerolab.lessons.holdings): what each rank holds before and after each collective
  of one step, for DDP and ZeRO-1/2/3.
- `ddp_backward`: for one backward of DDP, when each parameter's gradient hook fired, when its
  bucket became ready, when the bucket's all-reduce was issued and waited for.
- `zero3_lifecycle`: for one step of ZeRO-3, when each unit was gathered, computed, resharded.
- `hsdp_mesh`: the ranks as nodes x shards, the groups torch made for them, and which
  collectives one HSDP step ran in which group.
- `flat_layout`: ZeRO-1's flat buckets: parameters end to end, padding, and the shard each rank
  owns, read from where its `local_shard` sits inside `flat_param`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import comm, harness
from zerolab.comm import CommLog
from zerolab.ddp import DDP
from zerolab.hsdp import HSDP
from zerolab.lessons.holdings import Holdings, holdings
from zerolab.models import GPT, MLP, GPTConfig, MLPConfig
from zerolab.parts.mesh import make_nodes
from zerolab.zero1 import ZeRO1
from zerolab.zero3 import ZeRO3

__all__ = ["Holdings", "holdings", "ring_all_reduce", "ring_story", "ddp_backward",
           "zero3_lifecycle", "hsdp_mesh", "flat_layout"]


def _batch(model, per_rank: int, seed: int) -> tuple[torch.Tensor, ...]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return harness.local_batch(model.make_batch, per_rank * world_size, seed, rank, world_size)


# ---- 1. the ring all-reduce ---------------------------------------------------------------------


@dataclass
class RingRun:
    """One rank's part of `ring_all_reduce`."""

    rank: int
    world_size: int
    log: CommLog  # every send and recv, tagged "ring/<phase>/step<s>/chunk<c>"
    values: list[list[float]]  # after each step (0: the input), each chunk's value


@dataclass(frozen=True)
class Transfer:
    """One chunk sent from one rank to another at one step (matched send and recv events)."""

    step: int  # 1 .. 2(N-1), over both phases
    phase: str  # "reduce-scatter" or "all-gather"
    chunk: int
    src: int
    dst: int


@dataclass
class RingStory:
    """The ring all-reduce on N ranks, step by step, from every rank's log and values."""

    world_size: int
    phases: list[str]  # per step 1 .. 2(N-1): "reduce-scatter" or "all-gather"
    sums: list[list[list[tuple[int, ...]]]]  # [step][rank][chunk]: ranks whose input it sums
    transfers: list[Transfer]  # in step order


PHASES = {"rs": "reduce-scatter", "ag": "all-gather"}


def _exchange(send: torch.Tensor, recv: torch.Tensor, rank: int, world_size: int,
              tags: tuple[str, str]) -> None:
    """Send to rank + 1, receive from rank - 1: even ranks send first, odd ranks receive first
    (if every rank sent first, every blocking send would wait for ever)."""
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if rank % 2 == 0:
        comm.send(send, right, tag=tags[0])
        comm.recv(recv, left, tag=tags[1])
    else:
        comm.recv(recv, left, tag=tags[1])
        comm.send(send, right, tag=tags[0])


def ring_all_reduce(chunk_numel: int = 1) -> RingRun:
    """An all-reduce of N chunks around a ring of N ranks, as reduce-scatter then all-gather.

    Rank r's input is 2^r in every element: a chunk's value then says, bit by bit, which ranks'
    inputs it sums (`contributors`). Reduce-scatter, step s = 0 .. N-2: rank r sends chunk
    (r - s - 1) mod N to rank r + 1 and adds the chunk (r - s - 2) mod N it receives to its
    own; afterwards rank r holds chunk r summed over every rank (as torch's reduce-scatter
    leaves it). All-gather, step s: rank r passes on chunk (r - s) mod N, complete, and
    receives chunk (r - s - 1) mod N. 2(N-1) steps; each rank sends 2(N-1) chunks.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.full((n * chunk_numel,), float(2 ** rank)).chunk(n))  # views
    values = [[c[0].item() for c in chunks]]
    received = torch.empty(chunk_numel)
    with comm.record_comm() as log:
        for s in range(n - 1):
            out, into = (rank - s - 1) % n, (rank - s - 2) % n
            _exchange(chunks[out], received, rank, n,
                      (f"ring/rs/step{s + 1}/chunk{out}", f"ring/rs/step{s + 1}/chunk{into}"))
            chunks[into].add_(received)
            values.append([c[0].item() for c in chunks])
        for s in range(n - 1):
            out, into = (rank - s) % n, (rank - s - 1) % n
            step = n + s
            _exchange(chunks[out], chunks[into], rank, n,
                      (f"ring/ag/step{step}/chunk{out}", f"ring/ag/step{step}/chunk{into}"))
            values.append([c[0].item() for c in chunks])
    return RingRun(rank, n, log, values)


def contributors(value: float) -> tuple[int, ...]:
    """The ranks whose inputs a chunk sums: the bits of its value (rank r put in 2^r)."""
    bits = int(value)
    if bits != value or bits < 0:
        raise ValueError(f"{value} is not a sum of distinct powers of two")
    return tuple(r for r in range(bits.bit_length()) if bits >> r & 1)


def _parse(tag: str) -> tuple[str, int, int]:
    _, phase, step, chunk = tag.split("/")  # "ring/rs/step1/chunk3"
    return PHASES[phase], int(step.removeprefix("step")), int(chunk.removeprefix("chunk"))


def ring_story(runs: list[RingRun]) -> RingStory:
    """Join the ranks' logs: each send matched with the recv of the same phase, step and chunk
    on another rank (a ring sends each chunk once per step), and each chunk's contributors."""
    runs = sorted(runs, key=lambda r: r.rank)
    n = runs[0].world_size
    sends = {_parse(e.tag): r.rank for r in runs for e in r.log.events if e.op == "send"}
    recvs = {_parse(e.tag): r.rank for r in runs for e in r.log.events if e.op == "recv"}
    if sends.keys() != recvs.keys():
        raise ValueError("the logs' sends and receives do not pair up")
    transfers = sorted((Transfer(step, phase, chunk, src, recvs[(phase, step, chunk)])
                        for (phase, step, chunk), src in sends.items()),
                       key=lambda t: (t.step, t.src))
    steps = len(runs[0].values) - 1
    phases = [next(t.phase for t in transfers if t.step == s) for s in range(1, steps + 1)]
    sums = [[[contributors(v) for v in r.values[s]] for r in runs] for s in range(steps + 1)]
    return RingStory(n, phases, sums, transfers)


# ---- 3. DDP: hook -> bucket -> all-reduce -------------------------------------------------------

DDP_MODEL = GPTConfig(n_layer=2, n_embd=32, n_head=2)  # 28 parameter tensors, 31,872 elements
DDP_BUCKET_BYTES = 32_000  # about a quarter of the model per bucket: 4 buckets


class _HookClockDDP(DDP):
    """zerolab's DDP, with a clock on its gradient hooks and its buckets (nothing else)."""

    def __init__(self, *args, **kwargs):
        self.clock: list[tuple[str, str, float]] = []  # (what, name, perf_counter seconds)
        super().__init__(*args, **kwargs)
        self._names = {p: n for n, p in self.module.named_parameters()}

    def _grad_accumulated(self, bucket, param) -> None:
        self.clock.append(("hook", self._names[param], time.perf_counter()))
        super()._grad_accumulated(bucket, param)

    def _bucket_ready(self, bucket) -> None:
        self.clock.append(("ready", bucket.name, time.perf_counter()))
        super()._bucket_ready(bucket)


@dataclass
class DDPBackward:
    """One recorded step of DDP on one rank; times in seconds since the log's start."""

    rank: int
    buckets: dict[str, list[str]]  # bucket -> its parameters' names, in the bucket's order
    hooks: dict[str, float]  # parameter -> when its post-accumulate-grad hook fired
    ready: dict[str, float]  # bucket -> when its last gradient arrived (its all-reduce issued)
    log: CommLog  # the all-reduces (start: issued; end: waited for, in step()) and the spans


def ddp_backward(config: GPTConfig = DDP_MODEL, bucket_bytes: int = DDP_BUCKET_BYTES,
                 per_rank: int = 32) -> DDPBackward:
    """One step of zerolab's DDP (after a warm-up step), with its hooks timed."""
    model = GPT(config)
    engine = _HookClockDDP(model, torch.optim.AdamW, lr=1e-3, bucket_bytes=bucket_bytes)
    harness.train_step(engine, *_batch(model, per_rank, 0))
    engine.clock.clear()
    with comm.record_comm() as log:
        harness.train_step(engine, *_batch(model, per_rank, 1))
    names = {p: n for n, p in model.named_parameters()}
    since = {(what, name): t - log.t0 for what, name, t in engine.clock}
    return DDPBackward(dist.get_rank(),
                       {b.name: [names[p] for p in b.params] for b in engine.buckets},
                       {n: t for (what, n), t in since.items() if what == "hook"},
                       {n: t for (what, n), t in since.items() if what == "ready"}, log)


# ---- 4. ZeRO-3: each unit over one step ---------------------------------------------------------

ZERO3_MODEL = GPTConfig(n_layer=3, n_embd=64, n_head=4)


class _LifecycleZeRO3(ZeRO3):
    """zerolab's ZeRO-3, with a clock on its hooks and on unshard / reshard (nothing else)."""

    def __init__(self, *args, **kwargs):
        self.clock: list[tuple[str, str, float]] = []  # (what, unit, perf_counter seconds)
        super().__init__(*args, **kwargs)

    def _tick(self, what: str, unit) -> None:
        self.clock.append((what, unit.name, time.perf_counter()))

    def unshard(self, unit, phase: str, async_op: bool = False) -> None:
        was = unit.unsharded
        super().unshard(unit, phase, async_op)
        if unit.unsharded and not was:
            self._tick("unsharded", unit)

    def reshard(self, unit) -> None:
        was = unit.unsharded
        super().reshard(unit)
        if was:
            self._tick("resharded", unit)

    def pre_forward(self, unit) -> None:
        self._tick("pre_forward", unit)
        super().pre_forward(unit)

    def post_forward(self, unit, output) -> None:
        super().post_forward(unit, output)
        self._tick("post_forward", unit)

    def pre_backward(self, unit) -> None:
        self._tick("pre_backward", unit)
        super().pre_backward(unit)

    def post_backward(self, unit) -> None:
        if unit.in_backward:  # not the clean-up call of _finish_backward on every unit
            self._tick("post_backward", unit)
        super().post_backward(unit)


@dataclass(frozen=True)
class Stretch:
    """One unit in one state from start to end (seconds since the log's start)."""

    unit: str
    state: str  # "unsharded" (full parameters held), "forward", "backward" (hook to hook)
    start: float
    end: float


@dataclass
class Zero3Lifecycle:
    """One recorded step of ZeRO-3 on one rank."""

    rank: int
    prefetch: bool
    units: list[str]  # in running order, root last
    stretches: list[Stretch]  # from the engine's hooks and its unshard / reshard
    log: CommLog  # the all-gathers ("zero3/fwd/<unit>", "zero3/bwd/<unit>"), reduce-scatters
    #               and the forward / backward / step spans


def _stretches(clock: list[tuple[str, str, float]], t0: float) -> list[Stretch]:
    """Pair each opening tick with the next closing tick of the same unit."""
    pairs = {"unsharded": ("resharded", "unsharded"), "pre_forward": ("post_forward", "forward"),
             "pre_backward": ("post_backward", "backward")}
    out, open_ = [], {}
    for what, unit, t in clock:
        if what in pairs:
            open_.setdefault((pairs[what][0], unit), (pairs[what][1], t))
        elif (key := (what, unit)) in open_:
            state, start = open_.pop(key)
            out.append(Stretch(unit, state, start - t0, t - t0))
    return sorted(out, key=lambda s: s.start)


def zero3_lifecycle(config: GPTConfig = ZERO3_MODEL, prefetch: bool = True,
                    per_rank: int = 8) -> Zero3Lifecycle:
    """One step of zerolab's ZeRO-3 (after a warm-up step), with its units' hooks timed."""
    model = GPT(config)
    engine = _LifecycleZeRO3(model, torch.optim.AdamW, lr=1e-3, prefetch=prefetch)
    harness.train_step(engine, *_batch(model, per_rank, 0))
    engine.clock.clear()
    with comm.record_comm() as log:
        harness.train_step(engine, *_batch(model, per_rank, 1))
    return Zero3Lifecycle(dist.get_rank(), prefetch, [u.name for u in engine.units],
                          _stretches(engine.clock, log.t0), log)


# ---- 5. the HSDP mesh ---------------------------------------------------------------------------


@dataclass
class Mesh:
    """This rank's groups in nodes of `shard_size` ranks, as torch reports them."""

    rank: int
    world_size: int
    shard_size: int
    node: tuple[int, ...]  # the ranks of this rank's node: its shard group
    replicas: tuple[int, ...]  # the ranks at its position in every node: its replica group
    ops: dict[tuple[int, ...], list[str]]  # group -> the collectives one HSDP step ran in it


def hsdp_mesh(shard_size: int = 2) -> Mesh:
    """make_nodes' groups on this rank, and one recorded HSDP step of a small MLP (which ops
    ran in which group, from the events' group_ranks)."""
    nodes = make_nodes(shard_size)
    model = MLP(MLPConfig(freeze_first_bias=False))
    engine = HSDP(model, torch.optim.AdamW, shard_size=shard_size, lr=1e-3)
    with comm.record_comm() as log:
        harness.train_step(engine, *_batch(model, 2, 0))
    ops: dict[tuple[int, ...], list[str]] = {}
    for e in log.events:
        if e.op not in ops.setdefault(e.group_ranks, []):
            ops[e.group_ranks].append(e.op)
    return Mesh(dist.get_rank(), dist.get_world_size(), shard_size,
                tuple(dist.get_process_group_ranks(nodes.node)),
                tuple(dist.get_process_group_ranks(nodes.across)), ops)


# ---- 6. the flat padded layout ------------------------------------------------------------------

# A model small enough to draw element by element: 21 parameters in 5 tensors. At
# bucket_bytes=36 they make three buckets (reverse order): 11 elements (1 of padding at N = 4),
# 9 (rank 3's shard is padding only) and the 1-element `gain` (ranks 1-3 own padding only).
LAYOUT_MODEL = MLPConfig(dims=(3, 3, 2), freeze_first_bias=False)
LAYOUT_BUCKET_BYTES = 36


@dataclass(frozen=True)
class FlatParam:
    name: str
    offset: int  # its first element in the bucket's flat buffer
    numel: int


@dataclass
class FlatBucket:
    """One bucket's flat layout, and where this rank's shard of it really sits."""

    name: str
    params: list[FlatParam]  # in flat order
    numel: int  # elements of its parameters
    padded_numel: int  # rounded up to a multiple of world_size
    shard: tuple[int, int]  # [start, end) of this rank's local_shard inside flat_param, read
    #                         from their storages (not from the layout's arithmetic)


@dataclass
class FlatLayoutRun:
    rank: int
    world_size: int
    stage: str  # the engine whose buckets these are: "ZeRO-1"
    buckets: list[FlatBucket]


def flat_layout(config: MLPConfig = LAYOUT_MODEL,
                bucket_bytes: int = LAYOUT_BUCKET_BYTES) -> FlatLayoutRun:
    """ZeRO-1's buckets on this rank (the same flat layout ZeRO-2 uses, and ZeRO-3 per unit)."""
    model = MLP(config)
    engine = ZeRO1(model, torch.optim.AdamW, lr=1e-3, bucket_bytes=bucket_bytes)
    names = {p: n for n, p in model.named_parameters()}
    buckets = []
    for b in engine.buckets:
        size = b.flat_param.element_size()
        # local_shard is a view into flat_param: its place is the distance between their data.
        start = (b.local_shard.data_ptr() - b.flat_param.data_ptr()) // size
        buckets.append(FlatBucket(
            b.name, [FlatParam(names[p], o, p.numel()) for p, o in zip(b.params, b.layout.offsets)],
            b.layout.numel, b.layout.padded_numel, (start, start + b.local_shard.numel())))
    return FlatLayoutRun(dist.get_rank(), dist.get_world_size(), "ZeRO-1", buckets)
