"""Exercises for notebook 11: a matrix optimizer on flat shards.

The function runs on every rank at once (the grader spawns world_size processes and calls it
on each, with the same `group`). Talk to the other ranks only through zerolab.comm, which
records every call with a tag: the grader compares what you send with the fewest bytes the
job needs. Ranks are the global ranks: the grader's group holds every rank, in order.

Check your answers with `grade("ex11")` in the notebook, or `python -m zerolab.grade ex11`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.lessons.n11_optimizers import orthogonalize


def sharded_muon_update(grad_shard: torch.Tensor, shape: tuple[int, int], rank: int,
                        world_size: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 11.1: Muon's orthogonalised update, from flat gradient shards.

    Inputs: grad_shard: (k,) this rank's flat shard of a matrix's reduced gradient G, as ZeRO
    keeps it: G (rows, cols) = shape, flattened row-major, padded with zeros to world_size * k
    elements, rank r holding elements r*k to (r+1)*k; float32.
    Returns: (k,) float32, this rank's flat shard, laid out the same way (zeros in the
    padding), of orthogonalize(G) (zerolab.lessons.n11_optimizers: Muon's Newton-Schulz on the
    whole matrix, as torch.optim.Muon computes it). Muon's momentum is elementwise, so it may
    stay sharded: only this step needs the whole matrix.
    Must: orthogonalise the whole matrix once, on rank 0 (the owner), and move the fewest
    bytes: each other rank sends rank 0 its shard once (k elements, padding included) and
    receives its k elements of the update back; nothing else travels (2 (N-1) k elements in
    all). Talk to the other ranks only through zerolab.comm.send and zerolab.comm.recv.
    Leave `grad_shard` unchanged.
    Example (2 ranks, shape (3, 2), G = [[3, 0], [0, 1], [0, 0]]): k = 3; rank 0 holds
    [3, 0, 0], rank 1 [1, 0, 0]. Orthogonalised, G's singular values 3 and 1 both come out
    near 1: rank 0 returns [0.75, 0, 0], rank 1 [1.1328, 0, 0].
    Graded on: 1, 2 and 3 ranks, tall, wide and padded matrices: the shard on every rank, the
    zerolab.comm ops called (send and recv only) and the bytes each rank sent.

    Hint: a flat shard may start mid-row: it is no matrix until one rank holds every shard.
    """
    # BEGIN SOLUTION
    rows, cols = shape
    k = grad_shard.numel()
    if rank != 0:
        comm.send(grad_shard.contiguous(), 0, tag=f"ex11.1/grad/{rank}", group=group)
        mine = torch.empty(k, dtype=grad_shard.dtype)
        comm.recv(mine, 0, tag=f"ex11.1/update/{rank}", group=group)
        return mine
    flat = torch.empty(world_size * k, dtype=grad_shard.dtype)  # (N*k,) the padded gradient
    flat[:k] = grad_shard
    for r in range(1, world_size):
        comm.recv(flat[r * k:(r + 1) * k], r, tag=f"ex11.1/grad/{r}", group=group)
    update = torch.zeros_like(flat)  # (N*k,) zeros in the padding
    update[:rows * cols] = orthogonalize(flat[:rows * cols].view(rows, cols)).reshape(-1)
    for r in range(1, world_size):
        comm.send(update[r * k:(r + 1) * k], r, tag=f"ex11.1/update/{r}", group=group)
    return update[:k].clone()
    # END SOLUTION
