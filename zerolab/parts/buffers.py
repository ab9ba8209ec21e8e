"""Buffers (BatchNorm's running statistics) kept equal across ranks, as torch's DDP keeps them.

A buffer is state the model updates itself in forward, not through a gradient: BatchNorm's
running mean and variance follow each rank's own rows, so after a training step every rank
holds different ones, and in eval mode the ranks would give different outputs. torch's
DistributedDataParallel broadcasts rank 0's buffers at the start of a forward (its default
`broadcast_buffers=True`, named `forward_sync_buffers` since torch 2.13); zerolab's engines do
the same, with the same rule for *which* forwards:

- the first forward, and every forward after a training forward (grad enabled, not inside
  `no_sync()`): so an eval forward right after training sees rank 0's statistics, and outputs
  agree across ranks;
- not after an eval forward or one inside no_sync() (nothing to bring back in line, or
  accumulation, which communicates nothing).

`broadcast_buffers=False` turns it off (each rank keeps its own statistics). The broadcast is
one collective per buffer dtype, tagged "<engine>/fwd/buffers.<dtype>": bytes on top of the
formulas for parameters and gradients (theory.py), which count no buffers. The course's GPT
has none; models.MLP has one (`input_shift`, a constant, sent anyway, as torch's DDP sends it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm

if TYPE_CHECKING:  # the engine contract: the shell (a cycle at run time)
    from zerolab.shell import EngineShell


class BufferSync:
    """When to broadcast a module's buffers from rank 0: torch DDP's rule (module docstring)."""

    def __init__(self, module: nn.Module, enabled: bool):
        self.enabled = enabled  # broadcast_buffers=
        self.module = module
        self.next_forward = True  # torch's require_forward_param_sync: the first forward syncs

    @classmethod
    def attach(cls, engine: EngineShell, enabled: bool) -> BufferSync:
        """Hook engine.module's forward: broadcast before it (over every rank of the job: HSDP's
        replicas too), and decide after it whether the next forward broadcasts."""
        sync = cls(engine.module, enabled)

        def before(module: nn.Module, args) -> None:
            if module is engine.module:  # not a copy of it (copy.deepcopy copies hooks too)
                sync.before_forward(engine.job_group, f"{engine.name}/fwd/buffers")

        def after(module: nn.Module, args, output) -> None:
            if module is engine.module:
                sync.after_forward(engine.require_backward_grad_sync)

        engine.module.register_forward_pre_hook(before)
        engine.module.register_forward_hook(after)
        return sync

    def before_forward(self, group: dist.ProcessGroup | None, tag: str) -> None:
        if self.enabled and self.next_forward:
            broadcast_coalesced(list(self.module.buffers()), group, tag)

    def after_forward(self, synced: bool) -> None:
        """synced: the engine reduces this backward's gradients (not inside no_sync())."""
        self.next_forward = torch.is_grad_enabled() and synced


def broadcast_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup | None,
                        tag: str) -> None:
    """Every rank ends with rank 0's `tensors` (rank 0 of `group`), one broadcast per dtype.
    Written through `.data`, so that autograd's version counters do not move (torch's DDP
    does the same): a graph that saved a buffer (eval-mode BatchNorm) stays valid."""
    if not tensors or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])  # (sum of numels,)
            comm.broadcast(flat, src, tag=f"{tag}.{str(dtype).removeprefix('torch.')}",
                           group=group)
            for t, values in zip(ts, flat.split([t.numel() for t in ts])):
                t.data.copy_(values.view_as(t))
