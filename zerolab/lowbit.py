"""ZeRO-3 with fewer bits on the wire: parameters gathered in bf16 or float8, gradients reduced
in bf16, while every rank keeps and steps fp32 shards.

    from zerolab.lowbit import LowBitZeRO3
    engine = LowBitZeRO3(model, torch.optim.AdamW, gather="float8", lr=1e-3)
    engine = LowBitZeRO3(model, torch.optim.AdamW, gather="bf16", reduce="bf16", lr=1e-3)

What changes from ZeRO-3 (zero3.py): how a unit's weights travel (`_gather`, in forward and in
backward alike) and in what dtype its gradients are reduced (`_reduce`), never when.

- gather="bf16": each rank casts its fp32 shard to bf16, the all-gather moves 2 bytes an
  element, every rank widens the result back into flat_param (FSDP2's MixedPrecisionPolicy
  with param_dtype=bf16 gathers the same bytes; it also computes in bf16, this engine in fp32).
- gather="float8": e4m3 codes, 1 byte an element (parts/float8.py), with a scale per tensor
  (float8_block=None: the unit's T amaxes all-reduced first, 2(N-1)/N·4T bytes) or per block
  of float8_block elements (gathered beside the codes). As torchtitan's float8 all-gather, but
  the matmuls here run in fp32 on the widened weights: only what travels is rounded.
- reduce="bf16": the unit's fp32 gradients are cast to bf16, reduce-scattered (each addition
  in bf16), and widened before they are added to the fp32 gradient shard: FSDP2's
  reduce_dtype=torch.bfloat16.

Forward and backward compute with the rounded weights, so the gradient is the rounded model's
(as torchtitan's); the optimizer steps exact fp32 shards. `exact_wire()` runs what is inside it
with fp32 gathers and reductions: the same engine, the same weights, a reference gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerolab import comm
from zerolab.parts import float8
from zerolab.sharding import flatten
from zerolab.wire.backends import Joined
from zerolab.zero2 import GradShardedBucket
from zerolab.zero3 import ZeRO3, ZeRO3Options

GATHERS = ("fp32", "bf16", "float8")
REDUCES = ("fp32", "bf16")


@dataclass(frozen=True)
class LowBitOptions(ZeRO3Options):
    """ZeRO-3's keyword arguments, and what the wire carries."""

    gather: str = "fp32"  # "fp32", "bf16" or "float8": the parameters' all-gathers
    float8_block: int | None = None  # float8: None, a scale per tensor; k, one per k elements
    reduce: str = "fp32"  # "fp32" or "bf16": the gradients' reduce-scatter


class LowBitZeRO3(ZeRO3):
    """ZeRO-3 whose gathers travel in bf16 or float8 and whose reductions travel in bf16."""

    name = "lowbit"
    Options = LowBitOptions

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer],
                 **kwargs: Any):
        _check(kwargs)  # before anything is built
        super().__init__(model, optimizer_cls, **kwargs)
        self.gather_format, self.reduce_format = self.options.gather, self.options.reduce

    @contextlib.contextmanager
    def exact_wire(self) -> Iterator[None]:
        """fp32 gathers and reductions inside: the reference for the same weights and batch."""
        saved = self.gather_format, self.reduce_format
        self.gather_format, self.reduce_format = "fp32", "fp32"
        try:
            yield
        finally:
            self.gather_format, self.reduce_format = saved

    # ---- how a unit's weights travel -----------------------------------------------------------

    def _gather(self, b: GradShardedBucket, phase: str, async_op: bool) -> comm.Handle:
        if self.gather_format == "bf16":
            return self._gather_bf16(b, phase, async_op)
        if self.gather_format == "float8":
            return self._gather_float8(b, phase, async_op)
        return super()._gather(b, phase, async_op)

    def _gather_bf16(self, b: GradShardedBucket, phase: str, async_op: bool) -> Joined:
        shard = b.local_shard.detach().to(torch.bfloat16)  # (shard_numel,)
        full = torch.empty(b.layout.padded_numel, dtype=torch.bfloat16, device=shard.device)
        self.in_flight.add(shard, full)
        handle = comm.all_gather(full, shard, tag=f"{self.name}/{phase}/{b.name}.bf16",
                                 group=self.group, async_op=async_op)
        return Joined([handle], lambda: b.flat_param.copy_(full))  # widened to fp32

    def _gather_float8(self, b: GradShardedBucket, phase: str, async_op: bool) -> Joined:
        layout, shard = b.layout, b.local_shard.detach()  # (shard_numel,) fp32
        n, start = layout.padded_numel, layout.shard_range(self.rank)[0]
        tag, block = f"{self.name}/{phase}/{b.name}", self.options.float8_block
        offsets, numels = layout.offsets, [s.numel() for s in layout.shapes]
        if block is None:  # a scale per tensor: every rank must use the same one
            amax = float8.tensor_amax(shard, offsets, numels, start)  # (T,) this shard's
            comm.all_reduce(amax, op="max", tag=f"{tag}.amax", group=self.group)
            scales = float8.scale_of(amax)  # (T,) now the tensors' own
            mine = float8.tensor_scales(scales, offsets, numels, start, start + shard.numel())
            codes = float8.quantize(shard, mine)
            all_codes = torch.empty(n, dtype=torch.uint8, device=shard.device)
            self.in_flight.add(codes, all_codes)
            handles = [comm.all_gather(all_codes, codes, tag=f"{tag}.float8", group=self.group,
                                       async_op=async_op)]

            def widen() -> None:
                b.flat_param.copy_(float8.dequantize(
                    all_codes, float8.tensor_scales(scales, offsets, numels, 0, n)))
        else:  # a scale per block of the shard, gathered beside the codes
            scales = float8.block_scales(shard, block)  # (blocks,)
            codes = float8.quantize(shard, float8.per_element(scales, block, shard.numel()))
            all_codes = torch.empty(n, dtype=torch.uint8, device=shard.device)
            all_scales = torch.empty(self.world_size * scales.numel(), device=shard.device)
            self.in_flight.add(codes, scales, all_codes, all_scales)
            handles = [comm.all_gather(all_codes, codes, tag=f"{tag}.float8", group=self.group,
                                       async_op=async_op),
                       comm.all_gather(all_scales, scales, tag=f"{tag}.scales",
                                       group=self.group, async_op=async_op)]

            def widen() -> None:  # row r: rank r's shard, with rank r's scales
                rows = b.flat_param.view(self.world_size, -1)
                for row, c, s in zip(rows, all_codes.view(self.world_size, -1),
                                     all_scales.view(self.world_size, -1)):
                    row.copy_(float8.dequantize(c, float8.per_element(s, block, c.numel())))
        return Joined(handles, widen)

    # ---- in what dtype gradients are reduced ---------------------------------------------------

    def _reduce(self, bucket: GradShardedBucket, phase: str) -> None:
        """ZeRO-2's _reduce (zero2.py), in bf16 on the wire when reduce_format is "bf16"."""
        if self.reduce_format == "fp32":
            return super()._reduce(bucket, phase)
        self._wait_pending()  # at most one bucket in flight: bounded memory
        bucket.reduced, bucket.stepped = True, False
        full = flatten([p.grad if p.grad is not None else torch.zeros(
            shape, device=bucket.flat_param.device)
            for p, shape in zip(bucket.params, bucket.layout.shapes)],
            bucket.layout).to(torch.bfloat16)  # (padded_numel,) bf16
        for p in bucket.params:
            p.grad = None
        received = torch.empty(bucket.layout.shard_numel, dtype=torch.bfloat16,
                               device=full.device)
        self.in_flight.add(full, received)
        first, bucket.grad_is_zero = bucket.grad_is_zero, False
        handle = comm.reduce_scatter(received, full, op="avg",
                                     tag=f"{self.name}/{phase}/{bucket.name}.bf16",
                                     group=self.group, async_op=True, scratch_input=True)
        self._pending.append((handle, lambda: self._widen(bucket, received, full, first)))

    def _widen(self, bucket: GradShardedBucket, received: torch.Tensor, full: torch.Tensor,
               first: bool) -> None:
        """The bf16 average (shard_numel,), into the fp32 gradient shard. `full` is passed only
        to keep it alive until the reduce-scatter that reads it is done."""
        if first:
            bucket.grad_shard.copy_(received)
        else:
            bucket.grad_shard += received.float()


def _check(kwargs: dict[str, Any]) -> None:
    gather, reduce = kwargs.get("gather", "fp32"), kwargs.get("reduce", "fp32")
    block = kwargs.get("float8_block")
    if gather not in GATHERS:
        raise ValueError(f"gather={gather!r}: expected one of {GATHERS}")
    if reduce not in REDUCES:
        raise ValueError(f"reduce={reduce!r}: expected one of {REDUCES}")
    if block is not None and gather != "float8":
        raise ValueError(f"float8_block={block} scales float8 gathers, and gather={gather!r}: "
                         f"pass gather='float8' too, or leave float8_block out")
    if block is not None and (not isinstance(block, int) or block < 1):
        raise ValueError(f"float8_block={block!r}: a positive number of elements per scale, "
                         f"or None (a scale per tensor)")
    if kwargs.get("param_dtype") is not None:
        raise ValueError("LowBitZeRO3 keeps fp32 shards and rounds only what travels: leave "
                         "param_dtype out (gather='bf16' is the bf16 gather)")
