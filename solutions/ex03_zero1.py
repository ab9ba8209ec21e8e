"""Exercises for notebook 03: ZeRO-1, the flat padded shard and the sharded optimizer step.

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

    Inputs: tensors: any shapes, one dtype, maybe not contiguous; numel = their elements
    together. rank, world_size.
    Returns: a new 1-D tensor of shard_numel = ceil(numel / world_size) elements, of the
    tensors' dtype: shard `rank` of the flat buffer (the tensors flattened and laid end to
    end, in order) padded with zeros at its end to world_size * shard_numel elements; shard
    r is the r-th run of shard_numel elements. (zerolab.sharding does this for the engines;
    write it yourself here.)
    Must: leave the tensors unchanged; return memory of its own holding just the shard (not
    a view of an input, nor of a bigger buffer, which would keep all of it alive).
    Example: numels 6, 3 and 1 (numel 10) on 4 ranks: shard_numel 3; rank 0 gets elements
    0-2 and rank 3 gets [element 9, 0, 0].
    Graded on: uneven groups (padded on 3 and 4 ranks), fewer elements than ranks, float32,
    float64, bfloat16 and non-contiguous tensors; every rank of 1 to 4: the shard, the memory
    behind it, the tensors afterwards.

    Hint: how many zeros must the flat buffer get so that world_size shards are equal?
    """
    # BEGIN SOLUTION
    flat = torch.cat([t.reshape(-1) for t in tensors])
    shard_numel = -(-flat.numel() // world_size)  # ceil
    padded = torch.zeros(shard_numel * world_size, dtype=flat.dtype)
    padded[:flat.numel()] = flat
    return padded[rank * shard_numel:(rank + 1) * shard_numel].clone()
    # END SOLUTION


def unflatten_shards(shards: list[torch.Tensor], shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Exercise 3.2: The inverse of 3.1: the original tensors from every rank's shard.

    Inputs: shards: world_size tensors of shard_numel elements, in rank order (what an
    all-gather of 3.1's shards brings back). shapes: the original tensors' shapes, in order.
    Returns: one tensor per shape, with that shape and the shards' dtype, holding its
    elements; the padding is left out.
    Must: leave the shards unchanged.
    Example: shards [a0 a1 a2], [a3 a4 a5], [b0 b1 b2], [c0 0 0] and shapes (2, 3), (3,),
    (1,) give [[a0 a1 a2], [a3 a4 a5]], [b0 b1 b2], [c0].
    Graded on: the groups of 3.1 on 1 to 4 ranks, one in float64: every tensor (values and
    dtype), the shards afterwards.

    Hint: in the flat buffer, where does tensor i start?
    """
    # BEGIN SOLUTION
    flat = torch.cat(shards)
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

    Inputs: params: the model's parameters (any shapes), the same on every rank. grads:
    this rank's gradients, the same shapes, different on every rank. momentum:
    (shard_numel,), this rank's shard of the momentum buffer in 3.1's flat padded layout of
    the params: the only optimizer state a rank keeps. lr, beta: the update is
    m = beta * m + g, then p = p - lr * m, where g is the gradient averaged over the ranks.
    Returns: (the new parameters: a list of tensors with the params' shapes, the same on
    every rank; this rank's new momentum shard, (shard_numel,)).
    Must: leave params, grads and momentum unchanged (return new tensors); keep and update
    only this rank's shard of the optimizer state; talk to the other ranks through
    zerolab.comm (with tags and `group`), sending what ZeRO-1 sends: 2(N-1)/N of the padded
    flat buffer's bytes, as much as DDP's all-reduce.
    Graded on: the groups of 3.1 on 1, 2 and 3 ranks, one in float64 (the outputs keep the
    inputs' dtype): both outputs, the inputs afterwards, the ops called and bytes sent.

    Hint: a rank updates only its own shard. Which collective gives it just the averaged
    gradient of that shard, and which one brings the updated shards to everyone?
    """
    # BEGIN SOLUTION
    layout = FlatLayout.of(params, world_size)
    grad = torch.empty(layout.shard_numel, dtype=momentum.dtype)
    comm.reduce_scatter(grad, flatten(grads, layout), op="avg", tag="ex3.3/grads", group=group)
    momentum = beta * momentum + grad
    param_shard = shard(flatten(params, layout), layout, rank) - lr * momentum
    flat_params = torch.empty(layout.padded_numel, dtype=param_shard.dtype)
    comm.all_gather(flat_params, param_shard, tag="ex3.3/params", group=group)
    return unflatten(flat_params, layout), momentum
    # END SOLUTION
