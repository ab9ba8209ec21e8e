"""Each collective as the messages that carry it, backend by backend: how many the busiest rank
sends one after another, and how many bytes in all. The link model (zerolab.cost) prices each
message at alpha seconds and each byte at beta.

What runs is what zerolab.wire.backends says (N ranks, a tensor of S bytes):

    op              gloo (what zerolab runs)                      NCCL (rings)
    all_reduce      gloo's ring: 2(N-1) messages of S/N           the same
    reduce_scatter  one message of S/N to each other rank: N-1    ring: N-1 of S/N
    all_gather      N binomial-tree broadcasts of S/N: each rank  ring: N-1 of S/N
                    sends N-1 shards over the N trees
    broadcast       binomial tree: the root sends S to each of    pipelined ring: every rank
                    its ceil(log2 N) children                     but one forwards S

So on gloo the three collectives the engines run send exactly the ring model's bytes
(zerolab.theory.ring_sent_bytes: notebook 07 measures them on the wire), and as many messages
as the ring has steps; gloo's broadcast does not: its root sends ceil(log2 N) copies of S.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


@dataclass(frozen=True)
class Messages:
    """One collective on the busiest rank: what the link model prices."""

    count: int  # messages it sends one after another (each costs alpha)
    nbytes: float  # bytes it sends in all (each costs beta)
    how: str  # what runs, in words: "gloo's ring: 2(N-1) messages of S/N"


def messages(op: str, nbytes: float, world_size: int, backend: str = "gloo") -> Messages:
    """The messages the busiest rank sends for `op` over a tensor of S = `nbytes` bytes."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {OPS}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; expected 'gloo' or 'nccl'")
    n, s = world_size, nbytes
    if n < 1:
        raise ValueError(f"world_size must be >= 1, got {n}")
    if n == 1:
        return Messages(0, 0.0, "one rank: nothing to send")
    if op == "all_reduce":
        return Messages(2 * (n - 1), 2 * (n - 1) / n * s,
                        f"{'gloo' if backend == 'gloo' else 'NCCL'} ring: 2(N-1) messages of S/N")
    if op in ("reduce_scatter", "all_gather") and backend == "nccl":
        return Messages(n - 1, (n - 1) / n * s, "NCCL ring: N-1 messages of S/N")
    if op == "reduce_scatter":
        return Messages(n - 1, (n - 1) / n * s, "one message of S/N to each other rank")
    if op == "all_gather":
        return Messages(n - 1, (n - 1) / n * s, "N tree broadcasts: N-1 shards of S/N each")
    if backend == "nccl":
        return Messages(n - 1, s, "NCCL pipelined ring: N-1 steps, S forwarded")
    depth = math.ceil(math.log2(n))  # the root's children in gloo's binomial tree
    return Messages(depth, depth * s, "gloo binomial tree: the root sends S per child")
