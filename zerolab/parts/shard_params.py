"""What `engine.parameters()` gives under ZeRO-1/2/3: this rank's shards, as FSDP2 gives them.

FSDP2 replaces each parameter by a DTensor: a full-shaped tensor of which this rank holds
dim-0 rows, whose gradient is a DTensor too. torch's own utilities then work on the shards:
`clip_grad_norm_` adds up the ranks' parts of the norm (one all-reduce), an optimizer steps each
rank's rows. zerolab's stages shard flat buckets (sharding.py: parameters end to end, padded,
cut in world_size equal parts), so each bucket's shard is one DTensor here: global shape
(padded_numel,), placement Shard(0), its local tensor the very shard the engine steps (no
copy), its `.grad` the averaged gradient shard (bound after each backward's reduction).

Built on first use (engine.parameters()): most loops never ask, and DTensor costs an import.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from zerolab.sharding import Slot

if TYPE_CHECKING:  # the engine contract: the shell (a cycle at run time)
    from zerolab.shell import EngineShell


@dataclass
class ShardParams:
    """Per sharded slot, the parameter a torch user sees for it."""

    slots: list[Slot]  # the engine's trainable slots, then its frozen ones
    params: list[nn.Parameter]  # one per slot: a DTensor over slot.tensor (or slot.tensor)
    names: list[str]  # "module.<bucket name>"
    mesh: object | None  # the DeviceMesh of the engine's group (None without a process group)

    @classmethod
    def of(cls, engine: EngineShell) -> ShardParams:
        slots = list(engine.slots) + list(engine.frozen_slots())
        mesh = None
        if dist.is_initialized():
            from torch.distributed.device_mesh import DeviceMesh
            mesh = DeviceMesh.from_group(engine.group or dist.group.WORLD, engine.device.type)
        names = [f"module.{_bucket_name(engine, s)}" for s in slots]
        return cls(slots, [_as_param(s, mesh) for s in slots], names, mesh)

    def named(self) -> Iterator[tuple[str, nn.Parameter]]:
        yield from zip(self.names, self.params)

    def bind_grads(self) -> None:
        """Each shard parameter's .grad: the slot's averaged gradient shard (a view, no copy)."""
        for s, p in zip(self.slots, self.params):
            g = s.tensor.grad
            p.grad = None if g is None else _wrap(g, s, self.mesh)

    def user_zeroed(self) -> bool | None:
        """After a user's optimizer.zero_grad(): True if every shard's .grad was set to None,
        False if none was, None if some were (a habit with no engine meaning)."""
        trained = [p for s, p in zip(self.slots, self.params) if s.tensor.requires_grad]
        unset = [p.grad is None for p in trained]
        return all(unset) if all(unset) or not any(unset) else None

    @property
    def ids(self) -> set[int]:
        """id() of each shard parameter: what an optimizer's param groups are checked against."""
        return {id(p) for p in self.params}


def _bucket_name(engine: EngineShell, slot: Slot) -> str:
    for b in [*engine.buckets, *(b for u in engine.units for b in u.buckets)]:
        if b.local_shard is slot.tensor:  # (ZeRO-3's frozen buckets are the units')
            return b.name
    return f"shard{id(slot.tensor)}"


def _wrap(local: torch.Tensor, slot: Slot, mesh) -> torch.Tensor:
    """local: (shard_numel,) -> a DTensor of (padded_numel,), Shard(0); local itself if no mesh."""
    if mesh is None or slot.layout is None:
        return local
    from torch.distributed.tensor import DTensor, Shard
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                              shape=(slot.layout.padded_numel,), stride=(1,))


def _as_param(slot: Slot, mesh) -> nn.Parameter:
    if slot.layout is None:  # a frozen parameter kept whole on every rank (ZeRO-1/2)
        return slot.tensor
    return nn.Parameter(_wrap(slot.tensor.detach(), slot, mesh),
                        requires_grad=slot.tensor.requires_grad)
