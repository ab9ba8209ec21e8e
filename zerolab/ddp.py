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

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.checkpoint import Piece, optimizer_piece_state
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
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 param_dtype: torch.dtype | None = None, **optimizer_kwargs):
        _check_arguments(model, optimizer_cls)
        self.module = model
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.bucket_bytes = bucket_bytes
        # Reductions in flight, each with what to do once it completes (or None).
        self._pending: list[tuple[comm.Handle, Callable[[], None] | None]] = []
        self._backward_seen = False  # a gradient was accumulated since the last step
        self._grads_synced = False  # this step's gradients are reduced (step or clipping did it)
        self._sync = True  # False inside no_sync(): gradients accumulate locally, unreduced
        broadcast_from_rank0(model, group, tag=f"{self.name}/init")
        self.param_dtype = param_dtype
        fp32_values = cast_module(model, param_dtype)  # {} unless mixed precision
        self.buckets = self._make_buckets()
        self._shard_model()
        # (tensor the optimizer should step, the parameters it covers, their layout or None)
        self._slots = self._optimizer_slots()
        self.masters = self._make_masters(fp32_values)
        self.optimizer = optimizer_cls(self.masters, **optimizer_kwargs)
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

    def _optimizer_slots(self) -> list[tuple[torch.Tensor, list[nn.Parameter], FlatLayout | None]]:
        """DDP: the optimizer steps each parameter, whole."""
        return [(p, [p], None) for b in self.buckets for p in b.params]

    def _slice(self, values: list[torch.Tensor], layout: FlatLayout | None) -> torch.Tensor:
        """This rank's part of full per-parameter `values` for one optimizer slot."""
        return values[0]  # DDP: one parameter per slot, all of it

    def _make_masters(self, fp32_values: dict) -> list[torch.Tensor]:
        """What the optimizer steps. In fp32 that is the parameters (or shards) themselves: no
        copy. With mixed precision, an fp32 master copy of each (4 bytes per element, which with
        Adam's 8 make the paper's K=12), cut from the fp32 values before the cast."""
        if not fp32_values:
            return [t for t, _, _ in self._slots]
        return [nn.Parameter(self._slice([fp32_values[p] for p in params], layout)
                             .detach().clone().view_as(t))
                for t, params, layout in self._slots]

    # ---- backward: the hooks ------------------------------------------------------------------

    def __call__(self, *args, **kwargs):
        if self.param_dtype is None:
            return self.module(*args, **kwargs)
        # Mixed precision: floating inputs in the compute dtype, floating outputs back in fp32.
        args, kwargs = _cast_floats((args, kwargs), self.param_dtype)
        return _cast_floats(self.module(*args, **kwargs), torch.float32)

    def _grad_accumulated(self, bucket: Bucket, param: nn.Parameter) -> None:
        # Fires once per parameter per backward, after autograd has summed every use of it
        # (a tied or reused weight included) into .grad.
        self._backward_seen = True
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.ready = 0  # counted afresh in the next backward (next micro-batch)
            self._bucket_ready(bucket)

    def _bucket_ready(self, bucket: Bucket) -> None:
        """The last gradient of `bucket` has arrived: start reducing it, backward goes on."""
        if self._sync:
            self._reduce(bucket)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside the block communicate nothing.

        Gradients add up locally (in DDP and ZeRO-1 in the flat gradient buffers; ZeRO-2 and
        ZeRO-3 keep full gradients between micro-batches, trading memory for traffic). The first
        backward after the block reduces the sum of all micro-batches. Scale each micro-batch's
        loss by 1/micro_batches to get the mean, as with torch's DDP.no_sync().
        """
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _reduce(self, bucket: Bucket) -> None:
        bucket.reduced = True
        handle = comm.all_reduce(bucket.flat_grad, op="avg", tag=f"{self.name}/bwd/{bucket.name}",
                                 group=self.group, async_op=True)
        self._pending.append((handle, None))

    def _finish_backward(self) -> None:
        """Reduce what backward left unreduced (unused parameters), wait for everything."""
        if not self._backward_seen:
            raise RuntimeError(
                f"{type(self).__name__}.step() (or clip_grad_norm_()) was called before "
                "backward(): no gradient has been computed since the last step. Call "
                "loss.backward() first.")
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
        self._sync_grads()
        mixed = [(m, t) for m, (t, _, _) in zip(self.masters, self._slots) if m is not t]
        for master, t in mixed:
            master.grad = t.grad.float()  # the optimizer steps in fp32
        self.optimizer.step()
        with torch.no_grad():
            for master, t in mixed:
                t.copy_(master)  # rounded back to the compute dtype
                master.grad = None
        self._after_step()
        self._backward_seen = self._grads_synced = False

    def _sync_grads(self) -> None:
        if not self._grads_synced:
            self._finish_backward()
            self._grads_synced = True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so that their global L2 norm is at most max_norm.

        Returns the global norm before clipping, as a float, on every rank (like
        torch.nn.utils.clip_grad_norm_). Call it between backward() and step().
        """
        self._sync_grads()
        grads = self._owned_grads()
        local_sq = sum((g.float().pow(2).sum() for g in grads),
                       torch.zeros((), device=grads[0].device))
        norm = self._sum_over_ranks(local_sq).sqrt()  # sqrt(sum over every rank's shard)
        clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the formula torch uses
        for g in grads:
            g.mul_(clip.to(g.dtype))
        return norm.item()

    def _owned_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads. DDP: all of them, identical on all ranks."""
        return [b.flat_grad for b in self.buckets]

    def _sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """DDP: every rank holds the whole gradient: its sum is already the global one."""
        return local

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
            # fp32 masters are the parameters themselves, already counted; mixed: K=12 with Adam
            "optimizer": optimizer_tensors(self.optimizer) + self.masters,
        }

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes held now for params, grads and optimizer state (distinct storages)."""
        return model_state_bytes(self.state_tensors())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers, on every rank (a collective in the sharded stages)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    # ---- checkpoints (zerolab/checkpoint.py): what this rank owns, and loading full tensors ----

    def _names(self) -> dict[nn.Parameter, str]:
        return {p: n for n, p in self.module.named_parameters()}  # a tied weight: first name

    def pieces(self) -> list[Piece]:
        """DDP: every rank holds everything, identical: rank 0 speaks for all."""
        if self.rank != 0:
            return []
        names = self._names()
        out = self._frozen_pieces()
        for master, (_, (p,), _) in zip(self.masters, self._slots):
            tensors, scalars = optimizer_piece_state(self.optimizer, master)
            out.append(Piece([names[p]], [tuple(p.shape)], 0,
                             {"param": master.detach().reshape(-1).clone(), **tensors}, scalars))
        return out

    def _frozen_pieces(self) -> list[Piece]:
        return [Piece([n], [tuple(p.shape)], 0, {"param": p.detach().reshape(-1).clone()})
                for n, p in self.module.named_parameters() if not p.requires_grad]

    def load_full(self, params: dict[str, torch.Tensor],
                  optimizer_state: dict[str, dict]) -> None:
        """Take this rank's part of full per-parameter tensors (from any world size, any stage)."""
        names = self._names()
        with torch.no_grad():
            self._load_params(params, names)
        for master, (t, group, layout) in zip(self.masters, self._slots):
            with torch.no_grad():
                if master is not t:  # mixed precision: the master gets the full fp32 value
                    master.copy_(self._slice([params[names[p]] for p in group], layout)
                                 .view_as(master))
            first = optimizer_state.get(names[group[0]], {})
            state = {}
            for key, value in first.items():
                if torch.is_tensor(value) and value.dim() > 0:  # per element: take our slice
                    values = [optimizer_state[names[p]][key] for p in group]
                    state[key] = self._slice(values, layout).clone().view_as(master)
                else:  # per tensor, e.g. Adam's step count
                    state[key] = value.clone() if torch.is_tensor(value) else value
            if state:
                self.optimizer.state[master] = state

    def _load_params(self, params: dict[str, torch.Tensor], names) -> None:
        for p in self.module.parameters():
            p.copy_(params[names[p]])



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


def cast_module(model: nn.Module, dtype: torch.dtype | None) -> dict:
    """Mixed precision: cast floating parameters and buffers to `dtype` for compute.

    Returns {parameter: its fp32 value before the cast} for the trainable ones ({} if dtype is
    None), from which the fp32 master copies are cut.
    """
    if dtype is None:
        return {}
    fp32 = {p: p.detach().float().clone() for p in model.parameters() if p.requires_grad}
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(dtype)
    return fp32


def _cast_floats(x, dtype: torch.dtype):
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floats(y, dtype) for y in x)
    if isinstance(x, dict):
        return {k: _cast_floats(v, dtype) for k, v in x.items()}
    return x


def broadcast_from_rank0(model: nn.Module, group: dist.ProcessGroup | None, tag: str) -> None:
    """Every rank starts from rank 0's parameters and buffers (ranks may have other seeds)."""
    if not dist.is_initialized():
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            comm.broadcast(t.data, src, tag=f"{tag}/{name}", group=group)
