"""ZeRO++: ZeRO-3 with fewer of its bytes crossing between nodes.

    engine = zerolab.ZeroPP(model, torch.optim.AdamW, quantize_weights=True,
                            secondary_shard_size=2, lr=1e-3)

What changes from ZeRO-3 (zero3.py): how a unit's weights travel (`_gather`), hpZ's secondary
shard kept between forward and backward (`post_forward`, `post_backward`), and how its
gradients are reduced (`_reduce`, with parts/qgz.py's `quantized_reduce_scatter`).

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
- qgZ, quantize_grads=True ("int8", or "int4"): the gradients' reduce-scatter sends block-
  quantised chunks, in two all-to-alls: inside the node, then across nodes (below). The nodes
  are hpZ's (secondary_shard_size=k) or node_size=k. The optimizer steps with the result.

The paper's accounting, per step, across nodes: ZeRO-3 3Ψ (Ψ forward gather, Ψ backward
gather, Ψ reduce-scatter) -> qwZ 0.5Ψ (fp16 -> int8) + hpZ 0 + qgZ 0.25Ψ = 0.75Ψ, "4x less".
In fp32, as zerolab trains, int8 is a quarter of the forward gather, not a half.

qgZ sends int8 by default: from zerolab's fp32 gradients that is the paper's ratio (its int4
of fp16: a quarter of the bytes), rounded 18 times finer than int4 (a step of max/127 against
max/7), and each value is rounded twice. quantize_grads="int4" packs two values per byte and
halves the bytes again; notebook 09 measures what each costs the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.parts.mesh import Nodes, make_nodes
from zerolab.parts.qgz import quantized_reduce_scatter
from zerolab.parts.quantize import BLOCK, dequantize_int8, quantize_int8
from zerolab.sharding import flatten
from zerolab.units import Unit
from zerolab.wire.backends import Joined
from zerolab.zero2 import GradShardedBucket
from zerolab.zero3 import ZeRO3, ZeRO3Options

GRAD_BITS = {True: 8, "int8": 8, "int4": 4}  # quantize_grads= -> bits per gradient value


@dataclass(frozen=True)
class ZeroPPOptions(ZeRO3Options):
    """ZeRO-3's keyword arguments and ZeRO++'s three ideas (the module docstring)."""

    quantize_weights: bool = False  # qwZ: the forward all-gather in int8
    secondary_shard_size: int | None = None  # hpZ: k ranks a node; None or 0 is off
    quantize_grads: bool | str = False  # qgZ: True / "int8", or "int4"
    node_size: int | None = None  # qgZ's nodes when hpZ is off


class ZeroPP(ZeRO3):
    """ZeRO-3 with qwZ (int8 forward gather), hpZ (a secondary shard: backward gathers inside
    the node) and/or qgZ (quantised gradients, reduced inside then across nodes)."""

    name = "zeropp"
    steps_whole_params = False  # matrix optimizers: refused (untested here: ZeRO-1/2/3 take them)
    Options = ZeroPPOptions

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer],
                 **kwargs: Any):
        # What makes no sense is refused before anything is built.
        secondary, node_size = kwargs.get("secondary_shard_size"), kwargs.get("node_size")
        grad_bits = _grad_bits(kwargs.get("quantize_grads", False), secondary, node_size)
        size, group = secondary or node_size, kwargs.get("group")
        if size and not secondary and dist.get_world_size(group) % size:
            raise ValueError(f"{dist.get_world_size(group)} ranks do not split into nodes of "
                             f"node_size={size}")
        super().__init__(model, optimizer_cls, **kwargs)
        self.grad_bits = grad_bits  # qgZ: bits per gradient value, None when off
        self.nodes: Nodes | None = make_nodes(size, group) if size else None
        self.secondary: dict[str, torch.Tensor] = {}  # bucket name -> (padded_numel / k,)

    @property
    def keeps_root(self) -> bool:
        """qwZ: the root's forward weights are int8-rounded; backward gathers the exact ones."""
        return not self.options.quantize_weights

    # ---- how a unit's weights travel -----------------------------------------------------------

    def _gather(self, b: GradShardedBucket, phase: str, async_op: bool) -> comm.Handle:
        if phase == "bwd" and b.name in self.secondary:  # hpZ: inside the node only
            return comm.all_gather(b.flat_param, self.secondary[b.name],
                                   tag=f"{self.name}/{phase}/{b.name}", group=self.nodes.node,
                                   async_op=async_op)
        if phase == "fwd" and self.options.quantize_weights:  # qwZ
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
        if self.options.secondary_shard_size and not unit.in_backward:
            for u in self._freed_after_forward(unit, output):  # what is about to be freed
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

    # ---- qgZ: the gradients' reduce-scatter, quantised, in two hops ----------------------------

    def _reduce(self, bucket: GradShardedBucket, phase: str) -> None:
        """ZeRO-2's _reduce (zero2.py) with qgZ's exchange in place of its reduce-scatter."""
        if self.grad_bits is None:
            return super()._reduce(bucket, phase)
        self._wait_pending()  # at most one bucket in flight: bounded memory
        bucket.reduced = True
        full = flatten([p.grad if p.grad is not None else torch.zeros(
            shape, dtype=bucket.flat_param.dtype, device=bucket.flat_param.device)
            for p, shape in zip(bucket.params, bucket.layout.shapes)], bucket.layout)
        for p in bucket.params:
            p.grad = None  # (padded_numel,) `full` is all that is left of them
        received = torch.empty_like(bucket.grad_shard)  # (shard_numel,), added by _accumulate
        self.in_flight.add(full, received)
        bucket.grad_is_zero = False
        handle = quantized_reduce_scatter(received, full, self.nodes, bits=self.grad_bits,
                                          tag=f"{self.name}/{phase}/{bucket.name}",
                                          in_flight=self.in_flight)
        self._pending.append((handle, lambda: self._accumulate(bucket, received, full)))


def _grad_bits(quantize_grads: bool | str, secondary_shard_size: int | None,
               node_size: int | None) -> int | None:
    """qgZ's bits per gradient value (None: off), once its arguments are known to make sense."""
    if not quantize_grads:
        if node_size:
            raise TypeError(f"node_size={node_size} says where qgZ's nodes are, and qgZ is off: "
                            f"pass quantize_grads=True too (hpZ's nodes: secondary_shard_size)")
        return None
    if not (quantize_grads is True or quantize_grads in ("int8", "int4")):
        raise ValueError(f"quantize_grads={quantize_grads!r}: expected True (int8), 'int8' or "
                         f"'int4'")
    if not dist.is_initialized():
        raise ValueError("qgZ needs a process group: run it on ranks (zerolab.launch)")
    if not (secondary_shard_size or node_size):
        raise ValueError("qgZ reduces inside each node, then across nodes: say what a node is, "
                         "node_size=k (k consecutive ranks per node) or, with hpZ, "
                         "secondary_shard_size=k")
    if secondary_shard_size and node_size and secondary_shard_size != node_size:
        raise ValueError(f"secondary_shard_size={secondary_shard_size} and node_size={node_size} "
                         f"name different nodes: hpZ and qgZ share one, give one of them")
    return GRAD_BITS[quantize_grads]
