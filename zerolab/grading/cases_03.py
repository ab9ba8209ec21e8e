"""Notebook 03's exercises (ex03_zero1): the flat padded shard, its inverse, and the ZeRO-1
step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerolab.grading.exercise import Case, Exercise, own_memory_outputs, tuple_outputs
from zerolab.grading.inputs import SHAPE_GROUPS, ints, non_contiguous, rng, shards_of, tensors_of
from zerolab.grading.mistakes import (
    DTYPE_LOST,
    Evidence,
    Mistake,
    cut,
    element,
    first_difference,
    matches,
    memory_mistakes,
    neighbour_rank,
    numel_is,
    used_instead,
)
from zerolab.sharding import FlatLayout


def _cases_3_1() -> list[Case]:
    cases = [Case(f"{name}, world_size {n}, rank {r}",
                  lambda rank, name=name, s=shapes, r=r, n=n: (tensors_of(("3.1", name), s), r, n))
             for name, shapes in SHAPE_GROUPS.items() for n in (1, 2, 3, 4) for r in range(n)]
    shapes = SHAPE_GROUPS["shapes (2, 3), (5,)"]
    kinds = {"in float64": lambda t: t.double(), "in bfloat16": lambda t: t.bfloat16(),
             "as non-contiguous views": non_contiguous}
    return cases + [Case(f"shapes (2, 3), (5,) {kind}, world_size 4, rank {r}",
                         lambda rank, r=r, f=f: ([f(t) for t in tensors_of(("3.1", "f64"), shapes)],
                                                 r, 4))
                    for kind, f in kinds.items() for r in range(4)]


def _cases_3_2() -> list[Case]:
    def make(name: str, n: int, dtype: torch.dtype = torch.float32) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]
        return lambda rank: (shards_of([t.to(dtype) for t in tensors_of(("3.2", name), shapes)], n),
                             [torch.Size(s) for s in shapes])
    return [Case(f"{name}, world_size {n}", make(name, n))
            for name in SHAPE_GROUPS for n in (1, 2, 3, 4)] + [
        Case("numels 6, 3, 1 in float64, world_size 3", make("numels 6, 3, 1", 3,
                                                             torch.float64))]


def _cases_3_3(n: int) -> list[Case]:
    def make(name: str, dtype: torch.dtype = torch.float32) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]

        def args(rank: int) -> tuple:
            params = [t.to(dtype) for t in tensors_of(("3.3", name), shapes)]  # same everywhere
            grads = [ints(rng("3.3", name, rank, i), *s).to(dtype)
                     for i, s in enumerate(shapes)]
            momentum = ints(rng("3.3", name, rank),
                             FlatLayout.of(params, n).shard_numel).to(dtype)
            return params, grads, momentum, 0.1, 0.9
        return args
    return [Case(name, make(name)) for name in SHAPE_GROUPS] + [
        Case("numels 6, 3, 1 in float64", make("numels 6, 3, 1", torch.float64))]


# ---- what the grader can tell apart ------------------------------------------------------------


def _padded_in_front(ev: Evidence) -> torch.Tensor:
    """3.1 with the zeros before the first tensor."""
    tensors, rank, n = ev.inputs()
    flat = torch.cat([t.reshape(-1) for t in tensors])
    k = -(-flat.numel() // n)
    padded = torch.cat([flat.new_zeros(n * k - flat.numel()), flat])
    return padded[rank * k:(rank + 1) * k]


def _cut_shards(ev: Evidence, **wrong: bool) -> list[torch.Tensor]:
    """3.2's tensors cut from the shards (`wrong`: see mistakes.cut)."""
    shards, shapes = ev.inputs()
    return cut(torch.cat(shards), shapes, **wrong)


def _summed_momentum(ev: Evidence) -> bool:
    """3.3's momentum when the gradients were summed over the ranks, not averaged."""
    _, _, m0, _, beta = ev.inputs()
    right = ev.expected_outputs["momentum"]
    summed = beta * m0 + ev.world_size * (right - beta * m0)
    return ev.world_size > 1 and torch.allclose(ev.got_outputs["momentum"], summed)


_PADDING_AT_END = ("The padding zeros go at the end of the flat buffer, after the last tensor: "
                   "element 0 of tensor 0 is element 0 of the buffer.")

EXERCISES = [
    Exercise("3.1", "ex03_zero1", "flat_shard",
             "the flat, padded shard every ZeRO stage uses",
             "Concatenate the flattened tensors, copy them into a zero buffer of world_size * "
             "ceil(numel / world_size) elements (zeros at the end), and take rank `rank`'s "
             "slice of shard_numel elements, as a copy.",
             _cases_3_1, outputs=own_memory_outputs,
             hints=("shard_numel = -(-numel // world_size) (ceil); padded = torch.zeros("
                    "shard_numel * world_size, dtype=...); padded[:numel] = flat; return "
                    "padded[rank * shard_numel:(rank + 1) * shard_numel].clone().",),
             mistakes=(
                 Mistake("shard size from floor instead of ceil",
                         "shard_numel is ceil(numel / world_size): with floor, the last "
                         "elements belong to no shard.",
                         numel_is(lambda ev: sum(t.numel() for t in ev.inputs()[0])
                                  // ev.inputs()[2])),
                 Mistake("off by one shard: a neighbour's shard",
                         "You returned a neighbour's shard: rank r's shard starts at element "
                         "r * shard_numel.", neighbour_rank(1)),
                 Mistake("the padding at the wrong end", _PADDING_AT_END,
                         matches(_padded_in_front)),
                 DTYPE_LOST, *memory_mistakes("the shard")),
             read_only=("tensors",)),
    Exercise("3.2", "ex03_zero1", "unflatten_shards",
             "the inverse: tensors back from the gathered shards, padding dropped",
             "Concatenate the shards in rank order; tensor i starts where tensor i-1 ended, "
             "and the padding is at the very end.",
             _cases_3_2,
             hints=("Walk an offset along the flat buffer: tensor i is flat[offset:offset + "
                    "numel_i].view(shape_i), then offset += numel_i "
                    "(torch.Size(shape).numel()).",),
             mistakes=(
                 Mistake("every tensor starting at element 0",
                         "Tensor i starts where tensor i-1 ended: move the offset on by each "
                         "tensor's numel.",
                         matches(lambda ev: _cut_shards(ev, offsets_move=False))),
                 Mistake("the padding taken to be at the front", _PADDING_AT_END,
                         matches(lambda ev: _cut_shards(ev, padding_in_front=True))),
                 Mistake("a tensor not in its shape",
                         "Give each tensor its shape: flat[offset:offset + numel].view(shape).",
                         element(lambda ev: ev.got.shape != ev.expected.shape
                                 and ev.got.numel() == ev.expected.numel(), first_difference)),
                 Mistake("a tensor of the wrong size",
                         "Each tensor has exactly its shape's numel elements "
                         "(torch.Size(shape).numel()), the padding none.",
                         element(lambda ev: ev.got.numel() != ev.expected.numel(),
                                 first_difference)),
                 DTYPE_LOST),
             read_only=("shards",)),
    Exercise("3.3", "ex03_zero1", "zero1_sgd_step",
             "the ZeRO-1 step: reduce-scatter gradients, update own shard, all-gather params",
             "Average (op='avg'), do not sum; reduce-scatter, not all-reduce (a rank updates "
             "only its shard); update your shard of params and momentum, then all-gather the "
             "params. zerolab.sharding's FlatLayout.of, flatten, shard and unflatten do the "
             "layout.",
             _cases_3_3, distributed=True, comm_checked=True,
             outputs=tuple_outputs("params", "momentum"),
             hints=("layout = FlatLayout.of(params, world_size); comm.reduce_scatter(grad, "
                    "flatten(grads, layout), op='avg', ...) fills grad (shard_numel,); "
                    "momentum = beta * momentum + grad; param_shard = shard(flatten(params, "
                    "layout), layout, rank) - lr * momentum; comm.all_gather(flat, "
                    "param_shard, ...); return unflatten(flat, layout), momentum.",),
             mistakes=(
                 Mistake("gradients summed over the ranks, not averaged",
                         "Average the gradients (op='avg' in the reduce-scatter): a sum makes "
                         "the step world_size times too big.",
                         _summed_momentum, output=""),
                 Mistake("an all-reduce where a reduce-scatter belongs",
                         "An all-reduce gives every rank the whole averaged gradient, but a "
                         "rank updates only its shard: a reduce-scatter gives it just that.",
                         used_instead("all_reduce", "reduce_scatter"), output="comm ops"),
                 Mistake("the updated shards not gathered",
                         "Each rank updated only its shard: all-gather the shards so that "
                         "every rank has all the new parameters.",
                         lambda ev: "all_gather" in ev.expected and "all_gather" not in ev.got,
                         output="comm ops"),
                 Mistake("the momentum changed in place",
                         "Return the new momentum shard as a new tensor (momentum = beta * "
                         "momentum + grad): the contract leaves `momentum` unchanged.",
                         output="input momentum"),
                 DTYPE_LOST,
                 Mistake("a float32 buffer for float64 data",
                         "The gradient's reduce-scatter needs an output of the gradients' "
                         "dtype: torch.empty makes float32 unless you pass dtype=.",
                         lambda ev: "float64" in ev.case, signal="SIGABRT")),
             read_only=("params", "grads", "momentum")),
]
