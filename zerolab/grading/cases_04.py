"""Notebook 04's exercise (ex04_zero2): the ZeRO-2 gradient hook, on ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import SHAPE_GROUPS, _gen, _ints, _tensors
from zerolab.sharding import FlatLayout


def _cases_4_1(n: int) -> list[Case]:
    def make(name: str) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]

        def args(rank: int) -> tuple:
            params = [nn.Parameter(t) for t in _tensors(("4.1", name), shapes)]
            for i, p in enumerate(params):
                p.grad = _ints(_gen("4.1", name, rank, i), *p.shape)
            grad_shard = _ints(_gen("4.1", name, rank), FlatLayout.of(params, n).shard_numel)
            return params, grad_shard
        return args
    return [Case(f"{name}, grad_shard already holding a micro-batch", make(name))
            for name in SHAPE_GROUPS]


def _outputs_4_1(result: Any, args: tuple) -> dict[str, Any]:
    params, grad_shard = args
    return {"grad_shard": grad_shard, "freed .grad": [p.grad is None for p in params]}


EXERCISES = [
    Exercise("4.1", "ex04_zero2", "reduce_scatter_bucket",
             "the ZeRO-2 gradient hook: reduce-scatter a bucket, keep the shard, free the rest",
             "Add the received shard into grad_shard in place (+=: it may already hold earlier "
             "micro-batches), average with op='avg', and set every p.grad = None.",
             _cases_4_1, distributed=True, comm_checked=True, outputs=_outputs_4_1),
]
