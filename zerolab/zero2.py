"""ZeRO-2: shard the gradients too.

What changes from ZeRO-1 (zero1.py):
- No full gradient buffer is kept. Autograd allocates each parameter's .grad as usual; as soon
  as a bucket's last gradient is accumulated (the same post-accumulate-grad hook DDP uses), the
  bucket's gradients are flattened, reduce-scattered, this rank's averaged shard is added into a
  persistent `grad_shard`, and the full gradients are freed (`p.grad = None`).
- So a rank holds 4Ψ/N of gradients at rest (4Ψ + 12Ψ/N in all with fp32 Adam), and during
  backward only the gradients of the bucket being produced plus the one being reduced: the peak
  is about a bucket, not the whole gradient.
- One bucket is reduced at a time: before starting the next reduce-scatter we wait for the
  previous one, so its flat buffer is freed before the next is made.

`ZeRO2AfterBackward` waits until backward is over to reduce-scatter: the same bytes at rest after
the step, but at the peak every full gradient is alive at once, so it saves nothing where it
counts.
Notebook 04 measures both.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from zerolab import comm
from zerolab.ddp import DDP
from zerolab.sharding import flatten
from zerolab.zero1 import ShardedBucket, ZeRO1


@dataclass
class GradShardedBucket(ShardedBucket):
    grad_shard: torch.Tensor | None = None  # (shard_numel,) accumulated averaged gradient shard
    grad_is_zero: bool = True  # grad_shard holds zeros (zero_grad() since its last reduction)
    stepped: bool = False  # grad_shard holds what a step() used, not zeroed since


class ZeRO2(ZeRO1):
    name = "zero2"
    grads_in_buckets = False  # .grad is autograd's own between a bucket's reductions

    def _make_buckets(self) -> list[GradShardedBucket]:
        return [GradShardedBucket(b.name, b.params, b.layout) for b in super()._make_buckets()]

    def _reduce_rest(self) -> None:
        """DDP's (ddp.py's Note), which ZeRO-1 refuses: ZeRO-2's reduce-scatter reads autograd's
        .grad into the shard, so the next backward adds nothing to what it reduced."""
        DDP._reduce_rest(self)

    def _grad_buffer(self, b: GradShardedBucket) -> None:
        """No full gradient buffer (autograd allocates each .grad per backward): a persistent
        (shard_numel,) shard of one, which the optimizer reads as the shard's gradient."""
        b.grad_shard = torch.zeros_like(b.local_shard)
        b.local_shard.grad = b.grad_shard

    def _reduce(self, bucket: GradShardedBucket, phase: str) -> None:
        """Flatten the bucket's full gradients, free them, reduce-scatter into grad_shard.
        (Inside no_sync() this is not called: the full gradients stay and accumulate.)"""
        self._wait_pending()  # at most one bucket in flight: bounded memory
        bucket.reduced = True
        if bucket.stepped and not bucket.grad_is_zero:  # nothing zeroed the last step's
            warnings.warn(NOT_ZEROED.format(type(self).__name__), stacklevel=2)
        bucket.stepped = False
        # (padded_numel,) a parameter used by no one in this step contributes zeros
        full = flatten([p.grad if p.grad is not None else _zeros(shape, bucket.flat_param)
                        for p, shape in zip(bucket.params, bucket.layout.shapes)], bucket.layout)
        self.in_flight.add(full)  # "comm" in a memory trace until the reduce-scatter is done
        for p in bucket.params:
            p.grad = None  # the full gradients are freed here: only `full` is left, briefly
        # The first reduction since zero_grad() lands straight in grad_shard (0 + x is x); a
        # later one (micro-batches accumulated across backward passes) is added to it.
        received = bucket.grad_shard if bucket.grad_is_zero else torch.empty_like(
            bucket.grad_shard)  # (shard_numel,)
        if received is not bucket.grad_shard:
            self.in_flight.add(received)
        bucket.grad_is_zero = False
        handle = comm.reduce_scatter(received, full, op="avg",
                                     tag=f"{self.name}/{phase}/{bucket.name}",
                                     group=self.group, async_op=True,
                                     scratch_input=True)  # `full` is dropped once received
        self._pending.append((handle, lambda: self._accumulate(bucket, received, full)))

    def _accumulate(self, bucket: GradShardedBucket, received: torch.Tensor,
                    full: torch.Tensor) -> None:
        # `full` is passed only to keep it alive until the reduce-scatter that reads it is done.
        if received is not bucket.grad_shard:
            bucket.grad_shard += received  # += so that accumulated micro-batches add up

    def step(self) -> None:
        super().step()
        for b in self.buckets:
            b.stepped = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the shards in place (model.zero_grad() and optimizer.zero_grad() call this), and
        drop full gradients kept under no_sync()."""
        for b in self.buckets:
            b.grad_shard.zero_()
            b.grad_is_zero = True
            b.local_shard.grad = b.grad_shard  # where the optimizer reads it, whatever was done
            for p in b.params:
                p.grad = None

    def state_tensors(self):
        state = super().state_tensors()
        live_full_grads = [p.grad for b in self.buckets for p in b.params if p.grad is not None]
        state["grads"] = [b.grad_shard for b in self.buckets] + live_full_grads
        return state


class ZeRO2AfterBackward(ZeRO2):
    """Reduce-scatter only after backward: the full gradient is alive at the peak."""

    name = "zero2_after_backward"

    def _bucket_ready(self, bucket: GradShardedBucket) -> None:
        """Do nothing during backward; step() reduces every bucket afterwards."""


# Torch adds a backward's gradients to the last step's if nothing zeroed them, and so does this
# engine; it says so, because setting p.grad = None by hand (torch's performance guide) zeroes
# nothing here: between steps a ZeRO-2/3 rank holds gradient shards, not the model's .grad.
NOT_ZEROED = ("{}: this backward adds to the gradients the last step() used: nothing zeroed them "
              "since, so they add up, as in torch. Zero them with model.zero_grad(), "
              "engine.optimizer.zero_grad() or engine.zero_grad(); setting p.grad = None by hand "
              "zeroes nothing here (the gradients are sharded, no .grad holds them).")


def _zeros(shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros(shape, dtype=like.dtype, device=like.device)
