"""Exercises for notebook 07: when ZeRO pays, from the formulas.

Check your answers with `grade("ex07")` in the notebook, or `python -m zerolab.grade ex07`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations

import math

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

# Bytes per parameter of (parameters, gradients, optimizer state K) with Adam.
PRECISION_BYTES = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


def largest_model(memory_bytes: float, world_size: int, stage: str,
                  precision: str = "fp32") -> int:
    """Exercise 7.1: The largest model whose model states fit in each rank's memory.

    memory_bytes: what one rank may use for model states. world_size: N ranks. stage: one of
    STAGES. precision: "fp32" (params 4, grads 4, Adam K = 8 bytes per parameter) or "mixed"
    (the paper's 2 + 2 + K = 12: fp32 master weights, m and v); see PRECISION_BYTES.
    Return the largest whole number of parameters Ψ whose params + grads + optimizer state per
    rank fit in memory_bytes (as in 1.1: ZeRO-1 shards the optimizer state, ZeRO-2 also the
    gradients, ZeRO-3 also the parameters; ignore activations and padding).

    Example: 80 GB (80e9 bytes) on 8 ranks, "ZeRO-3", "mixed": 16 bytes per parameter / 8 =
    2 bytes per parameter per rank -> 40e9 parameters. The same with DDP: 5e9.

    Hint: the bytes per rank are (bytes per parameter per rank) * Ψ; math.floor the quotient.
    """
    raise NotImplementedError(
        "Exercise 7.1: The largest model whose model states fit in each rank's memory.")


def ring_time(nbytes: float, world_size: int, op: str, bandwidth: float,
              latency: float) -> float:
    """Exercise 7.2: How long a ring collective takes, by the latency-bandwidth model.

    nbytes: S, the full tensor's bytes. op: "all_reduce", "reduce_scatter" or "all_gather".
    bandwidth: bytes per second one link carries; latency: seconds each message costs.
    A ring reduce-scatter or all-gather over N ranks runs N - 1 steps, an all-reduce 2(N - 1)
    (a reduce-scatter then an all-gather). In a step every rank sends one chunk of S/N bytes
    to its neighbour, all at once, so a step takes latency + (S/N) / bandwidth.
    Return the seconds (0.0 on one rank).

    Example: all-reduce of 28e9 bytes (7B fp32 gradients) on 8 ranks, 100e9 B/s, no
    latency: 14 steps of 3.5e9 bytes: 0.49 s.

    Hint: the bytes each rank sends, steps * S/N, approach 2S for an all-reduce however many
    ranks there are: the time hardly grows with N, until the latency term dominates.
    """
    raise NotImplementedError(
        "Exercise 7.2: How long a ring collective takes, by the latency-bandwidth model.")
