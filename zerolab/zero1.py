"""ZeRO-1: shard the optimizer state.

What changes from DDP (ddp.py):
- Each bucket's parameters are moved into one flat, padded buffer (`flat_param`); the module's
  parameters become views into it. Rank r owns shard r of it (`local_shard`): a *view* into
  flat_param, not a copy, so updating the shard updates the model.
- The optimizer sees only the local shards, so Adam's two states take 8Ψ/N bytes per rank
  instead of 8Ψ. Parameters (4Ψ) and gradients (4Ψ) stay full: 8Ψ + 8Ψ/N in all.
- After backward, each bucket's full gradient is reduce-scattered (each rank receives the
  average of its own shard only: Ψ elements sent per rank in total, not the 2Ψ of all-reduce),
  every rank updates its shard, and the parameters are all-gathered (Ψ): 2Ψ per step, like DDP.

`ZeRO1Naive` is the version many tutorials show: all-reduce the full gradient (2Ψ), keep your
shard of it, then all-gather the parameters (Ψ): 3Ψ, half as much again (1.5x) for the same
result.

Note: the optimizer steps on a flat shard, so it must be elementwise (SGD, Adam, AdamW, ...):
Adam's update of an element depends only on that element's gradient history, so updating a
slice of a flat buffer equals updating each parameter. Per-parameter optimizer options
(param groups) are not supported: one set of optimizer_kwargs applies to every parameter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerolab import comm
from zerolab.ddp import DDP, Bucket
from zerolab.sharding import Slot, flatten, shard, unflatten


@dataclass
class ShardedBucket(Bucket):
    """A bucket whose parameters live in one flat buffer, of which this rank owns one shard."""

    flat_param: torch.Tensor | None = None  # (padded_numel,) all parameters, end to end
    local_shard: nn.Parameter | None = None  # (shard_numel,) this rank's part: the optimizer's


class ZeRO1(DDP):
    name = "zero1"

    def _make_buckets(self) -> list[ShardedBucket]:
        return [ShardedBucket(b.name, b.params, b.layout) for b in super()._make_buckets()]

    def _shard_model(self) -> None:
        super()._shard_model()  # full flat gradient buffers, as in DDP
        for b in self.buckets:
            self._flatten_params(b)

    def _flatten_params(self, b: ShardedBucket) -> None:
        b.flat_param = flatten([p.detach() for p in b.params], b.layout)
        for p, view in zip(b.params, unflatten(b.flat_param, b.layout)):
            p.data = view  # the module now computes with views into flat_param
        # nn.Parameter shares storage with the view it wraps: no copy.
        b.local_shard = nn.Parameter(shard(b.flat_param, b.layout, self.rank),
                                     requires_grad=b.params[0].requires_grad)

    def _slots(self) -> list[Slot]:
        """The heart of ZeRO-1: the optimizer sees only this rank's shard of each bucket, so it
        creates Adam's m and v for shard_numel elements, not for the whole model."""
        return [Slot(b.local_shard, tuple(b.params), b.layout) for b in self.buckets]

    def _bucket_ready(self, bucket: ShardedBucket) -> None:
        """ZeRO-1 (as in the paper) reduces after backward, in step(): nothing to do yet."""

    def _reduce(self, bucket: ShardedBucket) -> None:
        """Reduce-scatter: this rank receives the average gradient of its own shard."""
        bucket.reduced = True
        grad_shard = torch.empty_like(bucket.local_shard)  # (shard_numel,)
        comm.reduce_scatter(grad_shard, bucket.flat_grad, op="avg",
                            tag=f"{self.name}/step/{bucket.name}", group=self.group,
                            scratch_input=True)  # flat_grad is overwritten just below
        # Keep it inside flat_grad (the rest of which is now stale and unused), so that
        # gradients still take 4Ψ, not 4Ψ + 4Ψ/N.
        own = shard(bucket.flat_grad, bucket.layout, self.rank)
        own.copy_(grad_shard)
        bucket.local_shard.grad = own

    def _after_step(self) -> None:
        """Every rank updated its own shard: all-gather the shards back into the full params."""
        self._all_gather_params()

    def _owned_grads(self) -> list[torch.Tensor]:
        return [b.local_shard.grad for b in self.buckets]

    def _sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """Each rank owns a shard of the gradient: add up the ranks' sums of squares."""
        comm.all_reduce(local, tag=f"{self.name}/clip/norm", group=self.group)
        return local

    def _all_gather_params(self) -> None:
        for b in self.buckets:
            # The input must not alias the output buffer; a shard-sized copy avoids that.
            comm.all_gather(b.flat_param, b.local_shard.detach().clone(),
                            tag=f"{self.name}/step/{b.name}", group=self.group)

    def state_tensors(self):
        state = super().state_tensors()
        state["params"] = [b.flat_param for b in self.buckets] + state["params"]
        return state


class ZeRO1Naive(ZeRO1):
    """The tutorial version: all-reduce the whole gradient, keep your shard of it (3Ψ)."""

    name = "zero1naive"

    def _reduce(self, bucket: ShardedBucket) -> None:
        bucket.reduced = True
        comm.all_reduce(bucket.flat_grad, op="avg", tag=f"{self.name}/step/{bucket.name}",
                        group=self.group)
        # Every rank now has the whole averaged gradient and uses 1/N of it.
        bucket.local_shard.grad = shard(bucket.flat_grad, bucket.layout, self.rank)
