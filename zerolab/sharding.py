"""Flat, padded shards: the data layout every ZeRO stage shares.

A group of parameters (a bucket, or a ZeRO-3 unit) is laid end to end in one 1-D buffer, the
flat_param, padded with zeros so that it splits into world_size equal shards:

    params:      [ w0 (6) | b0 (3) | gain (1) ]          numel = 10
    flat_param:  [ w0 w0 w0 w0 w0 w0 b0 b0 b0 g . . ]    padded_numel = 12 (world_size 4)
    shards:        rank 0   rank 1   rank 2   rank 3      shard_numel = 3

Rank r owns flat_param[r * shard_numel : (r + 1) * shard_numel]. Equal shards are what
reduce-scatter and all-gather need; the padding is never read back into a parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor sits in a padded flat buffer split into `world_size` shards."""

    shapes: tuple[torch.Size, ...]  # each tensor's shape
    offsets: tuple[int, ...]  # each tensor's first element in the flat buffer
    numel: int  # elements of all tensors together
    padded_numel: int  # numel rounded up to a multiple of world_size
    world_size: int  # number of shards

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], world_size: int) -> FlatLayout:
        offsets, numel = [], 0
        for t in tensors:
            offsets.append(numel)
            numel += t.numel()
        padded = -(-numel // world_size) * world_size  # ceil to a multiple of world_size
        return cls(tuple(t.shape for t in tensors), tuple(offsets), numel, padded, world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel


def flatten(tensors: Sequence[torch.Tensor], layout: FlatLayout) -> torch.Tensor:
    """Copy `tensors` into a new zero-padded flat buffer. (padded_numel,)"""
    ref = tensors[0]
    flat = torch.empty(layout.padded_numel, dtype=ref.dtype, device=ref.device)
    flat[layout.numel:].zero_()  # only the padding needs zeros: the rest is overwritten
    # One copy of them all, end to end as the offsets lay them (a copy per tensor costs a call,
    # and on a GPU a launch, per parameter).
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:layout.numel])
    return flat


def unflatten(flat: torch.Tensor, layout: FlatLayout) -> list[torch.Tensor]:
    """Views into `flat`, one per tensor, with their original shapes. No copy."""
    return [flat[o:o + s.numel()].view(s) for o, s in zip(layout.offsets, layout.shapes)]


def shard(flat: torch.Tensor, layout: FlatLayout, rank: int) -> torch.Tensor:
    """Rank's shard of a flat buffer, as a view. (shard_numel,)"""
    start, end = layout.shard_range(rank)
    return flat[start:end]


@dataclass
class Bucket:
    """Parameters whose gradients are reduced together, in one flat buffer."""

    name: str  # used in comm tags: "bucket0", or a ZeRO-3 unit's name
    params: list[torch.nn.Parameter]  # trainable parameters, each in exactly one bucket
    layout: FlatLayout  # where each parameter sits in the flat buffers
    flat_grad: torch.Tensor | None = None  # (padded_numel,) DDP/ZeRO-1: params' .grad are views
    ready: int = 0  # parameters whose gradient is accumulated in the current backward
    reduced: bool = False  # its reduction has been issued for the current backward


@dataclass(frozen=True)
class Slot:
    """What one rank holds of a run of parameters, and where it sits in them.

    DDP holds each parameter whole (layout None, the same on every rank); the ZeRO stages hold
    a flat shard of a bucket (this rank's `local_shard` under `layout`). The optimizer steps
    the slots' tensors (or fp32 masters of them), and checkpoints save and load them by the
    parameters' names, whatever the stage or the world size that wrote them.
    """

    tensor: torch.Tensor  # the parameter itself, or this rank's (shard_numel,) local_shard
    params: tuple[torch.nn.Parameter, ...]  # the parameters it covers, in flat order
    layout: FlatLayout | None  # None: held whole, replicated on every rank


def local_values(values: Sequence[torch.Tensor], layout: FlatLayout | None,
                 rank: int) -> torch.Tensor:
    """This rank's part of full per-parameter `values` under a slot's layout.

    values: one full tensor per parameter of the slot. Returns the one tensor itself (layout
    None), or rank's (shard_numel,) shard of them laid end to end and padded.
    """
    if layout is None:
        return values[0]
    return shard(flatten(values, layout), layout, rank)
