"""Exercise for notebook 04: ZeRO-2's gradient hook.

The function runs on every rank at once (the grader spawns world_size processes and calls it
on each, with the same `group`): talk to the other ranks only through zerolab.comm, which
records every call with a tag.

Check your answer with `grade("ex04")` in the notebook, or `python -m zerolab.grade ex04`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.sharding import FlatLayout, flatten


def reduce_scatter_bucket(params: list[torch.Tensor], grad_shard: torch.Tensor, rank: int,
                          world_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Exercise 4.1: The ZeRO-2 hook: reduce-scatter a bucket, keep your shard, free the rest.

    Runs during backward, as soon as every parameter of a bucket has its gradient.
    params: the bucket's parameters, each with a full .grad (this rank's, the param's shape).
    grad_shard: (shard_numel,), this rank's shard of the bucket's averaged gradient so far,
    in the flat padded layout of the bucket (3.1). It is not zero when gradients are being
    accumulated over several micro-batches.

    1. Flatten the .grads into one padded buffer (padded_numel,).
    2. Reduce-scatter it with op="avg" (zerolab.comm, a tag, `group`) into a new (shard_numel,).
    3. Add that into grad_shard, in place.
    4. Free the full gradients: p.grad = None for every parameter. This is the saving of
       ZeRO-2: only one bucket's full gradients are ever alive at once.
    Returns nothing: the results are grad_shard (changed in place) and the freed .grad.

    Hint: zerolab.sharding's FlatLayout.of(params, world_size) and flatten(tensors, layout);
    `grad_shard += received` changes it in place, `grad_shard = ...` would not.
    """
    raise NotImplementedError(
        "Exercise 4.1: The ZeRO-2 hook: reduce-scatter a bucket, keep your shard, free the rest.")
