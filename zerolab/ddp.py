"""DDP: the baseline every ZeRO stage improves on.

Every rank holds a full copy of the parameters, gradients and optimizer state (16 bytes per
parameter with fp32 Adam), runs forward and backward on its own slice of the batch, and the ranks
average their gradients so that every copy takes the same step.

The averaging happens *during* backward: parameters are grouped into buckets (in reverse order,
roughly the order backward produces their gradients), and as soon as the last gradient of a
bucket is accumulated, a post-accumulate-grad hook starts an asynchronous all-reduce of that
bucket while backward carries on with earlier layers. Each bucket's gradients live in one flat
buffer (`flat_grad`); the parameters' `.grad` are views into it, so the all-reduce needs no copy.

The stages that follow subclass this one and override its hooks, nothing else (the shell,
shell.py, calls them in this order; zerolab/DESIGN.md has the whole table):

    hook            DDP (here)            ZeRO-1              ZeRO-2              ZeRO-3
    _materialize    a meta model, whole   DDP's               DDP's               unit by unit
    _make_buckets   greedy, bucket_bytes  same                same                one per unit
    _shard_model    _grad_buffer each     + flat_param and    ZeRO-1's            only shards
                                          local_shard views                       kept at rest
    _grad_buffer    flat_grad; .grad      DDP's               grad_shard only     ZeRO-2's
                    views it
    _hook_modules   nothing               wait for a gather   ZeRO-1's            unshard and
                                          before forward                          reshard units
    _bucket_ready   _reduce it now        DDP's               DDP's               + reshard
    _reduce         all-reduce (avg)      reduce-scatter      reduce-scatter,     ZeRO-2's
                                                              free the .grads
    _after_step     nothing               all-gather params   ZeRO-1's            nothing
    _slots          each param, whole     own shard / bucket  ZeRO-1's            own shards

Besides the stage: shell.py, the module a torch user meets (forward, parameters(), the
optimizer's step, the end of backward, no_sync, clipping, state dicts), and the torch habits
it routes to the engine (parts/habits.py, buffers.py, param_groups.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerolab import comm
from zerolab.memory import Settled, StateTensors, optimizer_tensors
from zerolab.parts.materialize import materialize
from zerolab.parts.param_groups import bucket_params
from zerolab.sharding import Bucket, FlatLayout, Slot
from zerolab.shell import EngineShell

DEFAULT_BUCKET_BYTES = 1 << 20  # 1 MiB: small, so that the course's small models get buckets


@dataclass
class GradBucket(Bucket):
    fresh: bool = False  # gradients were accumulated into it since its last reduction
    due: bool = False  # its gradients are in (this backward): reduce it once those before are


@dataclass(frozen=True)
class DDPOptions:
    """DDP's own keyword arguments (the shell takes the rest: shell.py)."""

    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # a bucket closes once it holds this many bytes


class DDP(EngineShell):
    """Data parallel with bucketed gradient all-reduce overlapping backward.

    engine = DDP(model, torch.optim.AdamW, lr=1e-3, bucket_bytes=1 << 20)
    loss_fn(engine(x), y).backward(); engine.step(); engine.zero_grad()

    The shell (shell.py) takes group=, param_dtype=, param_groups=[{"params": [...],
    "weight_decay": 0.1}, ...] (param_groups.py), broadcast_buffers= (buffers.py) and the
    optimizer's keyword arguments; DDPOptions the stage's own.
    """

    name = "ddp"  # first part of every comm tag
    Options = DDPOptions
    _next = 0  # reduce_order[_next]: the next bucket this backward reduces
    _backward_syncs = True  # the last backward to start reduces (it ran outside no_sync())

    # ---- set-up: what each rank holds ---------------------------------------------------------

    def _materialize(self) -> None:
        """DDP holds every parameter: build a meta model all at once (parts/materialize.py)."""
        materialize(self.module, self.device)

    def _make_buckets(self) -> list[GradBucket]:
        """Greedy, in reverse order (≈ backward's): close a bucket once it holds bucket_bytes.
        A parameter is never split; a bucket holds one parameter group of one dtype."""
        params = reversed([p for p in self.module.parameters() if p.requires_grad])
        return [GradBucket(f"bucket{i}", ps, FlatLayout.of(ps, self.world_size)) for i, ps in
                enumerate(bucket_params(list(params), self.options.bucket_bytes,
                                        self.groups.key))]

    def _shard_model(self) -> None:
        """DDP shards nothing: each bucket gets its gradient buffer."""
        self._views: dict[nn.Parameter, torch.Tensor] = {}  # each .grad's view into its bucket
        for b in self.buckets:
            self._grad_buffer(b)

    def _grad_buffer(self, b: GradBucket) -> None:
        """A flat gradient buffer per bucket, (padded_numel,); the .grad are views of it."""
        p0 = b.params[0]
        b.flat_grad = torch.zeros(b.layout.padded_numel, dtype=p0.dtype, device=p0.device)
        for p, offset in zip(b.params, b.layout.offsets):
            self._views[p] = p.grad = b.flat_grad[offset:offset + p.numel()].view_as(p)

    def _slots(self) -> list[Slot]:
        """DDP: the optimizer steps each parameter, whole, the same on every rank."""
        return [Slot(p, (p,), None) for b in self.buckets for p in b.params]

    # ---- forward and backward: the hooks ------------------------------------------------------

    def _hook_modules(self) -> None:
        """DDP's forward needs nothing: every rank holds every parameter, always."""

    def _grad_arriving(self, bucket: GradBucket, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Before autograd adds `grad` into param.grad (DDP, ZeRO-1: .grad views a bucket)."""
        if bucket.ready == 0:  # the bucket's first gradient in this backward
            self._first_grad(bucket)
        if self._replaced(param):  # take it back, as torch's DDP does (None: nothing added)
            self._views[param].copy_(param.grad if param.grad is not None else 0)
            param.grad = self._views[param]

    def _replaced(self, param: nn.Parameter) -> bool:  # .grad set to None or replaced by hand
        return param.grad is None or param.grad.data_ptr() != self._views[param].data_ptr()

    def _first_grad(self, bucket: GradBucket) -> None:
        """Another backward reaches a bucket reduced in this step (accumulation without
        no_sync(), torch's DDP sums them): let its reduction end before autograd adds into it."""
        if bucket.reduced:
            self._wait_pending()

    def _grad_accumulated(self, bucket: GradBucket, param: nn.Parameter) -> None:
        """Autograd summed every use of param (tied, reused): once the bucket's last gradient
        is in, it is ready."""
        bucket.fresh = True
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            bucket.ready = 0  # counted afresh in the next backward (next micro-batch)
            self._bucket_ready(bucket)

    def _bucket_ready(self, bucket: GradBucket) -> None:
        """The last gradient of `bucket` has arrived: start reducing it, backward goes on
        (after the buckets before it in the reduction order: the Note below)."""
        if self._sync:
            bucket.due = True
            self._reduce_due()

    # Note: one order on every rank. Collectives pair up by the order each rank issues them,
    # so the buckets are reduced in one fixed order (`reduce_order`, about backward's), as
    # torch's DDP reducer does: a bucket whose gradients are in waits for those before it. A
    # rank whose backward did not reach a parameter (a branch the other ranks took) stops at its
    # bucket, and reduces the rest, that gradient as zeros, when the gradients are next read
    # (step(), clipping, parameters(), the next backward), in the same order; the ranks that
    # went on wait for it there. The result is the single process's, as with FSDP2.

    @property
    def reduce_order(self) -> list[GradBucket]:
        return self.buckets

    def _reduce_due(self) -> None:
        order = self.reduce_order
        while self._next < len(order) and order[self._next].due:
            bucket = order[self._next]
            self._next += 1
            bucket.fresh = False  # what it holds goes into this reduction
            self._reduce(bucket, "bwd")

    def _reduce(self, bucket: Bucket, phase: str) -> None:
        """Average the bucket's gradients over the ranks. phase: "bwd" or "step" (for the tag)."""
        bucket.reduced = True
        handle = comm.all_reduce(bucket.flat_grad, op="avg",
                                 tag=f"{self.name}/{phase}/{bucket.name}", group=self.group,
                                 async_op=True)
        self._pending.append((handle, None))

    def _finish_backward(self) -> None:
        """Reduce what backward left unreduced (unused parameters), wait for everything."""
        if not self._backward_seen:
            raise RuntimeError(f"{type(self).__name__}.step() (or clip_grad_norm_()) was called "
                               "before backward(): no gradient has been computed since the last "
                               "step. Call loss.backward() first.")
        for bucket in self.reduce_order:  # unused in backward, or added to since (no_sync)
            if not bucket.reduced or bucket.fresh:
                bucket.fresh = False
                self._reduce(bucket, "step")
        self._wait_pending()
        self._count_afresh()
        for bucket in self.buckets:
            bucket.reduced = False

    def _reduce_rest(self) -> None:
        """A backward starts after one that reduced some buckets and stopped at one it did not
        complete: reduce the rest now, in order, as the ranks that completed it did, and wait:
        this backward's gradients go into the same buckets."""
        order = self.reduce_order
        if self._backward_syncs:  # (not inside no_sync(): the other ranks reduced theirs)
            for bucket in order[self._next:]:
                bucket.fresh = False
                self._reduce(bucket, "bwd")
            self._wait_pending()  # before this backward adds into the same buckets

    def _count_afresh(self) -> None:
        """A backward starts: count each bucket's gradients from zero (the last backward may
        have left some uncounted: a parameter it did not reach)."""
        self._next = 0
        self._backward_syncs = self._sync
        for bucket in self.buckets:
            bucket.ready, bucket.due = 0, False

    def _wait_pending(self) -> None:
        for handle, on_done in self._pending:
            handle.wait()
            if on_done is not None:
                on_done()
        self._pending.clear()

    # ---- the step: what the stage adds ---------------------------------------------------------

    def _after_step(self) -> None:
        """DDP: every rank took the same step on the same averaged gradients: nothing to do."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients in place: the buffers stay, counted (set_to_none: torch's
        signature, the same here). model.zero_grad() and optimizer.zero_grad() call this."""
        for b in self.buckets:
            b.flat_grad.zero_()
        for p, view in self._views.items():  # a .grad replaced by hand is the view again
            p.grad = view

    def state_tensors(self) -> StateTensors:
        """What this rank holds now, by category. (fp32 masters are the parameters, counted
        once; with mixed precision they are fp32 copies: with Adam's m and v, K = 12.)"""
        return {"params": list(self._params), "grads": [b.flat_grad for b in self.buckets],
                # Settled: changes only in optimizer.step(); the memory tracker reads it then
                "optimizer": Settled(lambda: optimizer_tensors(self.optimizer) + self.masters)}


class DDPAfterBackward(DDP):
    """DDP without the overlap: backward reduces nothing; step() all-reduces every bucket (the
    same bytes as DDP; notebook 01 sets the two side by side on a timeline)."""

    name = "ddp_after_backward"

    def _bucket_ready(self, bucket: Bucket) -> None:
        """Nothing during backward: step() reduces every bucket."""
