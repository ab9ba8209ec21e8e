"""DDP: the baseline every ZeRO stage improves on.

Every rank holds a full copy of the parameters, the gradients and the optimizer state (16 bytes
per parameter with fp32 Adam), runs forward and backward on its own slice of the batch, and the
ranks average their gradients so that every copy takes the same step.

The averaging happens *during* backward: parameters are grouped into buckets (in reverse order,
roughly the order backward produces their gradients), and as soon as the last gradient of a
bucket is accumulated, a post-accumulate-grad hook starts an asynchronous all-reduce of that
bucket while backward carries on with earlier layers. Each bucket's gradients live in one flat
buffer (`flat_grad`); the parameters' `.grad` are views into it, so the all-reduce needs no copy.

The stages that follow override pieces of this class:
  ZeRO-1 (zero1.py)  shards the optimizer state: reduce-scatter, update own shard, all-gather.
  ZeRO-2 (zero2.py)  also shards gradients: reduce-scatter each bucket during backward, free it.
  ZeRO-3 (zero3.py)  also shards parameters: gather each unit just before it runs, free after.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.memory import StateTensors, model_state_bytes, optimizer_tensors
from zerolab.sharding import FlatLayout

DEFAULT_BUCKET_BYTES = 1 << 20  # 1 MiB: small, so that the course's small models get buckets


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together, in one flat buffer."""

    name: str  # used in comm tags: "bucket0", or a ZeRO-3 unit's name
    params: list[nn.Parameter]  # trainable parameters, each in exactly one bucket
    layout: FlatLayout  # where each parameter sits in the flat buffers
    flat_grad: torch.Tensor | None = None  # (padded_numel,) DDP/ZeRO-1: params' .grad are views
    ready: int = 0  # parameters whose gradient is accumulated in the current backward
    reduced: bool = False  # its reduction has been issued for the current backward


class DDP:
    """Data parallel with bucketed gradient all-reduce overlapping backward.

    engine = DDP(model, torch.optim.AdamW, lr=1e-3)
    loss_fn(engine(x), y).backward(); engine.step(); engine.zero_grad()
    """

    name = "ddp"  # first part of every comm tag

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **optimizer_kwargs):
        _check_arguments(model, optimizer_cls)
        self.module = model
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.bucket_bytes = bucket_bytes
        # Reductions in flight, each with what to do once it completes (or None).
        self._pending: list[tuple[comm.Handle, Callable[[], None] | None]] = []
        self._backward_seen = False  # a gradient was accumulated since the last step
        broadcast_from_rank0(model, group, tag=f"{self.name}/init")
        self.buckets = self._make_buckets()
        self._shard_model()
        self.optimizer = optimizer_cls(self._optimizer_params(), **optimizer_kwargs)
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_accumulated, bucket))

    # ---- set-up: what each rank holds ---------------------------------------------------------

    def _trainable_params(self) -> list[nn.Parameter]:
        """Distinct trainable parameters, in reverse registration order (≈ backward order)."""
        return [p for p in reversed(list(self.module.parameters())) if p.requires_grad]

    def _make_buckets(self) -> list[Bucket]:
        """Greedy: close a bucket once it holds bucket_bytes (a parameter is never split)."""
        groups: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in self._trainable_params():
            if size >= self.bucket_bytes:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel() * p.element_size()
        return [Bucket(f"bucket{i}", ps, FlatLayout.of(ps, self.world_size))
                for i, ps in enumerate(groups)]

    def _shard_model(self) -> None:
        """DDP shards nothing. Each bucket gets a flat gradient buffer; .grad are views of it."""
        for b in self.buckets:
            p0 = b.params[0]
            b.flat_grad = torch.zeros(b.layout.padded_numel, dtype=p0.dtype, device=p0.device)
            for p, offset in zip(b.params, b.layout.offsets):
                p.grad = b.flat_grad[offset:offset + p.numel()].view_as(p)

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for b in self.buckets for p in b.params]

    # ---- backward: the hooks ------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_accumulated(self, bucket: Bucket, param: nn.Parameter) -> None:
        # Fires once per parameter per backward, after autograd has summed every use of it
        # (a tied or reused weight included) into .grad.
        self._backward_seen = True
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._bucket_ready(bucket)

    def _bucket_ready(self, bucket: Bucket) -> None:
        """The last gradient of `bucket` has arrived: start reducing it, backward goes on."""
        self._reduce(bucket)

    def _reduce(self, bucket: Bucket) -> None:
        bucket.reduced = True
        handle = comm.all_reduce(bucket.flat_grad, op="avg", tag=f"{self.name}/bwd/{bucket.name}",
                                 group=self.group, async_op=True)
        self._pending.append((handle, None))

    def _finish_backward(self) -> None:
        """Reduce what backward left unreduced (unused parameters), wait for everything."""
        if not self._backward_seen:
            raise RuntimeError(
                f"{type(self).__name__}.step() was called before backward(): no gradient has "
                "been computed since the last step. Call loss.backward() first.")
        for bucket in self.buckets:
            if not bucket.reduced:
                self._reduce(bucket)
        self._wait_pending()
        for bucket in self.buckets:
            bucket.ready, bucket.reduced = 0, False

    def _wait_pending(self) -> None:
        for handle, on_done in self._pending:
            handle.wait()
            if on_done is not None:
                on_done()
        self._pending.clear()

    # ---- the step -----------------------------------------------------------------------------

    def step(self) -> None:
        """Finish gradient synchronisation, then step the optimizer (and re-sync if needed)."""
        self._finish_backward()
        self.optimizer.step()
        self._after_step()
        self._backward_seen = False

    def _after_step(self) -> None:
        """DDP: every rank took the same step on the same averaged gradients: nothing to do."""

    def zero_grad(self) -> None:
        for b in self.buckets:
            b.flat_grad.zero_()

    # ---- what a rank holds --------------------------------------------------------------------

    def state_tensors(self) -> StateTensors:
        """The tensors this rank holds for model state now, by category (for measurement)."""
        return {
            "params": list(self.module.parameters()),
            "grads": [b.flat_grad for b in self.buckets],
            "optimizer": optimizer_tensors(self.optimizer),
        }

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes held now for params, grads and optimizer state (distinct storages)."""
        return model_state_bytes(self.state_tensors())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers, on every rank (a collective in the sharded stages)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}


def _check_arguments(model: nn.Module, optimizer_cls) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train "
                         "or to shard.")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"{type(model).__name__} has no trainable parameters "
                         "(all have requires_grad=False).")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_cls must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
            f"(the class, not an instance), got {optimizer_cls!r}")


def broadcast_from_rank0(model: nn.Module, group: dist.ProcessGroup | None, tag: str) -> None:
    """Every rank starts from rank 0's parameters and buffers (ranks may have other seeds)."""
    if not dist.is_initialized():
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            comm.broadcast(t.data, src, tag=f"{tag}/{name}", group=group)
