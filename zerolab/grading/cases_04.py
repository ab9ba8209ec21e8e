"""Notebook 04's exercise (ex04_zero2): the ZeRO-2 gradient hook, on ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import SHAPE_GROUPS, ints, non_contiguous, rng, tensors_of
from zerolab.grading.mistakes import (
    DTYPE_LOST,
    Evidence,
    Mistake,
    matches,
    same_value,
    used_instead,
)
from zerolab.sharding import FlatLayout


def _cases_4_1(n: int) -> list[Case]:
    def make(name: str, dtype: torch.dtype = torch.float32,
             contiguous: bool = True) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]

        def args(rank: int) -> tuple:
            params = [nn.Parameter(t.to(dtype)) for t in tensors_of(("4.1", name), shapes)]
            for i, p in enumerate(params):
                grad = ints(rng("4.1", name, rank, i), *p.shape).to(dtype)
                p.grad = grad if contiguous else non_contiguous(grad)
            grad_shard = ints(rng("4.1", name, rank),
                               FlatLayout.of(params, n).shard_numel).to(dtype)
            return params, grad_shard
        return args
    return [Case(f"{name}, grad_shard already holding a micro-batch", make(name))
            for name in SHAPE_GROUPS] + [
        Case("numels 6, 3, 1 in float64", make("numels 6, 3, 1", torch.float64)),
        Case("shapes (2, 3), (5,), the gradients non-contiguous views",
             make("shapes (2, 3), (5,)", contiguous=False))]


def _outputs_4_1(result: Any, args: tuple) -> dict[str, Any]:
    params, grad_shard = args
    return {"grad_shard": grad_shard, "freed .grad": [p.grad is None for p in params]}


def _before(ev: Evidence) -> Any:
    """grad_shard as the caller passed it (the earlier micro-batches)."""
    return ev.inputs()[1]


EXERCISES = [
    Exercise("4.1", "ex04_zero2", "reduce_scatter_bucket",
             "the ZeRO-2 gradient hook: reduce-scatter a bucket, keep the shard, free the rest",
             "Flatten the .grads in the bucket's padded layout, reduce-scatter them with "
             "op='avg' into a new (shard_numel,) tensor, add that into grad_shard in place, and "
             "set every p.grad = None.",
             _cases_4_1, distributed=True, comm_checked=True, outputs=_outputs_4_1,
             hints=("layout = FlatLayout.of(params, world_size); full = flatten([p.grad for p "
                    "in params], layout); received = torch.empty_like(grad_shard); "
                    "comm.reduce_scatter(received, full, op='avg', tag=..., group=group); "
                    "grad_shard += received.",),
             mistakes=(
                 Mistake("grad_shard rebound, not changed in place",
                         "The caller's grad_shard is unchanged: `grad_shard = grad_shard + x` "
                         "makes a new tensor under your local name. Change the caller's "
                         "tensor in place (+= or add_).",
                         lambda ev: same_value(_before(ev), ev.got), output="grad_shard"),
                 Mistake("the earlier micro-batches overwritten",
                         "grad_shard already holds earlier micro-batches: add into it, do not "
                         "overwrite it.",
                         matches(lambda ev: ev.expected - _before(ev)), output="grad_shard"),
                 Mistake("gradients summed over the ranks, not averaged",
                         "Average over the ranks: op='avg' in the reduce-scatter.",
                         matches(lambda ev: _before(ev) + ev.world_size
                                 * (ev.expected - _before(ev))), output="grad_shard"),
                 Mistake("the full gradients not freed",
                         "Set p.grad = None for every parameter of the bucket: freeing the "
                         "full gradients is what ZeRO-2 saves.",
                         lambda ev: not all(ev.got), output="freed .grad"),
                 Mistake("an all-reduce where a reduce-scatter belongs",
                         "A rank keeps only its shard of the gradient: a reduce-scatter gives "
                         "it just that, with half the bytes of an all-reduce.",
                         used_instead("all_reduce", "reduce_scatter"), output="comm ops"),
                 DTYPE_LOST),
             read_only=("params",)),
]
