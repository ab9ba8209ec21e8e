"""ZeRO++: ZeRO-3 with fewer of its bytes crossing between nodes.

    engine = zerolab.ZeroPP(model, torch.optim.AdamW, quantize_weights=True,
                            secondary_shard_size=2, lr=1e-3)
    # the same engine, as design.md spells it: zerolab.ZeRO3(model, ..., quantize_weights=True)

What changes from ZeRO-3 (zero3.py): only how a unit's weights travel (`_gather`), and hpZ's
secondary shard kept between forward and backward (`post_forward`, `post_backward`).

ZeRO-3 all-gathers each unit twice per step, in forward and again in backward, over every rank:
2Ψ of its 3Ψ, and on a cluster most of it crosses the slow links between nodes. ZeRO++ (Wang et
al., 2023, https://arxiv.org/abs/2306.10209) cuts that:

- qwZ, quantize_weights=True: the forward all-gather sends int8 values with an fp32 scale per
  block of 256 (quantize.py) instead of fp32: a quarter of the bytes, plus 1.6% for scales.
  The forward computes with the dequantized weights; gradients and the optimizer stay exact.
- hpZ, secondary_shard_size=k: after a unit's forward, before it is freed, each rank keeps a
  *secondary* shard of it: 1/k of the unit, cut so that the k ranks of a node together hold the
  whole unit. Backward then all-gathers inside the node only: no inter-node bytes for it, at
  the cost of Ψ/k more parameter memory per rank between forward and backward. (With qwZ too,
  the secondary shard is cut from the forward's dequantized weights, so backward computes with
  them as well: the exact weights never crossed the nodes.)
- qgZ (int4 gradients with a hierarchical all-to-all reduce-scatter) is not built here: it
  replaces the reduce-scatter by two all-to-alls with quantisation between them, which needs
  an all-to-all that zerolab's gloo path does not time or measure well. The notebook accounts
  for it on paper.

The paper's accounting, per step, across nodes: ZeRO-3 3Ψ (Ψ forward gather, Ψ backward
gather, Ψ reduce-scatter) -> qwZ 0.5Ψ (fp16 -> int8) + hpZ 0 + qgZ 0.25Ψ = 0.75Ψ, "4x less".
In fp32, as zerolab trains, int8 is a quarter of the forward gather, not a half.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.parts.mesh import Nodes, make_nodes
from zerolab.parts.quantize import BLOCK, dequantize_int8, quantize_int8
from zerolab.units import Unit
from zerolab.wire.backends import Joined
from zerolab.zero2 import GradShardedBucket
from zerolab.zero3 import ZeRO3


class ZeroPP(ZeRO3):
    """ZeRO-3 with qwZ (int8 forward gather) and/or hpZ (a secondary shard: backward gathers
    inside the node)."""

    name = "zeropp"
    options = ("quantize_weights", "secondary_shard_size")

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 quantize_weights: bool = False, secondary_shard_size: int | None = None,
                 **kwargs):
        # hpZ's nodes first: ZeRO-3's set-up reshards every unit (post_backward is not run).
        self.quantize_weights = quantize_weights
        self.nodes: Nodes | None = (make_nodes(secondary_shard_size, kwargs.get("group"))
                                    if secondary_shard_size else None)
        self.secondary: dict[str, torch.Tensor] = {}  # bucket name -> (padded_numel / k,)
        super().__init__(model, optimizer_cls, **kwargs)

    # ---- how a unit's weights travel -----------------------------------------------------------

    def _gather(self, b: GradShardedBucket, phase: str, async_op: bool) -> comm.Handle:
        if phase == "bwd" and b.name in self.secondary:  # hpZ: inside the node only
            return comm.all_gather(b.flat_param, self.secondary[b.name],
                                   tag=f"{self.name}/{phase}/{b.name}", group=self.nodes.node,
                                   async_op=async_op)
        if phase == "fwd" and self.quantize_weights:  # qwZ
            return self._gather_int8(b, phase, async_op)
        return super()._gather(b, phase, async_op)

    def _gather_int8(self, b: GradShardedBucket, phase: str, async_op: bool) -> Joined:
        world_size = b.layout.world_size
        q, scales = quantize_int8(b.local_shard.detach())  # (shard_numel,), (blocks,)
        all_q = torch.empty(world_size * q.numel(), dtype=torch.int8, device=q.device)
        all_scales = torch.empty(world_size * scales.numel(), device=q.device)
        self.in_flight.add(q, scales, all_q, all_scales)  # "comm" in a memory trace
        handles = [comm.all_gather(all_q, q, tag=f"{self.name}/{phase}/{b.name}.int8",
                                   group=self.group, async_op=async_op),
                   comm.all_gather(all_scales, scales, tag=f"{self.name}/{phase}/{b.name}.scales",
                                   group=self.group, async_op=async_op)]

        def dequantize() -> None:  # every rank's shard: (world_size, shard_numel)
            rows = b.flat_param.view(world_size, -1)
            for r, (qr, sr) in enumerate(zip(all_q.view(world_size, -1),
                                             all_scales.view(world_size, -1))):
                rows[r].copy_(dequantize_int8(qr, sr, BLOCK))

        return Joined(handles, dequantize)

    # ---- hpZ: the secondary shard, from forward to backward ------------------------------------

    def post_forward(self, unit: Unit, output) -> None:
        if self.nodes is not None and not unit.in_backward:
            for u in self.units if unit is self.root else [unit]:  # what is about to be freed
                for b in u.buckets if u.unsharded else []:
                    self._keep_secondary(b)
        super().post_forward(unit, output)

    def _keep_secondary(self, b: GradShardedBucket) -> None:
        """This rank's part of the node's copy of the unit: 1/k of it, cut so that the k ranks
        of the node together hold the whole unit."""
        k, j = self.nodes.size, dist.get_rank(self.nodes.node)
        part = b.layout.padded_numel // k
        self.secondary[b.name] = b.flat_param[j * part:(j + 1) * part].clone()

    def post_backward(self, unit: Unit) -> None:
        super().post_backward(unit)
        for b in unit.buckets:
            self.secondary.pop(b.name, None)

    def state_tensors(self):
        state = super().state_tensors()
        state["params"] = state["params"] + list(self.secondary.values())
        return state
