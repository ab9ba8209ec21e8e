"""Who holds what, before and after each collective of one training step: the ZeRO paper's
Figure 1, read from each rank's real state.

    by_stage = zerolab.launch(holdings, world_size=4)      # [{stage: Holdings}, one per rank]
    plots.holdings_over_step([r["zero2"] for r in by_stage])

`holdings` trains a small MLP with DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (one warm-up step each), then
runs one recorded step in which every collective is followed at once by a read of what this
rank holds: which elements of the parameters, the gradients and the optimizer state it has a
tensor for, and what those elements hold (a gradient of its own rows, the average over the
ranks, the parameter before or after the update). The reads come from the engine's own
tensors (buckets' `flat_param`, `flat_grad`, `grad_shard`, `local_shard`, the parameters'
`.grad`, the optimizer's state per slot), compared with a plain copy of the model run on the
same rows; nothing is inferred from a formula.

Note: to read settled values, the engines here wait for each reduction as soon as it is issued
(`_Snapshots`), and all-gather without prefetch: the holdings are the stage's, the overlap is
not (notebooks 01, 04 and 05 measure that). DDP, ZeRO-1 and ZeRO-2 get one bucket and ZeRO-3
one unit, so that each collective covers the whole model and a rank's shard is one stretch.

Coordinates: the engine's flat buckets laid end to end, padding included (`Holdings.buckets`),
so that rank r's shard of a bucket is the r-th of its world_size equal parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm, engines, harness
from zerolab.comm import CommLog
from zerolab.ddp import DDP
from zerolab.models import MLP, MLPConfig
from zerolab.zero1 import ZeRO1
from zerolab.zero2 import ZeRO2
from zerolab.zero3 import ZeRO3

MODEL = MLPConfig(dims=(16, 32, 32, 8), freeze_first_bias=False)  # Ψ = 1,865, all trainable
LR = 1e-2  # an update large enough to tell updated values from old ones at float precision
BATCH_PER_RANK = 4  # rows per rank; each rank's rows differ, so do their gradients
CATEGORIES = ("params", "grads", "optimizer")
# What an element a rank holds can hold, per category (the figure's legend, in this order).
STATUS = {
    "params": ("before the update", "updated"),
    "grads": ("this rank's own", "averaged over the ranks", "held, empty (zeros or scratch)"),
    "optimizer": ("Adam's m and v",),
}


@dataclass(frozen=True)
class Segment:
    """A run of elements [start, end) (flat coordinates) that a rank holds, all in one status."""

    start: int
    end: int
    status: str  # one of STATUS[category]


@dataclass(frozen=True)
class BucketExtent:
    """Where one of the engine's flat buckets sits in the figure's coordinates."""

    name: str  # "bucket0", or a ZeRO-3 unit's name
    start: int  # its first element
    numel: int  # elements of its parameters
    padded_numel: int  # numel rounded up to a multiple of world_size: rank r owns the r-th part


@dataclass
class Moment:
    """What one rank holds at one moment of the step."""

    label: str  # "at rest", "after reduce_scatter zero2/bwd/bucket0", "after the optimizer step"
    held: dict[str, list[Segment]]  # category -> the segments held (nothing held: [])


@dataclass
class Holdings:
    """One stage's step, on one rank: its moments, in order."""

    stage: str  # engine key: "zero2"
    label: str  # "ZeRO-2"
    rank: int
    world_size: int
    buckets: list[BucketExtent]  # the coordinates' buckets, in the engine's order
    moments: list[Moment]  # consecutive moments that hold the same are kept once
    log: CommLog  # the recorded step's collectives


# ---- reading what a rank holds ------------------------------------------------------------------


class _Reader:
    """Reads an engine's tensors into flat coordinates, and keeps the moments of one step."""

    def __init__(self, engine: DDP):
        self.engine = engine
        self.log: CommLog | None = None  # the recorded step's log: which collectives ran
        # (total,) the reference gradients: this rank's own, their average; NaN at padding
        self.local = self.average = torch.empty(0)
        self.base = {}  # bucket name -> its first element
        self.where: dict[nn.Parameter, int] = {}  # parameter -> its first element
        start = 0
        for b in engine.buckets:
            self.base[b.name] = start
            for p, offset in zip(b.params, b.layout.offsets):
                self.where[p] = start + offset
            start += b.layout.padded_numel
        self.total = start
        self.raw: list[tuple[str, torch.Tensor, dict[str, list[Segment]]]] = []
        self._pending: tuple[torch.Tensor, dict[str, list[Segment]]] | None = None

    def flat(self, values: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
        """(total,) per-parameter tensors at their places; NaN where no parameter sits."""
        out = torch.full((self.total,), float("nan"))
        for p, v in values.items():
            out[self.where[p]:self.where[p] + v.numel()] = v.detach().reshape(-1).float()
        return out

    def _shard(self, b) -> slice:
        start, end = b.layout.shard_range(self.engine.rank)
        return slice(self.base[b.name] + start, self.base[b.name] + end)

    def _whole(self, b) -> slice:
        return slice(self.base[b.name], self.base[b.name] + b.layout.padded_numel)

    def params(self) -> torch.Tensor:
        """(total,) the parameter values this rank holds now; NaN where it holds none."""
        out = torch.full((self.total,), float("nan"))
        for b in self.engine.buckets:
            flat = getattr(b, "flat_param", None)
            if flat is None:  # DDP: the parameters themselves
                for p in b.params:
                    out[self.where[p]:self.where[p] + p.numel()] = p.detach().reshape(-1)
            elif flat.untyped_storage().nbytes() > 0:  # the whole flat buffer is alive
                out[self._whole(b)] = flat.detach()
            else:  # ZeRO-3 at rest: its own shard only
                out[self._shard(b)] = b.local_shard.detach()
        return out

    def grads(self) -> list[Segment]:
        """The gradient elements this rank holds, each the best of what holds it: a gradient
        of its own rows, else the average over the ranks, else an empty buffer."""
        code = torch.full((self.total,), len(STATUS["grads"]), dtype=torch.long)  # none held
        for where, values in self._grad_tensors():
            code[where] = torch.minimum(code[where], self._grad_code(where, values))
        return self._segments(code, STATUS["grads"])

    def _grad_tensors(self):
        for b in self.engine.buckets:
            if b.flat_grad is not None:  # DDP, ZeRO-1: the full flat gradient buffer
                yield self._whole(b), b.flat_grad.detach()
            if getattr(b, "grad_shard", None) is not None:  # ZeRO-2, ZeRO-3
                yield self._shard(b), b.grad_shard.detach()
            for p in b.params:  # full gradients autograd made (ZeRO-2/3, before their reduce)
                if p.grad is not None and b.flat_grad is None:
                    yield slice(self.where[p], self.where[p] + p.numel()), p.grad.detach()

    def _grad_code(self, where: slice, values: torch.Tensor) -> torch.Tensor:
        # Each element goes to the nearer of the two references, if it is near one at all
        # (an average summed in another order differs in the last bits): where a rank's own
        # gradient happens to lie near the average, the exact match still wins.
        values = values.reshape(-1).float()
        local, average = self.local[where], self.average[where]
        to_own, to_average = (values - local).abs(), (values - average).abs()
        own = (to_own <= 1e-4 * local.abs() + 1e-7) & (to_own <= to_average)
        averaged = ~own & (to_average <= 1e-4 * average.abs() + 1e-7)
        return torch.where(own, 0, torch.where(averaged, 1, 2))

    def optimizer(self) -> list[Segment]:
        """The elements the optimizer keeps state for on this rank (its slots with state)."""
        e = self.engine
        code = torch.full((self.total,), 1, dtype=torch.long)
        bucket_of = {b.params[0]: b for b in e.buckets}
        for slot, master in zip(e.slots, e.masters):
            if not e.tiles.state(e.optimizer, master):  # no state yet (before a first step)
                continue
            if slot.layout is None:  # the parameter, whole
                p = slot.params[0]
                code[self.where[p]:self.where[p] + p.numel()] = 0
            else:  # this rank's shard of a bucket
                code[self._shard(bucket_of[slot.params[0]])] = 0
        return self._segments(code, STATUS["optimizer"])

    def _segments(self, code: torch.Tensor, names: tuple[str, ...]) -> list[Segment]:
        """Runs of equal codes as Segments (a code past the names: not held); padding left out."""
        code = code.clone()
        code[self.local.isnan()] = len(names)
        changes = (torch.nonzero(code[1:] != code[:-1]).flatten() + 1).tolist()
        bounds = [0, *changes, self.total]
        return [Segment(a, b, names[code[a]]) for a, b in zip(bounds, bounds[1:])
                if code[a] < len(names)]

    # ---- moments ----------------------------------------------------------------------------

    def _read(self) -> tuple[torch.Tensor, dict[str, list[Segment]]]:
        return self.params(), {"grads": self.grads(), "optimizer": self.optimizer()}

    def phase(self) -> str:
        """The phase of the last collective ("fwd", "bwd", "step"), from its tag."""
        return self.log.events[-1].tag.split("/")[1] if self.log.events else "start"

    def snap(self, label: str) -> None:
        self.raw.append((label, *self._read()))

    def before(self) -> int:
        """Read now, as the moment before whatever the engine issues next."""
        self._pending = self._read()
        return len(self.log.events)

    def after(self, first_event: int) -> None:
        """If collectives were issued since `before`, keep the reads before and after them."""
        issued = self.log.events[first_event:]
        if issued:
            what = ", ".join(f"{e.op} {e.tag}" for e in issued)
            self.raw.append((f"before {what}", *self._pending))
            self.snap(f"after {what}")
        self._pending = None

    def moments(self, old: torch.Tensor, new: torch.Tensor) -> list[Moment]:
        """The reads as Moments: each parameter element before or after the update (compared
        with the full parameters before and after the step); repeats dropped."""
        out: list[Moment] = []
        for label, params, rest in self.raw:
            held = params.isnan().logical_not()
            updated = torch.isclose(params, new, rtol=1e-5, atol=1e-8)
            code = torch.where(held, torch.where(updated, 1, 0), 2)
            stale = held & ~updated & ~new.isnan()  # padding is neither
            if not torch.isclose(params[stale], old[stale], rtol=1e-5, atol=1e-8).all():
                raise RuntimeError(f"{label}: a parameter is neither its old nor its new value")
            moment = Moment(label, {"params": self._segments(code, STATUS["params"]), **rest})
            if not out or out[-1].held != moment.held:
                out.append(moment)
        labels = [m.label for m in out]
        if len(set(labels)) != len(labels):  # a figure names its panels by these
            raise RuntimeError(f"two moments of one step share a label: {labels}")
        return out


class _Snapshots:
    """Mixed into an engine: a read of what this rank holds before and after each collective.

    Each override calls the engine's own method, then waits for what it issued, so that the
    read after it sees settled values."""

    reader: _Reader | None = None  # set once the engine is built (reshard runs in __init__)

    def _reduce(self, bucket, phase: str) -> None:
        if self.reader is None:
            return super()._reduce(bucket, phase)
        first = self.reader.before()
        super()._reduce(bucket, phase)
        self._wait_pending()
        self.reader.after(first)

    def _after_step(self) -> None:
        if self.reader is None:
            return super()._after_step()
        self.reader.snap("after the optimizer step")
        first = self.reader.before()
        super()._after_step()
        self.wait_params()
        self.reader.after(first)

    def unshard(self, unit, phase: str, async_op: bool = False) -> None:
        if self.reader is None:
            return super().unshard(unit, phase, async_op)
        first = self.reader.before()
        super().unshard(unit, phase, async_op)
        self.reader.after(first)

    def reshard(self, unit) -> None:
        was_unsharded = unit.unsharded
        super().reshard(unit)
        if self.reader is not None and was_unsharded:
            self.reader.snap(f"after reshard {unit.name} ({self.reader.phase()})")


class _DDP(_Snapshots, DDP):
    pass


class _ZeRO1(_Snapshots, ZeRO1):
    pass


class _ZeRO2(_Snapshots, ZeRO2):
    pass


class _ZeRO3(_Snapshots, ZeRO3):
    # The figure's model is one unit, the root, which zerolab's ZeRO-3 (as FSDP2) keeps
    # gathered from forward to backward. Here it is resharded after forward, as every other
    # unit is, so that the picture shows the life of a unit: gather, free, gather, free.
    keeps_root = False


# One bucket (DDP, ZeRO-1, ZeRO-2: bucket_bytes past the model's) or one unit (ZeRO-3: the
# root, units=[]); no prefetch: every collective finishes before the next read.
STAGES = {"ddp": (_DDP, {"bucket_bytes": 1 << 30}),
          "zero1": (_ZeRO1, {"bucket_bytes": 1 << 30, "prefetch": False}),
          "zero2": (_ZeRO2, {"bucket_bytes": 1 << 30, "prefetch": False}),
          "zero3": (_ZeRO3, {"units": [], "prefetch": False})}


def _full_params(engine: DDP, reader: _Reader) -> torch.Tensor:
    """(total,) every parameter's full value (a collective in the sharded stages)."""
    state = engine.full_state_dict()
    return reader.flat({p: state[n] for n, p in engine.module.named_parameters()})


def stage_holdings(stage: str, config: MLPConfig = MODEL) -> Holdings:
    """One stage's recorded step on this rank (after a warm-up step): see the module docstring."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine_cls, kwargs = STAGES[stage]
    model = MLP(config)
    engine = engine_cls(model, torch.optim.AdamW, lr=LR, **kwargs)
    batch = [harness.local_batch(model.make_batch, BATCH_PER_RANK * world_size, 100 + step,
                                 rank, world_size) for step in range(2)]
    harness.train_step(engine, *batch[0])  # creates Adam's state
    engine.wait_params()

    # The reference: a plain copy of the model on this rank's rows, its gradients and their
    # average over the ranks (what every engine must hold once reduced).
    reference = MLP(config)
    reference.load_state_dict(engine.full_state_dict())
    reference.loss(reference(batch[1][0]), batch[1][1]).backward()
    grads = {p: q.grad for p, q in zip(engine.module.parameters(), reference.parameters())}
    reader = _Reader(engine)
    reader.local = reader.flat(grads)
    reader.average = reader.local.nan_to_num()
    comm.all_reduce(reader.average, op="avg", tag="holdings/reference")
    reader.average[reader.local.isnan()] = float("nan")
    old = _full_params(engine, reader)
    with comm.record_comm() as log:
        reader.log = log
        engine.reader = reader
        reader.snap("at rest")
        harness.train_step(engine, *batch[1], zero_grad=False)
        engine.reader = None
    new = _full_params(engine, reader)
    extents = [BucketExtent(b.name, reader.base[b.name], b.layout.numel, b.layout.padded_numel)
               for b in engine.buckets]
    return Holdings(stage, engines.label(stage), rank, world_size, extents,
                    reader.moments(old, new), log)


def holdings(stages: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3"),
             config: MLPConfig = MODEL) -> dict[str, Holdings]:
    """What this rank holds over one step of each stage: {stage: Holdings}. Run on N ranks:
    `zerolab.launch(holdings, world_size=4)`."""
    return {stage: stage_holdings(stage, config) for stage in stages}
