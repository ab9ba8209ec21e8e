"""Wrong on purpose (v2): solutions/ex03_zero1.py with bugs marked # BUG;
exercises without one are the solution as it is.

Exercises for notebook 03: ZeRO-1, the flat padded shard and the sharded optimizer step.

3.1 and 3.2 are plain functions (no other rank involved). 3.3 runs on every rank at once
(the grader spawns world_size processes and calls it on each, with the same `group`): talk to
the other ranks only through zerolab.comm, which records every call with a tag.

Check your answers with `grade("ex03")` in the notebook, or `python -m zerolab.grade ex03`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.sharding import FlatLayout, flatten, shard, unflatten


def flat_shard(tensors: list[torch.Tensor], rank: int, world_size: int) -> torch.Tensor:
    """Exercise 3.1: This rank's shard of a group of tensors laid end to end and padded.

    tensors: any shapes, one dtype; numel = their elements together. Lay them end to end in
    one flat buffer, pad it with zeros at the end to padded_numel = ceil(numel / world_size)
    * world_size elements, and split it into world_size equal shards. Return shard `rank`:
    a new 1-D tensor of shard_numel = padded_numel // world_size elements.
    (zerolab.sharding does this for the engines; write it yourself here.)

    Example: numels 6, 3 and 1 (numel 10) on 4 ranks: padded_numel 12, shard_numel 3;
    rank 0 gets elements 0-2 and rank 3 gets [element 9, 0, 0].

    Hint: torch.cat([t.reshape(-1) for t in tensors]) is the flat buffer; copy it into
    torch.zeros(padded_numel) to pad it.
    """
    # BEGIN SOLUTION
    flat = torch.cat([t.reshape(-1) for t in tensors])
    shard_numel = -(-flat.numel() // world_size)  # ceil
    padded = torch.zeros(shard_numel * world_size, dtype=flat.dtype)
    padded[-flat.numel():] = flat  # BUG: padding at the front
    return padded[rank * shard_numel:(rank + 1) * shard_numel].clone()
    # END SOLUTION


def unflatten_shards(shards: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Exercise 3.2: The inverse of 3.1: the original tensors from every rank's shard.

    shards: world_size tensors of shard_numel elements, in rank order (what an all-gather
    brings back). shapes: the original tensors' shapes, in order. Return one tensor per
    shape, with that shape, holding its elements; the padding at the end is left out.

    Example: shards [a0 a1 a2], [a3 a4 a5], [b0 b1 b2], [c0 0 0] and shapes (2, 3), (3,), (1,)
    give [[a0 a1 a2], [a3 a4 a5]], [b0 b1 b2], [c0].

    Hint: concatenate the shards, then walk an offset along the flat buffer: tensor i is
    flat[offset:offset + numel_i].view(shape_i), and the offset moves on by numel_i
    (torch.Size(shape).numel()).
    """
    # BEGIN SOLUTION
    numel = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.cat(shards)[-numel:]  # BUG: takes the padding off the front
    out, offset = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        out.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return out
    # END SOLUTION


def zero1_sgd_step(params: list[torch.Tensor], grads: list[torch.Tensor],
                   momentum: torch.Tensor, lr: float, beta: float, rank: int, world_size: int,
                   group: dist.ProcessGroup | None = None
                   ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Exercise 3.3: One ZeRO-1 step of SGD with momentum, on this rank's shard only.

    params: the model's parameters (any shapes), the same on every rank. grads: this rank's
    gradients, same shapes, different on every rank. momentum: (shard_numel,), this rank's
    shard of the momentum buffer, the only optimizer state it keeps. Shards use the flat
    padded layout of 3.1 (zerolab.sharding: FlatLayout, flatten, shard, unflatten).

    1. Reduce-scatter the flat gradients with op="avg": this rank receives (shard_numel,),
       the average over ranks of its own shard only (an all-reduce would send twice as much).
    2. Update the shard: momentum = beta * momentum + grad; param_shard -= lr * momentum.
    3. All-gather the updated shards: every rank gets the full new parameters.
    Return (the new parameters, a list with the params' shapes; the new momentum shard).
    Use zerolab.comm.reduce_scatter and zerolab.comm.all_gather, with tags and `group`.

    Hint: layout = FlatLayout.of(params, world_size); flatten(grads, layout) is the
    (padded_numel,) flat gradient; shard(flat, layout, rank) is this rank's (shard_numel,)
    view; unflatten(flat, layout) gives the tensors back.
    """
    # BEGIN SOLUTION
    layout = FlatLayout.of(params, world_size)
    # BUG: the article's ZeRO-1: all-reduce every gradient (2Ψ), then keep the own shard
    flat_grads = flatten(grads, layout)
    comm.all_reduce(flat_grads, op="avg", tag="ex3.3/grads", group=group)
    grad = shard(flat_grads, layout, rank)
    momentum = beta * momentum + grad
    param_shard = shard(flatten(params, layout), layout, rank) - lr * momentum
    flat_params = torch.empty(layout.padded_numel)
    comm.all_gather(flat_params, param_shard, tag="ex3.3/params", group=group)
    return unflatten(flat_params, layout), momentum
    # END SOLUTION
