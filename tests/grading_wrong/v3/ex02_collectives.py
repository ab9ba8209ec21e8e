"""Wrong on purpose (v3): solutions/ex02_collectives.py with bugs marked # BUG;
exercises without one are the solution as it is.

Exercises for notebook 02: collectives, and the ring algorithms behind them.

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

    tensor: (world_size * k,), different on every rank; think of it as world_size chunks of k.
    Return (k,): chunk number `rank` summed over all ranks (what
    dist.reduce_scatter_tensor gives this rank). Leave `tensor` unchanged.

    The ring runs world_size - 1 steps. In each, every rank sends one chunk (the running sum
    it holds for that chunk) to the next rank with `ring_exchange`, and adds the chunk it
    receives from the previous rank into its own copy of that chunk. At step s, rank r sends
    chunk (r - s - 1) % world_size and receives chunk (r - s - 2) % world_size. After the
    last step chunk r has collected every rank's contribution. Each rank sends world_size - 1
    chunks: (N-1)/N of the tensor's bytes.

    Example (the seeds' 3 ranks): rank r holds chunks [(r+1)*1, (r+1)*2] ** (j+1), j = 0, 1, 2;
    rank 0 returns [6, 12], rank 1 [14, 56], rank 2 [36, 288].

    Hint: chunks = tensor.clone().chunk(world_size) gives views of one copy; receive into a
    fresh torch.empty_like(chunk) and add it. Use a tag per step, e.g. f"ex2.1/step{s}".
    """
    # BEGIN SOLUTION
    # BUG: right values, but an all-reduce sends 2(N-1)/N of the bytes, not a ring's (N-1)/N
    total = tensor.clone()
    comm.all_reduce(total, tag="ex2.1/all_reduce", group=group)
    return total.chunk(world_size)[rank]
    # END SOLUTION


def ring_all_gather(shard: torch.Tensor, rank: int, world_size: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 2.2: All-gather as a ring of sends and receives.

    shard: (k,), this rank's piece. Return (world_size * k,): every rank's shard, in rank
    order, the same on every rank (what dist.all_gather_into_tensor gives).

    The ring runs world_size - 1 steps. In each, every rank sends the shard it received in
    the previous step (its own in the first step) to the next rank with `ring_exchange`.
    At step s, rank r sends shard (r - s) % world_size and receives shard
    (r - s - 1) % world_size. Each rank sends world_size - 1 shards: (N-1)/N of the output.

    Hint: out = torch.empty(world_size * k); chunks = out.chunk(world_size) are views into it;
    copy your shard into chunks[rank], then receive each shard straight into its chunk.
    """
    # BEGIN SOLUTION
    out = torch.empty(world_size * shard.numel(), dtype=shard.dtype)
    chunks = out.chunk(world_size)
    chunks[rank].copy_(shard)
    for step in range(world_size - 1):
        send_index = (rank - step) % world_size
        recv_index = rank - step + 1  # BUG: no % world_size: out of range on the last rank
        ring_exchange(chunks[send_index], chunks[recv_index], rank, world_size, group,
                      tag=f"ex2.2/step{step}")
    return out
    # END SOLUTION


def all_reduce_mean(tensor: torch.Tensor, rank: int, world_size: int,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 2.3: All-reduce = reduce-scatter + all-gather, for a tensor of any size.

    tensor: any shape, any numel (not always a multiple of world_size), different on every
    rank. Return a new tensor of the same shape: the mean over the ranks (what all_reduce
    with op=avg gives), computed as zerolab.comm.reduce_scatter (op="avg") followed by
    zerolab.comm.all_gather, which is how the ring all-reduce works: each rank sends
    2(N-1)/N of the bytes, half in each collective.

    Both collectives need world_size equal chunks: flatten the tensor, pad it with zeros to a
    multiple of world_size, and strip the padding off the gathered result.

    Hint: with k = ceil(numel / world_size), comm.reduce_scatter(mine, padded, op="avg",
    tag=..., group=group) reads padded (world_size * k,) and fills mine (k,);
    comm.all_gather(full, mine, tag=..., group=group) fills full (world_size * k,).
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
    return full[-flat.numel():].view(tensor.shape)  # BUG: as if the padding came first
    # END SOLUTION
