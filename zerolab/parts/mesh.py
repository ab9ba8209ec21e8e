"""Ranks as nodes: groups of `size` consecutive ranks, and the groups that cross them.

On one machine, zerolab pretends a node is a group of consecutive ranks: with 4 ranks and
size 2, ranks {0, 1} are node 0 and {2, 3} node 1. Collectives inside a node group stay on the
fast intra-node links (NVLink on a GPU server); collectives across nodes go over the network.
HSDP shards inside a node and replicates across nodes; ZeRO++'s hpZ keeps a secondary shard
inside the node. (FSDP2 builds the same thing as a 2-D DeviceMesh: ("replicate", "shard").)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Nodes:
    """This rank's place among nodes of `size` consecutive ranks."""

    size: int  # ranks per node
    count: int  # nodes
    node: dist.ProcessGroup  # the ranks of this rank's node
    across: dist.ProcessGroup  # one rank per node: those at this rank's position in theirs


def make_nodes(size: int, group: dist.ProcessGroup | None = None) -> Nodes:
    """Split `group` (default: every rank) into nodes of `size` consecutive ranks.

    Collective: every rank of `group` must call it (creating a process group is collective,
    and every rank creates every group, in the same order).
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(
        range(dist.get_world_size()))
    if not isinstance(size, int) or size < 1 or len(ranks) % size:
        raise ValueError(f"{len(ranks)} ranks do not split into nodes of {size}: the world size "
                         f"must be a multiple of shard_size / secondary_shard_size")
    count = len(ranks) // size
    nodes = [dist.new_group(ranks[i * size:(i + 1) * size]) for i in range(count)]
    across = [dist.new_group(ranks[j::size]) for j in range(size)]
    me = ranks.index(dist.get_rank())
    return Nodes(size, count, nodes[me // size], across[me % size])
