"""What each stage's engine holds, moment by moment, replayed without its tensors.

zerolab.predict runs one forward and backward of a model under FakeTensorMode (no memory);
a schedule hangs the engine's own hooks on that run and counts, in bytes, what the engine
would hold at each moment: the parameters (whole, flat and padded, or a shard and the units
gathered now), the gradient buffers and shards, the optimizer's state (AdamW's m and v, its
step counters, fp32 masters in mixed precision), and the buffers a collective is using. The
numbers come from the engine's own layouts: the buckets of ddp.py (`bucket_params`), the
units of units.py, the flat padded layouts of sharding.py.

One class per stage, each overriding the one before, as the engines do (ddp.py -> zero1.py ->
zero2.py -> zero3.py); a method here is named after the engine's hook it mirrors. Bytes are
counted for several world sizes at once (numpy vectors, one entry per world size): what
happens when does not depend on N, only how many bytes it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from zerolab.parts.nest import tensors_in
from zerolab.parts.param_groups import ParamGroups, bucket_params
from zerolab.sharding import FlatLayout
from zerolab.units import make_units

if TYPE_CHECKING:
    from zerolab.predict import Timeline

ADAM_STATES = 2  # fp32 tensors per element AdamW keeps: exp_avg, exp_avg_sq
STEP_COUNTER_BYTES = 4  # AdamW's step, one fp32 scalar per tensor it steps (a tile here)
STEP_TILE_TEMPORARIES = 2  # AdamW (single tensor): sqrt(v), then sqrt(v) / c, a tile each


class _Bucket:
    """What the schedule knows of a bucket: its parameters, its flat layout at each world
    size, how many of its gradients this backward accumulated."""

    def __init__(self, params: list[nn.Parameter], world_sizes: Sequence[int], rank: int):
        self.params, self.ready, self.rank = params, 0, rank
        self.layouts = [FlatLayout.of(params, n) for n in world_sizes]

    def each(self, f: Callable[[FlatLayout], int]) -> np.ndarray:
        return np.array([f(layout) for layout in self.layouts], dtype=np.int64)

    def padded(self) -> np.ndarray:  # elements of the whole flat buffer, padding included
        return self.each(lambda layout: layout.padded_numel)

    def shard(self) -> np.ndarray:  # elements of one rank's shard
        return self.each(lambda layout: layout.shard_numel)

    def pad(self) -> np.ndarray:  # padding elements in the whole flat buffer
        return self.each(lambda layout: layout.padded_numel - layout.numel)

    def shard_pad(self) -> np.ndarray:  # padding elements in this rank's shard
        def f(layout: FlatLayout) -> int:
            lo, hi = layout.shard_range(self.rank)
            return max(0, hi - max(lo, layout.numel))
        return self.each(f)


class Schedule:
    """DDP's: every parameter whole, a flat gradient buffer per bucket (the .grad are views of
    it, so autograd adds into them), the optimizer's state for every parameter. A stage's
    schedule overrides the hooks that differ, as its engine does."""

    def __init__(self, model: nn.Module, world_sizes: Sequence[int], rank: int, *,
                 tile_numel: int | None, mixed: bool, gloo: bool, bucket_bytes: int):
        self.model, self.rank = model, rank
        self.n = np.array(world_sizes, dtype=np.int64)
        self.tile_numel, self.mixed, self.gloo = tile_numel, mixed, gloo
        self.e = next(model.parameters()).element_size()  # bytes per parameter, gradient
        zero = np.zeros(len(self.n), dtype=np.int64)
        self.bytes: dict[str, np.ndarray] = {}  # category -> bytes held with no tensor here
        self.padding: dict[str, np.ndarray] = {}  # category -> how many of those are padding
        self.zero = zero
        self.listed: dict[int, str] = {}  # id(storage) of a live tensor -> the engine's category
        self.pending: list[tuple[str, np.ndarray]] = []  # (category, bytes) a collective holds
        self.timeline: Timeline | None = None
        self.buckets = self.make_buckets(bucket_bytes)

    def add(self, category: str, nbytes, padding=0) -> None:
        self.bytes[category] = self.bytes.get(category, self.zero) + nbytes
        self.padding[category] = self.padding.get(category, self.zero) + padding

    def make_buckets(self, bucket_bytes: int) -> list[_Bucket]:
        """ddp.py's: greedy, in reverse order, one group and one dtype per bucket."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        key = ParamGroups.of(self.model, None).key
        return [_Bucket(ps, self.n, self.rank)
                for ps in bucket_params(trainable[::-1], bucket_bytes, key)]

    # ---- at rest ----------------------------------------------------------------------------

    def hold(self) -> None:
        """What the rank holds before forward: parameters, gradient buffers, optimizer state."""
        self.add("params", sum(p.numel() for p in self.model.parameters()) * self.e)
        for b in self.buckets:
            self.hold_full_grads(b)
            for p in b.params:
                self.add_optimizer(self.zero + p.numel(), self.zero)

    def hold_full_grads(self, b: _Bucket) -> None:
        """A flat gradient buffer, padded; autograd adds into the .grad views of it, so no
        tensor of its own is made for a gradient (a zero tensor here, not counted)."""
        self.add("grads", b.padded() * self.e, b.pad() * self.e)
        for p in b.params:
            p.grad = torch.zeros_like(p)
            self.timeline.ignored.add(id(p.grad.untyped_storage()))

    def add_optimizer(self, numel: np.ndarray, pad: np.ndarray) -> None:
        """AdamW's state for a tensor of numel elements (pad of them padding), in tiles, and
        its fp32 master in mixed precision."""
        per_element = 4 * (ADAM_STATES + self.mixed)
        tiles = 1 if self.tile_numel is None else -(-numel // self.tile_numel)
        self.add("optimizer", per_element * numel + STEP_COUNTER_BYTES * tiles, per_element * pad)

    def owned(self) -> list[np.ndarray]:
        """The numel of each tensor this rank's optimizer steps."""
        return [self.zero + p.numel() for b in self.buckets for p in b.params]

    # ---- the hooks the engine has ---------------------------------------------------------------

    def install(self) -> list:
        """The engine's hooks on the fake model: gradients (and units, ZeRO-3)."""
        return [p.register_post_accumulate_grad_hook(lambda p, b=b: self.accumulated(b))
                for b in self.buckets for p in b.params]

    def accumulated(self, b: _Bucket) -> None:
        b.ready += 1
        if b.ready == len(b.params):
            b.ready = 0
            self.reduce(b)

    def reduce(self, b: _Bucket) -> None:
        """DDP: an all-reduce in place, nothing new held."""

    def wait_pending(self) -> None:
        for category, nbytes in self.pending:
            self.bytes[category] = self.bytes[category] - nbytes
        self.pending.clear()

    def hold_for_collective(self, category: str, nbytes: np.ndarray) -> None:
        self.add(category, nbytes)
        self.pending.append((category, nbytes))

    def scratch(self, rows: np.ndarray, b: _Bucket) -> None:
        """gloo's reduce-scatter (wire/backends.py): a row per peer whose chunk lands apart
        from the output; made in backward, it is an activation grad to the ledger."""
        if self.gloo:
            self.hold_for_collective(self.made_now(), np.maximum(rows, 0) * b.shard() * self.e)

    def made_now(self) -> str:
        """The ledger's row for a buffer the engine makes now and lists nowhere (yet)."""
        return "activation grads" if self.timeline.phase == "backward" else "step temporaries"

    def finish_backward(self) -> None:
        self.wait_pending()

    def step_moments(self) -> list[dict[str, np.ndarray]]:
        """What the step adds at its highest, beyond what is held after backward: the fp32
        gradients of mixed precision, all made before the optimizer runs, and AdamW's
        temporaries. AdamW (one tensor at a time) makes sqrt(v), then denom = sqrt(v) / c, a
        tile each, and keeps denom until the next tile's replaces it: at tile i, the last
        tile's denom and two of its own."""
        tiles = [self.tiles(numel) for numel in self.owned()]  # in the optimizer's order
        last, most = self.zero, self.zero
        for tile in (t for ts in tiles for t in ts):
            most = np.maximum(most, last + STEP_TILE_TEMPORARIES * tile)
            last = np.where(tile > 0, tile, last)  # a world size with fewer tiles skips one
        fp32_grads = 4 * np.sum(self.owned(), axis=0) if self.mixed and tiles else self.zero
        return [{"step temporaries": fp32_grads + 4 * most}]

    def tiles(self, numel: np.ndarray) -> list[np.ndarray]:
        """A tensor's tiles (parts/tiles.py), by numel at each world size: as many as the
        largest world size's needs, zero where another needs fewer."""
        if self.tile_numel is None:
            return [numel]
        count = int(np.max(-(-numel // self.tile_numel)))
        return [np.clip(numel - i * self.tile_numel, 0, self.tile_numel) for i in range(count)]


class ZeRO1Schedule(Schedule):
    """Flat padded parameters; the optimizer's state for this rank's shard of each bucket; a
    reduce-scatter in place (gloo: a scratch row per peer) as each bucket fills."""

    def hold(self) -> None:
        in_buckets = {p for b in self.buckets for p in b.params}
        frozen = sum(p.numel() for p in self.model.parameters() if p not in in_buckets)
        self.add("params", frozen * self.e)
        for b in self.buckets:
            self.add("params", b.padded() * self.e, b.pad() * self.e)
            self.hold_grads(b)
            self.add_optimizer(b.shard(), b.shard_pad())

    def hold_grads(self, b: _Bucket) -> None:
        self.hold_full_grads(b)

    def owned(self) -> list[np.ndarray]:
        return [b.shard() for b in self.buckets]

    def reduce(self, b: _Bucket) -> None:
        self.wait_pending()  # one bucket at a time
        self.scratch(self.n - 1, b)

    def step_moments(self) -> list[dict[str, np.ndarray]]:
        """+ after the step, each bucket's shard copied to be sent in the all-gather."""
        return super().step_moments() + [{"comm": b.shard() * self.e} for b in self.buckets]


class ZeRO2Schedule(ZeRO1Schedule):
    """No full gradient buffer: autograd's .grad until the bucket fills, then flattened into a
    padded buffer (comm) and freed, reduce-scattered into a persistent shard."""

    def hold_grads(self, b: _Bucket) -> None:
        self.add("grads", b.shard() * self.e, b.shard_pad() * self.e)

    def install(self) -> list:
        handles = [p.register_post_accumulate_grad_hook(self.list_grad)  # before the bucket's
                   for b in self.buckets for p in b.params]  # .grad is the engine's: grads
        return handles + super().install()

    def list_grad(self, p: nn.Parameter) -> None:
        self.listed[id(p.grad.untyped_storage())] = "grads"

    def reduce(self, b: _Bucket) -> None:
        self.wait_pending()
        full, made = b.padded() * self.e, self.made_now()  # flatten's buffer, `full`
        self.add(made, full)  # made by flatten's ops, listed as comm only once they are done:
        self.timeline.sample()  # then, beside every .grad of the bucket, it is the ledger's
        self.add(made, -full)  # activation grad (a temporary of backward)
        self.hold_for_collective("comm", full)
        for p in b.params:
            p.grad = None
        self.scratch(self.n - 2, b)  # its output is grad_shard itself: one row fewer


class ZeRO3Schedule(ZeRO2Schedule):
    """Parameters sharded too: each unit gathered before its forward and its backward, the next
    one prefetched, freed after; the root kept from forward to the end of backward."""

    def make_buckets(self, bucket_bytes: int) -> list[_Bucket]:
        self.units = make_units(self.model)
        self.root = self.units[-1]
        self.unit_buckets: dict[str, list[_Bucket]] = {}
        out = []
        key = ParamGroups.of(self.model, None).key
        for unit in self.units:
            runs = [run for trainable in (True, False) for run in bucket_params(
                [p for p in unit.params if p.requires_grad == trainable], 1e30, key)]
            self.unit_buckets[unit.name] = [_Bucket(run, self.n, self.rank) for run in runs]
            out += [b for b in self.unit_buckets[unit.name] if b.params[0].requires_grad]
        self.unit_of = {id(b): u for u in self.units for b in self.unit_buckets[u.name]}
        self.gathered: set[str] = set()
        self.in_backward: set[str] = set()
        self.ready: dict[str, int] = {}
        return out

    def hold(self) -> None:
        for u in self.units:
            for b in self.unit_buckets[u.name]:
                self.add("params", b.shard() * self.e, b.shard_pad() * self.e)
                if b.params[0].requires_grad:
                    self.hold_grads(b)
                    self.add_optimizer(b.shard(), b.shard_pad())

    def unshard(self, unit) -> None:
        if unit.name not in self.gathered:
            self.gathered.add(unit.name)
            for b in self.unit_buckets[unit.name]:
                self.add("params", b.padded() * self.e, b.pad() * self.e)
            self.timeline.sample()

    def reshard(self, unit) -> None:
        if unit.name in self.gathered:
            self.gathered.discard(unit.name)
            for b in self.unit_buckets[unit.name]:
                self.add("params", -b.padded() * self.e, -b.pad() * self.e)

    def neighbour(self, unit, step: int):
        order = self.units[:-1]
        if unit is self.root:
            return (order[0] if step > 0 else order[-1]) if order else None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    def install(self) -> list:
        handles = super().install()
        for unit in self.units:
            for m in unit.modules:
                handles.append(m.register_forward_pre_hook(
                    lambda m, a, u=unit: self.pre_forward(u)))
                handles.append(m.register_forward_hook(
                    lambda m, a, out, u=unit: self.post_forward(u, out)))
        return handles

    def pre_forward(self, unit) -> None:
        if unit.name in self.in_backward:
            return
        self.unshard(unit)
        if (nxt := self.neighbour(unit, +1)) is not None:
            self.unshard(nxt)  # prefetched: gathered as this one computes

    def post_forward(self, unit, out) -> None:
        if unit.name in self.in_backward:
            return
        keep = unit is self.root and any(t.requires_grad for t in tensors_in(out))
        for u in ([unit] if unit is not self.root else
                  [u for u in self.units if not (keep and u is self.root)]):
            self.reshard(u)
        for t in tensors_in(out):
            if t.requires_grad:
                t.register_hook(lambda grad, u=unit: self.pre_backward(u))

    def pre_backward(self, unit) -> None:
        self.in_backward.add(unit.name)
        self.unshard(unit)
        if (prev := self.neighbour(unit, -1)) is not None:
            self.unshard(prev)

    def reduce(self, b: _Bucket) -> None:
        super().reduce(b)
        unit = self.unit_of[id(b)]
        self.ready[unit.name] = self.ready.get(unit.name, 0) + 1
        if self.ready[unit.name] == sum(c.params[0].requires_grad
                                        for c in self.unit_buckets[unit.name]):
            self.ready[unit.name] = 0
            self.in_backward.discard(unit.name)
            self.reshard(unit)

    def finish_backward(self) -> None:
        super().finish_backward()
        for unit in self.units:
            self.in_backward.discard(unit.name)
            self.reshard(unit)

    def step_moments(self) -> list[dict[str, np.ndarray]]:
        return Schedule.step_moments(self)  # no gather after the step: forward gathers


SCHEDULES = {"DDP": Schedule, "ZeRO-1": ZeRO1Schedule, "ZeRO-2": ZeRO2Schedule,
             "ZeRO-3": ZeRO3Schedule}


