"""Exercise for notebook 04: ZeRO-2's gradient hook.

The function runs on every rank at once (the grader spawns world_size processes and calls it
on each, with the same `group`): talk to the other ranks only through zerolab.comm, which
records every call with a tag.

Check your answer with `grade("ex04")` in the notebook, or `python -m zerolab.grade ex04`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.sharding import FlatLayout, flatten


def reduce_scatter_bucket(params: list[torch.Tensor], grad_shard: torch.Tensor, rank: int,
                          world_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Exercise 4.1: The ZeRO-2 hook: reduce-scatter a bucket, keep your shard, free the rest.

    Runs during backward, as soon as every parameter of a bucket has its gradient.
    Inputs: params: the bucket's parameters, each with a full .grad (this rank's, of the
    param's shape). grad_shard: (shard_numel,), this rank's shard of the bucket's averaged
    gradient so far, in the bucket's flat padded layout (3.1); not zero when gradients are
    accumulated over several micro-batches.
    Returns: nothing. Afterwards: grad_shard (the caller's tensor, changed in place) holds
    its value before plus this rank's shard of the bucket's gradient averaged over the
    ranks; every p.grad is None (the full gradients are freed: ZeRO-2's saving); the params'
    values are unchanged.
    Must: talk to the other ranks through zerolab.comm (a tag, `group`), sending (N-1)/N of
    the bucket's padded gradient bytes.
    Graded on: the groups of 3.1 on 1, 2 and 3 ranks, one in float64, one whose gradients
    are non-contiguous views, grad_shard holding an earlier micro-batch: grad_shard, the .grad
    attributes, the params, the ops called, bytes sent.

    Hint: which collective leaves each rank with the averaged gradient of its shard only?
    """
    # BEGIN SOLUTION
    layout = FlatLayout.of(params, world_size)
    full = flatten([p.grad for p in params], layout)
    for p in params:
        p.grad = None
    received = torch.empty_like(grad_shard)
    comm.reduce_scatter(received, full, op="avg", tag="ex4.1/bucket", group=group)
    grad_shard += received
    # END SOLUTION
