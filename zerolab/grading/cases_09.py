"""Notebook 09's exercises (ex09_nodes): the inter-node bytes of ZeRO-3 and HSDP, and
block-wise int8 quantisation (ZeRO++'s qwZ) there and back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerolab.grading.exercise import Case, Exercise, tuple_outputs
from zerolab.grading.inputs import fixed, rng
from zerolab.grading.mistakes import DTYPE_LOST, Evidence, Mistake, matches
from zerolab.parts.quantize import quantize_int8

# (N, ranks per node): one rank, one node, a rank per node, notebook 09's 2x2, nodes of 3,
# nodes of 8 GPUs from 2 to 128 nodes.
_LAYOUTS_9_1 = [(1, 1), (4, 4), (4, 1), (4, 2), (12, 3), (16, 8), (64, 8), (1024, 8)]


def _cases_9_1() -> list[Case]:
    return [Case(f"Ψ={psi:g}, N={n}, nodes of {k}, {engine}", fixed(psi, n, k, engine))
            for psi in (1000, 205_184, 7e9, 70e9) for n, k in _LAYOUTS_9_1
            for engine in ("ZeRO-3", "HSDP")]


# name -> (number of values, block, what is special about it); all seeded, the same everywhere
_TENSORS = {
    "1000 values, one outlier (40.0)": (1000, 256),
    "1000 values, a block of zeros (elements 256 to 511)": (1000, 256),
    "513 values: one past two whole blocks, outlier -25.0": (513, 256),
    "700 values, blocks of 64": (700, 64),
    "100 values: less than one block": (100, 256),
    "300 zeros": (300, 256),
    "one value": (1, 256),
    "10 values, blocks of 1": (10, 1),
}


def _tensor(name: str) -> torch.Tensor:
    if name == "the stub's example":
        return torch.tensor([0.5, -1.0, 0.25, 2.0])
    n, _ = _TENSORS[name]
    x = torch.randn(n, generator=rng("9.2", name))
    if name == "300 zeros":
        x.zero_()
    if "block of zeros" in name:
        x[256:512] = 0.0
    if "outlier" in name:
        x[n // 3] = 40.0 if "40" in name else -25.0
    return x


def _block(name: str) -> int:
    return 2 if name == "the stub's example" else _TENSORS[name][1]


_NAMES = [*_TENSORS, "the stub's example"]


def _cases_9_2() -> list[Case]:
    return [Case(name, lambda rank, name=name: (_tensor(name), _block(name))) for name in _NAMES]


def _cases_9_3() -> list[Case]:
    return [Case(f"9.2's solution on: {name}",
                 lambda rank, name=name: (*quantize_int8(_tensor(name), _block(name)),
                                          _block(name)))
            for name in _NAMES]


# ---- what the grader can tell apart ------------------------------------------------------------


def _bytes_9_1(ev: Evidence, *, ring: bool = True, inside_counts: bool = False,
               elements: bool = False, hsdp_over: str = "nodes") -> float:
    """9.1's answer with one thing changed: no (n-1)/n, a collective inside one node counted,
    elements instead of bytes, or HSDP's all-reduce over other ranks or a whole gradient."""
    psi, n, k, engine = ev.inputs()
    full = (1 if elements else 4) * psi

    def sent(factor: int, size: int, nbytes: float) -> float:
        return factor * ((size - 1) / size if ring else 1.0) * nbytes
    if k == n and not inside_counts:
        return 0.0
    if engine == "ZeRO-3":
        return sent(3, n, full)
    if hsdp_over == "world":
        return sent(2, n, full / k)
    return sent(2, n // k, full if hsdp_over == "whole gradient" else full / k)


def _quantized(ev: Evidence, fn: Callable[[torch.Tensor, int], tuple]) -> torch.Tensor:
    """The output under scrutiny ("values" or "scales") of another quantiser on the inputs."""
    values, scales = fn(*ev.inputs())
    return {"values": values, "scales": scales}[ev.output]


def _blockwise(x: torch.Tensor, block: int, divisor: float = 127,
               truncate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    rows = torch.zeros(-(-n // block) * block)
    rows[:n] = x
    rows = rows.view(-1, block)
    scales = rows.abs().amax(dim=1) / divisor
    q = rows / torch.where(scales > 0, scales, 1.0)[:, None]
    q = q.trunc() if truncate else q.round()
    return q.to(torch.int8).reshape(-1)[:n], scales  # 128 wraps to -128, as a learner's does


def _scales_per_element(ev: Evidence, tiled: bool = False, divide: bool = False) -> torch.Tensor:
    values, scales, block = ev.inputs()
    n = values.numel()
    per = scales.repeat(-(-n // scales.numel()))[:n] if tiled else \
        scales.repeat_interleave(block)[:n]
    return values.float() / per if divide else values.float() * per


EXERCISES = [
    Exercise("9.1", "ex09_nodes", "inter_node_bytes",
             "the bytes a rank sends across nodes per step, ZeRO-3 against HSDP",
             "ZeRO-3: two all-gathers and a reduce-scatter of the whole model over all N ranks, "
             "each (N-1)/N of 4Ψ bytes. HSDP: only the all-reduce of each rank's gradient shard "
             "(4Ψ/k bytes) with the ranks at its place in the other nodes, R = N/k of them. "
             "Inside a single node nothing counts.",
             _cases_9_1,
             hints=("ZeRO-3: 3 * (N - 1) / N * 4 * Ψ; HSDP: 2 * (R - 1) / R * 4 * Ψ / k with "
                    "R = N / k; both 0.0 when N == k.",),
             mistakes=(
                 Mistake("a collective inside one node counted",
                         "With node_size == world_size every collective stays inside the one "
                         "node: nothing is inter-node, 0.0.",
                         matches(lambda ev: _bytes_9_1(ev, inside_counts=True))),
                 Mistake("HSDP's all-reduce of the whole gradient",
                         "After the reduce-scatter inside the node, a rank holds 1/k of the "
                         "gradients: that shard, 4Ψ/k bytes, is what it all-reduces.",
                         matches(lambda ev: _bytes_9_1(ev, hsdp_over="whole gradient"))),
                 Mistake("the whole tensor sent, not (n-1)/n of it",
                         "In a ring, a rank never sends its own chunk back to itself: an "
                         "all-gather or reduce-scatter over n ranks sends (n-1)/n of the "
                         "tensor, an all-reduce twice that.",
                         matches(lambda ev: _bytes_9_1(ev, ring=False))),
                 Mistake("elements, not bytes",
                         "fp32: 4 bytes per parameter and per gradient.",
                         matches(lambda ev: _bytes_9_1(ev, elements=True))),
                 Mistake("HSDP's all-reduce taken over every rank",
                         "HSDP all-reduces a gradient shard only with the ranks holding the "
                         "same shard, one per node: R = N / k ranks, not N.",
                         matches(lambda ev: _bytes_9_1(ev, hsdp_over="world")))),
             ),
    Exercise("9.2", "ex09_nodes", "quantize_int8",
             "block-wise int8 quantisation: values and one scale per block",
             "Cut x into blocks of `block` elements (the last one shorter); each block's scale "
             "is its largest |x| / 127, each value torch.round(x / scale) as int8; a block of "
             "zeros has scale 0 and values 0 (do not divide by 0).",
             _cases_9_2,
             outputs=tuple_outputs("values", "scales"),
             hints=("Pad x with zeros to blocks * block elements, view it as (blocks, block), "
                    "take .abs().amax(dim=1) / 127, divide (by 1 where the scale is 0), "
                    "round, .to(torch.int8), and cut the padding off.",),
             mistakes=(
                 Mistake("one scale for the whole tensor",
                         "One scale per block of `block` elements: with one for the whole "
                         "tensor, an outlier costs every other value its precision.",
                         matches(lambda ev: _quantized(
                             ev, lambda x, block: _blockwise(x, x.numel()))), output=""),
                 Mistake("scale = max / 128",
                         "int8 holds -128 to 127: dividing by 127 keeps the block's largest "
                         "value at +-127, the same range both ways.",
                         matches(lambda ev: _quantized(
                             ev, lambda x, block: _blockwise(x, block, divisor=128))),
                         output=""),
                 Mistake("truncated, not rounded",
                         ".to(torch.int8) cuts toward zero; round first (torch.round), so that "
                         "the error stays within half a step.",
                         matches(lambda ev: _quantized(
                             ev, lambda x, block: _blockwise(x, block, truncate=True))),
                         output="values")),
             read_only=("x",)),
    Exercise("9.3", "ex09_nodes", "dequantize_int8",
             "back from block-wise int8: each value times its block's scale",
             "Element i belongs to block i // block: multiply it, as float32, by scales[i // "
             "block].",
             _cases_9_3,
             hints=("values.float() * scales.repeat_interleave(block)[:values.numel()]",),
             mistakes=(
                 Mistake("the scales tiled, not repeated element by element",
                         "scales.repeat(k) gives s0, s1, s2, s0, s1, ...; each scale must "
                         "cover `block` consecutive elements: repeat_interleave(block).",
                         matches(lambda ev: _scales_per_element(ev, tiled=True))),
                 Mistake("divided by the scale",
                         "Quantising divided by the scale; going back multiplies by it.",
                         matches(lambda ev: _scales_per_element(ev, divide=True))),
                 Mistake("the scales repeated past the last element",
                         "The last block may be shorter: cut the repeated scales to n "
                         "elements ([:values.numel()]).",
                         lambda ev: "must match the size" in ev.got, output="raised"),
                 DTYPE_LOST),
             read_only=("values", "scales")),
]
