"""Exercises for notebook 02: collectives, and the ring algorithms behind them.

Each function runs on every rank at once (the grader spawns world_size processes and calls it
on each, with the same `group`). Talk to the other ranks only through zerolab.comm, which
records every call with a tag: the grader compares what you send with the textbook figure.
Ranks are the global ranks: the grader's group holds every rank, in order.

Check your answers with `grade("ex02")` in the notebook, or `python -m zerolab.grade ex02`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, rank: int, world_size: int,
                  group: dist.ProcessGroup | None = None, tag: str = "ring") -> None:
    """Send `send` to the next rank, receive `recv` from the previous one (given: no exercise).

    send, recv: tensors of the same shape (recv is filled in place; it may be a view).
    A blocking send waits until the receiver posts its recv: if every rank sent first, every
    rank would wait forever. So even ranks send then receive, odd ranks receive then send,
    and the ring unblocks from rank 0 (with an odd world size too).
    """
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if rank % 2 == 0:
        comm.send(send, right, tag=f"{tag}/send", group=group)
        comm.recv(recv, left, tag=f"{tag}/recv", group=group)
    else:
        comm.recv(recv, left, tag=f"{tag}/recv", group=group)
        comm.send(send, right, tag=f"{tag}/send", group=group)


def ring_reduce_scatter(tensor: torch.Tensor, rank: int, world_size: int,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 2.1: Reduce-scatter as a ring of sends and receives.

    Inputs: tensor: (world_size * k,), different on every rank: world_size chunks of k; any
    dtype, maybe not contiguous.
    Returns: (k,) of tensor's dtype: chunk number `rank` summed over all ranks (what
    dist.reduce_scatter_tensor gives this rank), in memory of its own holding just those k
    elements (not a view of `tensor`, nor of a bigger working copy kept alive by it).
    Must: leave `tensor` unchanged; talk to the other ranks only through `ring_exchange`
    (one chunk to the next rank and one from the previous per call); send world_size - 1
    chunks in all: (N-1)/N of the tensor's bytes.
    Example (3 ranks; rank r holds chunks [(r+1)*1, (r+1)*2] ** (j+1), j = 0, 1, 2):
    rank 0 returns [6, 12], rank 1 [14, 56], rank 2 [36, 288].
    Graded on: 1, 2 and 3 ranks, chunks of 1 to 3 elements, in float32, float64 and
    bfloat16, and a non-contiguous view: the result on every rank and the memory behind it,
    `tensor` afterwards, the zerolab.comm ops called (send and recv only) and bytes sent.

    Hint: draw 3 ranks and their 3 chunks. Which chunk must each rank send first so that,
    after N-1 steps, rank r holds the complete sum of chunk r?
    """
    # BEGIN SOLUTION
    chunks = [c.clone() for c in tensor.chunk(world_size)]  # each a copy of its own
    for step in range(world_size - 1):
        send_index = (rank - step - 1) % world_size
        recv_index = (rank - step - 2) % world_size
        received = torch.empty_like(chunks[recv_index])
        ring_exchange(chunks[send_index], received, rank, world_size, group,
                      tag=f"ex2.1/step{step}")
        chunks[recv_index].add_(received)
    return chunks[rank]
    # END SOLUTION


def ring_all_gather(shard: torch.Tensor, rank: int, world_size: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 2.2: All-gather as a ring of sends and receives.

    Inputs: shard: (k,), this rank's piece, different on every rank; any dtype, maybe not
    contiguous.
    Returns: (world_size * k,) of the shard's dtype: every rank's shard in rank order (rank
    j's at elements j*k to (j+1)*k), the same on every rank (what
    dist.all_gather_into_tensor gives), in memory of its own (on one rank too: not `shard`).
    Must: leave `shard` unchanged; talk to the other ranks only through `ring_exchange`;
    send world_size - 1 shards in all: (N-1)/N of the output's bytes.
    Graded on: 1, 2 and 3 ranks, shards of 1, 2, 3 and 5 elements, in float32, float64 and
    bfloat16, and a non-contiguous view: the result and its memory, `shard` afterwards, and
    the zerolab.comm ops called (send and recv only) and bytes sent.

    Hint: a rank may pass on a shard it has just received. Which one does it send first?
    """
    # BEGIN SOLUTION
    out = torch.empty(world_size * shard.numel(), dtype=shard.dtype)
    chunks = out.chunk(world_size)
    chunks[rank].copy_(shard)
    for step in range(world_size - 1):
        send_index = (rank - step) % world_size
        recv_index = (rank - step - 1) % world_size
        ring_exchange(chunks[send_index], chunks[recv_index], rank, world_size, group,
                      tag=f"ex2.2/step{step}")
    return out
    # END SOLUTION


def all_reduce_mean(tensor: torch.Tensor, rank: int, world_size: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 2.3: All-reduce = reduce-scatter + all-gather, for a tensor of any size.

    Inputs: tensor: any shape, any numel (not always a multiple of world_size), any dtype,
    maybe not contiguous; different on every rank.
    Returns: a new tensor of the same shape and dtype (on one rank too: not `tensor`): the
    mean over the ranks (what all_reduce with an average gives).
    Must: leave `tensor` unchanged; compute it with zerolab.comm.reduce_scatter followed by
    zerolab.comm.all_gather (with tags and `group`), each on world_size equal chunks, as
    small as they can be. That is the ring all-reduce: each rank sends 2(N-1)/N of the
    (padded) bytes, half in each collective.
    Graded on: shapes (1,), (5, 3), (2 * world_size,), (2, 3, 4); (5, 3) in float64 and
    bfloat16, and as a non-contiguous view; on 1, 2 and 3 ranks: the result and whether it
    is the input's memory, `tensor` afterwards, the ops called and the bytes sent.

    Hint: both collectives need world_size equal chunks. What do you do when numel does not
    divide by world_size, and what do you undo at the end?
    """
    # BEGIN SOLUTION
    flat = tensor.reshape(-1)
    k = -(-flat.numel() // world_size)  # ceil: elements per rank
    padded = torch.zeros(world_size * k, dtype=tensor.dtype)
    padded[:flat.numel()] = flat
    mine = torch.empty(k, dtype=tensor.dtype)
    comm.reduce_scatter(mine, padded, op="avg", tag="ex2.3/reduce_scatter", group=group)
    full = torch.empty(world_size * k, dtype=tensor.dtype)
    comm.all_gather(full, mine, tag="ex2.3/all_gather", group=group)
    return full[:flat.numel()].view(tensor.shape)
    # END SOLUTION
