"""HSDP: ZeRO-3 inside each node, plain data parallelism across nodes.

    engine = zerolab.HSDP(model, torch.optim.AdamW, shard_size=2, lr=1e-3)

What changes from ZeRO-3 (zero3.py):
- The ranks are split into nodes of `shard_size` consecutive ranks (mesh.py). The engine's group
  is this rank's node: parameters, gradients and optimizer state are sharded shard_size ways,
  not world_size ways, so a rank holds 16Ψ/k bytes (k = shard_size) instead of 16Ψ/N.
- Every all-gather (forward and backward) and every reduce-scatter runs inside the node.
- The nodes are replicas of one another: after a unit's reduce-scatter inside the node, each
  rank all-reduces its gradient shard with the ranks holding the same shard in the other
  nodes (its `across` group): Ψ/k elements, and the only bytes that leave a node,
  2(R-1)/R · 4Ψ/k bytes per rank per step for R = N/k nodes, against ZeRO-3's 3 · 4Ψ(N-1)/N.

It is FSDP2's HSDP (fully_shard with a 2-D DeviceMesh, ("replicate", "shard")) and the
layout DeepSpeed calls MiCS: more memory per rank than ZeRO-3 over every rank, far fewer
bytes on the slow links.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.parts.materialize import broadcast_from_rank0
from zerolab.parts.mesh import make_nodes
from zerolab.zero2 import GradShardedBucket
from zerolab.zero3 import ZeRO3


class HSDP(ZeRO3):
    name = "hsdp"
    steps_whole_params = False  # matrix optimizers: refused (untested here: ZeRO-1/2/3 take them)

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 shard_size: int, group: dist.ProcessGroup | None = None, **kwargs):
        if not dist.is_initialized():
            raise ValueError("HSDP needs a process group: run it on ranks (zerolab.launch)")
        nodes = make_nodes(shard_size, group)  # raises if the world does not split
        # Replicas must start equal too: ZeRO-3 broadcasts only inside its group (the node).
        broadcast_from_rank0(model, group, tag=f"{self.name}/init")
        super().__init__(model, optimizer_cls, group=nodes.node, **kwargs)
        self.nodes = nodes  # this rank's node (the engine's group) and its replicas (across)
        self.job_group = group  # every rank of the job: checkpoints and recorders span it

    def _accumulate(self, bucket: GradShardedBucket, received: torch.Tensor,
                    full: torch.Tensor) -> None:
        """The node's average of this shard (reduce-scatter, avg over k), then the average
        over the nodes (all-reduce, avg over N/k): the average over every rank."""
        comm.all_reduce(received, op="avg", tag=f"{self.name}/bwd/{bucket.name}.replicas",
                        group=self.nodes.across)
        super()._accumulate(bucket, received, full)
