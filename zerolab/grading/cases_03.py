"""Notebook 03's exercises (ex03_zero1): the flat padded shard, its inverse, and the ZeRO-1
step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerolab.grading.exercise import Case, Exercise, _tuple_outputs
from zerolab.grading.inputs import SHAPE_GROUPS, _gen, _ints, _shards, _tensors
from zerolab.sharding import FlatLayout


def _cases_3_1() -> list[Case]:
    return [Case(f"{name}, world_size {n}, rank {r}",
                 lambda rank, name=name, s=shapes, r=r, n=n: (_tensors(("3.1", name), s), r, n))
            for name, shapes in SHAPE_GROUPS.items() for n in (1, 2, 3, 4) for r in range(n)]


def _cases_3_2() -> list[Case]:
    def make(name: str, n: int) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]
        return lambda rank: (_shards(_tensors(("3.2", name), shapes), n),
                             [torch.Size(s) for s in shapes])
    return [Case(f"{name}, world_size {n}", make(name, n))
            for name in SHAPE_GROUPS for n in (1, 2, 3, 4)]


def _cases_3_3(n: int) -> list[Case]:
    def make(name: str) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]

        def args(rank: int) -> tuple:
            params = _tensors(("3.3", name), shapes)  # the same on every rank
            grads = [_ints(_gen("3.3", name, rank, i), *s) for i, s in enumerate(shapes)]
            momentum = _ints(_gen("3.3", name, rank), FlatLayout.of(params, n).shard_numel)
            return params, grads, momentum, 0.1, 0.9
        return args
    return [Case(name, make(name)) for name in SHAPE_GROUPS]


EXERCISES = [
    Exercise("3.1", "ex03_zero1", "flat_shard",
             "the flat, padded shard every ZeRO stage uses",
             "shard_numel is ceil(numel / world_size), the zeros go at the end of the flat "
             "buffer, and rank r's shard starts at r * shard_numel.",
             _cases_3_1),
    Exercise("3.2", "ex03_zero1", "unflatten_shards",
             "the inverse: tensors back from the gathered shards, padding dropped",
             "Concatenate the shards in rank order; tensor i starts where tensor i-1 ended, "
             "and the padding is at the very end.",
             _cases_3_2),
    Exercise("3.3", "ex03_zero1", "zero1_sgd_step",
             "the ZeRO-1 step: reduce-scatter gradients, update own shard, all-gather params",
             "Average (op='avg'), do not sum; reduce-scatter, not all-reduce (the paper's "
             "ZeRO-1 sends 2Ψ, not 3Ψ); update only your shard, then all-gather it.",
             _cases_3_3, distributed=True, comm_checked=True,
             outputs=_tuple_outputs("params", "momentum")),
]
