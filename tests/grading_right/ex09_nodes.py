"""Exercises for notebook 09: past one node, HSDP and ZeRO++.

Check your answers with `grade("ex09")` in the notebook, or `python -m zerolab.grade ex09`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations

import torch

STRATEGIES = ("ZeRO-3", "HSDP")


def inter_node_bytes(num_params: float, world_size: int, node_size: int,
                     strategy: str) -> float:
    """Exercise 9.1: The bytes one rank sends to other nodes in one step, as the paper counts.

    Inputs: num_params: Ψ, trained in fp32 (4 bytes per parameter and per gradient).
    world_size: N ranks, in nodes of node_size consecutive ranks (N is a multiple of it).
    strategy: "ZeRO-3" (every collective over all N ranks), or "HSDP" (ZeRO-3 inside each
    node, shard_size = node_size, and the nodes replicas of one another); see STRATEGIES.
    Returns: a float: the bytes one rank sends in one training step in collectives that span
    more than one node, by the ring model (a ring all-gather or reduce-scatter over n ranks
    sends (n-1)/n of the full tensor, an all-reduce twice that), counting every byte of such a
    collective as inter-node, and nothing of a collective inside one node. Ignore padding.
    Example: Ψ = 1000, N = 4, nodes of 2: "ZeRO-3" 9,000.0 bytes, "HSDP" 2,000.0.
    Graded on: Ψ from 1,000 to 70e9, N from 1 to 1,024, nodes from one rank to the whole
    world, both strategies. Compared to within 1e-6 (relative).

    Hint: list the collectives of one step of each strategy: which group does each run in,
    and how many bytes is its full tensor?
    """
    def ring(n, nbytes, passes):
        return passes * (n - 1) / n * nbytes if n > 1 else 0.0
    nodes = world_size // node_size
    if nodes == 1:
        return 0.0
    full = 4.0 * num_params
    if strategy == "ZeRO-3":
        return ring(world_size, full, 3)
    return ring(nodes, full / node_size, 2)


def quantize_int8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 9.2: Block-wise int8 quantisation, as ZeRO++'s qwZ sends weights.

    Inputs: x: a 1-D float32 tensor of n elements (n >= 1); block: elements per block. The
    blocks are x[0:block], x[block:2 * block], ...; the last one may be shorter.
    Returns: (values, scales). scales: float32, one per block, shape (ceil(n / block),):
    the block's largest magnitude divided by 127. values: int8, shape (n,): each element
    divided by its block's scale and rounded to the nearest integer (torch.round), so in
    [-127, 127]. A block of zeros has scale 0 and values 0. Leave x unchanged.
    Example: x = [0.5, -1.0, 0.25, 2.0], block 2 -> scales [1/127, 2/127], values
    [64, -127, 16, 127] (0.5 * 127 = 63.5 rounds to the even 64).
    Graded on: random tensors with an outlier, sizes that are not a multiple of the block,
    a block of zeros, a tensor of zeros, one element, blocks of 1, 64 and 256. Values compared
    exactly, scales to within 1e-5 (relative).

    Hint: view x, padded with zeros to a whole number of blocks, as (blocks, block).
    """
    n = x.numel()
    values = torch.empty(n, dtype=torch.int8)
    scales = []
    for start in range(0, n, block):
        chunk = x[start:start + block].float()
        scale = chunk.abs().max() / 127
        scales.append(scale)
        q = torch.round(chunk / scale) if scale > 0 else torch.zeros_like(chunk)
        values[start:start + block] = q.to(torch.int8)
    return values, torch.stack(scales)


def dequantize_int8(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """Exercise 9.3: Back from block-wise int8 to float32.

    Inputs: values: int8, shape (n,); scales: float32, shape (ceil(n / block),); block: as in
    9.2 (element i belongs to block i // block).
    Returns: a float32 tensor of shape (n,): each value times its block's scale. Then every
    element is within max|x in its block| / 254 of the x that 9.2 quantised.
    Example: values [64, -127, 16, 127], scales [1/127, 2/127], block 2 ->
    [0.5039, -1.0, 0.252, 2.0].
    Graded on: the outputs of 9.2's solution on 9.2's tensors. Compared to within 1e-5
    (relative).

    Hint: which scale does element i use?
    """
    n = values.numel()
    return values.to(torch.float32) * scales[torch.arange(n) // block]
