"""ZeRO-1: shard the optimizer state.

What changes from DDP (ddp.py):
- Each bucket's parameters are moved into one flat, padded buffer (`flat_param`); the module's
  parameters become views into it. Rank r owns shard r of it (`local_shard`): a *view* into
  flat_param, not a copy, so updating the shard updates the model.
- The optimizer sees only the local shards, so Adam's two states take 8Ψ/N bytes per rank
  instead of 8Ψ. Parameters (4Ψ) and gradients (4Ψ) stay full: 8Ψ + 8Ψ/N in all.
- Each bucket's full gradient is reduce-scattered as soon as backward has produced it, as DDP
  all-reduces it (each rank receives the average of its own shard only: Ψ elements sent per
  rank in total, not the 2Ψ of all-reduce), one bucket at a time (on gloo the chunks a rank
  receives wait in scratch memory, (N-1)/N of a bucket, until added to its own); every rank
  updates its shard, and the parameters are all-gathered (Ψ): 2Ψ per step, like DDP.
- step() returns once the parameters are gathered: a torch user may read them right away
  (model.state_dict(), an EMA, a log). prefetch=True opts into overlap: the all-gathers are
  issued at the end of step() without waiting, and each module waits, in a forward pre-hook,
  only for the buckets holding its own parameters, so the gather overlaps the next forward;
  until then a parameter read outside forward is stale (model.state_dict(), load_state_dict()
  and full_state_dict() wait; anything else should call wait_params() first).
  `ZeRO1AfterBackward` runs every collective after backward (reduce-scatter in step()).
- Several backward passes before step() (accumulation without no_sync()) add up as in torch's
  DDP: the next backward into a reduce-scattered bucket first sets this rank's reduced shard
  aside and zeroes the buffer (`_first_grad`); its reduction adds the shard back.

`ZeRO1AllReduce` is the version many tutorials show: all-reduce the full gradient (2Ψ), keep your
shard of it, then all-gather the parameters (Ψ): 3Ψ, half as much again (1.5x) for the same
result.

Note: the optimizer steps on a flat shard, which is right for an elementwise one (SGD, Adam,
AdamW, ...): Adam's update of an element depends only on that element's gradient history, so
updating a slice of a flat buffer equals updating each parameter. A matrix optimizer
(Adafactor, Muon) steps each parameter whole on one rank instead (parts/whole_params.py).
Parameter groups (param_groups.py) keep each group, and each dtype, in buckets of their own: a
shard is stepped with one group's options.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerolab import comm
from zerolab.ddp import DDP, DDPOptions, GradBucket
from zerolab.memory import InFlight
from zerolab.sharding import Slot, flatten, shard, unflatten


@dataclass
class ShardedBucket(GradBucket):
    """A bucket whose parameters live in one flat buffer, of which this rank owns one shard."""

    flat_param: torch.Tensor | None = None  # (padded_numel,) all parameters, end to end
    local_shard: nn.Parameter | None = None  # (shard_numel,) this rank's part: the optimizer's
    scattered: bool = False  # flat_grad holds this rank's reduced shard, the rest is stale
    kept: torch.Tensor | None = None  # (shard_numel,) that shard, set aside while more is added


@dataclass(frozen=True)
class ZeRO1Options(DDPOptions):
    """ZeRO-1's keyword arguments: DDP's, and when to wait for the parameters' gather."""

    prefetch: bool = False  # True: gather parameters asynchronously, wait at first use


class ZeRO1(DDP):
    name = "zero1"
    shards_params = True  # engine.parameters(): this rank's shards (shell.py)
    Options = ZeRO1Options

    @property
    def prefetch(self) -> bool:  # ZeRO1Options.prefetch
        return self.options.prefetch

    def _make_buckets(self) -> list[ShardedBucket]:
        return [ShardedBucket(b.name, b.params, b.layout) for b in super()._make_buckets()]

    def _shard_model(self) -> None:
        self._start_gathers()
        for b in self.buckets:
            self._flatten_params(b)
        super()._shard_model()  # DDP's: a gradient buffer per bucket (ZeRO-2: a shard of one)

    def _start_gathers(self) -> None:
        """Nothing in flight yet: parameter gathers (bucket name -> handle; prefetch=True leaves
        them running after step()), and the buffers collectives use ("comm" in state_tensors)."""
        self._param_gathers: dict[str, comm.Handle] = {}
        self.in_flight = InFlight()

    def _flatten_params(self, b: ShardedBucket, flat: torch.Tensor | None = None) -> None:
        """Move the bucket's parameters into one flat buffer (`flat`: one built already)."""
        b.flat_param = flatten([p.detach() for p in b.params], b.layout) if flat is None else flat
        for p, view in zip(b.params, unflatten(b.flat_param, b.layout)):
            p.data = view  # the module now computes with views into flat_param
        # nn.Parameter shares storage with the view it wraps: no copy.
        b.local_shard = nn.Parameter(shard(b.flat_param, b.layout, self.rank),
                                     requires_grad=b.params[0].requires_grad)

    def _slots(self) -> list[Slot]:
        """The heart of ZeRO-1: the optimizer sees only this rank's shard of each bucket, so it
        creates Adam's m and v for shard_numel elements, not for the whole model."""
        return [Slot(b.local_shard, tuple(b.params), b.layout) for b in self.buckets]

    def _hook_modules(self) -> None:
        """Before a module runs forward, wait for the gathers of the buckets its parameters
        live in (issued at the end of the previous step, and likely done by now)."""
        bucket_of = {p: b.name for b in self.buckets for p in b.params}
        for module in self.module.modules():
            names = sorted({bucket_of[p] for p in module.parameters(recurse=False)
                            if p in bucket_of})
            if names:
                module.register_forward_pre_hook(lambda m, args, ns=names: self._wait_params(ns))
        # A parameter read outside its own module's forward is not waited for above (as with
        # FSDP2, whose modules unshard their own parameters): at the latest, when forward ends.
        self.module.register_forward_hook(lambda m, args, out: self.wait_params())

    def _reduce(self, bucket: ShardedBucket, phase: str) -> None:
        """Reduce-scatter, in place: this rank's shard of flat_grad receives the average of
        everyone's gradients for it. It stays inside flat_grad (the rest of which is now stale
        and unused), so that gradients still take 4Ψ, not 4Ψ + 4Ψ/N, and nothing is copied."""
        # One bucket at a time: on gloo the chunks sent to this rank land in scratch memory,
        # (N-1)/N of a bucket, until they are added to its own (zerolab.wire.backends).
        self._wait_pending()
        bucket.reduced = True
        own = shard(bucket.flat_grad, bucket.layout, self.rank)  # (shard_numel,) a view
        handle = comm.reduce_scatter(own, bucket.flat_grad, op="avg",
                                     tag=f"{self.name}/{phase}/{bucket.name}", group=self.group,
                                     async_op=True, scratch_input=True)  # flat_grad: overwritten
        self._pending.append((handle, lambda: self._keep_shard(bucket, own)))

    def _keep_shard(self, bucket: ShardedBucket, own: torch.Tensor) -> None:
        bucket.local_shard.grad = own  # what the optimizer reads for its shard
        if bucket.kept is not None:  # the earlier backward passes' reduced shard
            own += bucket.kept
            bucket.kept = None
        bucket.scattered = True

    def _reduce_rest(self) -> None:
        """A backward left a bucket incomplete on this rank (a parameter it did not reach, on
        some ranks only) and a forward or backward starts before step(): DDP reduces the rest
        here (ddp.py's Note); a reduce-scatter in place would be added to by a backward, so
        ZeRO-1 refuses rather than train a wrong model (measured 1.6e-2 off one process)."""
        if self._backward_syncs:  # (DDP's test: not inside no_sync())
            raise RuntimeError(
                f"{type(self).__name__}: the last backward gave no gradient to some parameters "
                "on this rank (a branch other ranks took?) and a forward or backward started "
                "before step(). ZeRO-1 cannot reduce those between passes: use every parameter "
                "on every rank (multiply an unused branch's output by 0), wrap the first "
                "backward in engine.no_sync(), or use zerolab.ZeRO2 or zerolab.DDP, which do.")

    def _first_grad(self, bucket: ShardedBucket) -> None:
        """A backward reaches a bucket already reduce-scattered (since the last zero_grad()):
        the next reduce-scatter must sum only what this backward adds, so the reduced shard
        goes aside (added back by _keep_shard) and the buffer, stale outside it, to zero."""
        super()._first_grad(bucket)
        if bucket.scattered:
            self._wait_pending()
            start, end = bucket.layout.shard_range(self.rank)
            bucket.kept = bucket.flat_grad[start:end].clone()  # (shard_numel,)
            for p, offset in zip(bucket.params, bucket.layout.offsets):
                if self._replaced(p):  # its .grad set to None by hand: nothing of it is kept
                    bucket.kept[max(offset - start, 0):max(offset + p.numel() - start, 0)] = 0
            bucket.flat_grad.zero_()
            bucket.scattered = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for b in self.buckets:
            b.scattered, b.kept = False, None

    def _after_step(self) -> None:
        """Every rank updated its own shard: all-gather the shards back into the full params,
        in the order forward needs them (the last bucket holds the first layers)."""
        self.wait_params()  # two steps without a forward between them: finish the last gathers
        for b in reversed(self.buckets):
            # The input must not alias the output buffer; a shard-sized copy avoids that.
            sent = b.local_shard.detach().clone()
            self.in_flight.add(sent)
            self._param_gathers[b.name] = comm.all_gather(
                b.flat_param, sent, tag=f"{self.name}/step/{b.name}", group=self.group,
                async_op=self.prefetch)
        if not self.prefetch:
            self.wait_params()

    def _wait_params(self, names: list[str]) -> None:
        for name in names:
            if (handle := self._param_gathers.pop(name, None)) is not None:
                handle.wait()

    def wait_params(self) -> None:
        """Return once every parameter holds its latest value (the gathers are done)."""
        self._wait_params(list(self._param_gathers))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        self.wait_params()
        return super().full_state_dict()

    def _owned_grads(self) -> list[torch.Tensor]:
        return [b.local_shard.grad for b in self.buckets]

    def _sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """Each rank owns a shard of the gradient: add up the ranks' sums of squares."""
        comm.all_reduce(local, tag=f"{self.name}/clip/norm", group=self.group)
        return local

    def state_tensors(self):
        state = super().state_tensors()
        state["params"] = [b.flat_param for b in self.buckets] + state["params"]
        state["grads"] += [b.kept for b in self.buckets if b.kept is not None]
        state["comm"] = self.in_flight.tensors()  # not model state: model_state_bytes skips it
        return state


class ZeRO1AllReduce(ZeRO1):
    """The tutorial version: all-reduce the whole gradient, keep your shard of it (3Ψ)."""

    name = "zero1_all_reduce"

    def _reduce(self, bucket: ShardedBucket, phase: str) -> None:
        DDP._reduce(self, bucket, phase)  # DDP's all-reduce of the whole bucket (2Ψ, not Ψ)
        # Every rank gets the whole averaged gradient, and uses 1/N of it.
        bucket.local_shard.grad = shard(bucket.flat_grad, bucket.layout, self.rank)


class ZeRO1AfterBackward(ZeRO1):
    """ZeRO-1 with its collectives after backward: reduce-scatter once backward is over,
    all-gather before step() returns. The same bytes as ZeRO1; nothing overlaps (notebook 03
    sets them side by side on a timeline)."""

    name = "zero1_after_backward"

    def _bucket_ready(self, bucket: ShardedBucket) -> None:
        """Nothing during backward: step() reduce-scatters every bucket."""
