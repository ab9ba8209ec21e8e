"""Notebook 05's exercises (ex05_zero3): unshard a unit on ranks, and really free it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import SHAPE_GROUPS, _shards, _tensors
from zerolab.sharding import FlatLayout, flatten


def _cases_5_1(n: int) -> list[Case]:
    def make(name: str) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]
        return lambda rank: (_shards(_tensors(("5.1", name), shapes), n)[rank],
                             [torch.Size(s) for s in shapes])
    return [Case(name, make(name)) for name in SHAPE_GROUPS]


def _cases_5_2() -> list[Case]:
    def make(name: str, n: int) -> Callable[[int], tuple]:
        def args(rank: int) -> tuple:
            tensors = _tensors(("5.2", name), SHAPE_GROUPS[name])
            layout = FlatLayout.of(tensors, n)
            flat = flatten(tensors, layout)
            views = [flat[o:o + t.numel()].view(t.shape) for o, t in zip(layout.offsets, tensors)]
            return [nn.Parameter(v) for v in views], flat
        return args
    return [Case(f"{name}, world_size {n}", make(name, n)) for name in SHAPE_GROUPS for n in (1, 3)]


def _outputs_5_2(result: Any, args: tuple) -> dict[str, Any]:
    params, flat_param = args
    return {"flat_param's storage bytes": flat_param.untyped_storage().nbytes(),
            "params' numel": [p.numel() for p in params],
            "params' dtype": [str(p.dtype) for p in params]}


EXERCISES = [
    Exercise("5.1", "ex05_zero3", "unshard",
             "ZeRO-3's unshard: all-gather a unit and view its parameters",
             "All-gather the shards with zerolab.comm.all_gather; the padding is at the end of "
             "the gathered buffer, so parameter 0 starts at element 0.",
             _cases_5_1, distributed=True, comm_checked=True),
    Exercise("5.2", "ex05_zero3", "reshard",
             "ZeRO-3's reshard: really free a unit's storage",
             "Both are needed: flat_param.untyped_storage().resize_(0) frees the memory, and "
             "p.data = torch.empty(0, dtype=p.dtype) leaves no parameter pointing into it.",
             _cases_5_2, outputs=_outputs_5_2),
]
