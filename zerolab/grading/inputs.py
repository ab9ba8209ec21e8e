"""Inputs the exercises' cases share: seeded tensors, the same in every process, and the
groups of shapes that catch uneven and tiny shards."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import torch

from zerolab.sharding import FlatLayout, flatten, shard

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

# Groups of tensor shapes: uneven (numel 10: padded on 3 and 4 ranks; 11: on 2, 3 and 4) and
# tiny (numel 1: fewer elements than ranks, so some shards are all padding).
SHAPE_GROUPS = {
    "numels 6, 3, 1": [(6,), (3,), (1,)],
    "shapes (2, 3), (5,)": [(2, 3), (5,)],
    "one element": [(1,)],
}


def rng(*key: Any) -> torch.Generator:
    """A generator seeded from `key`, the same in every process (unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def ints(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Small integers as floats: sums are exact in any order, so rings and trees agree."""
    return torch.randint(-9, 10, shape, generator=gen).float()


def fixed(*args: Any) -> Callable[[int], tuple]:
    return lambda rank: args


def stage_moved(step: int, position: int = 2) -> Callable[[tuple], dict[int, str]]:
    """For mistakes.solution_with: the stage argument at `position` moved `step` stages on
    (1: ZeRO-1 -> ZeRO-2) or back (-1); unchanged past either end."""
    def replace(args: tuple) -> dict[int, str]:
        i = STAGES.index(args[position]) + step
        return {position: STAGES[i]} if 0 <= i < len(STAGES) else {}
    return replace


def tensors_of(key: Any, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    gen = rng(*key)
    return [torch.randn(s, generator=gen) for s in shapes]


def shards_of(tensors: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    layout = FlatLayout.of(tensors, n)
    flat = flatten(tensors, layout)
    return [shard(flat, layout, r).clone() for r in range(n)]


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values in a view that is not contiguous: every other element of a buffer
    twice as long (1-D), or its dimensions' transpose made contiguous and transposed back.
    `.view(-1)` fails on it; `.reshape(-1)` and `.flatten()` copy."""
    if t.dim() <= 1:
        buffer = torch.zeros(2 * t.numel(), dtype=t.dtype)
        buffer[::2] = t.reshape(-1)
        return buffer[::2].view(t.shape) if t.dim() == 1 else buffer[::2][0]
    dims = list(reversed(range(t.dim())))
    return t.permute(dims).contiguous().permute(dims)
