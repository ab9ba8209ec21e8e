"""Exercises for notebook 07: when ZeRO pays, from the formulas.

Check your answers with `grade("ex07")` in the notebook, or `python -m zerolab.grade ex07`.
"""

from __future__ import annotations

import math

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

# Bytes per parameter of (parameters, gradients, optimizer state K) with Adam.
PRECISION_BYTES = {"fp32": (4, 4, 8), "mixed": (2, 2, 12)}


def largest_model(memory_bytes: float, world_size: int, stage: str,
                  precision: str = "fp32") -> int:
    """Exercise 7.1: The largest model whose model states fit in each rank's memory.

    Inputs: memory_bytes: what one rank may use for model states. world_size: N ranks.
    stage: one of STAGES. precision: "fp32" (params 4, grads 4, Adam's K = 8 bytes per
    parameter) or "mixed" (the paper's 2 + 2 + K = 12: fp32 master weights, m and v); see
    PRECISION_BYTES.
    Returns: an int: the largest whole number of parameters Ψ whose params + grads +
    optimizer state on one rank (sharded as in 1.1; ignore activations and padding) fit in
    memory_bytes.
    Example: 80 GB (80e9 bytes) on 8 ranks, "ZeRO-3", "mixed" -> 40e9 parameters; the same
    with DDP: 5e9.
    Graded on: 80e9 and 24e9 bytes, and a few hundred bytes (where a fraction of a
    parameter is left over); N = 1, 3, 5, 8, 9 and 64; every stage; both precisions.
    Compared exactly (mind float rounding: in floats, 80e9 // 3.2 is 24999999999.0).

    Hint: one rank holds Ψ times (the bytes one parameter costs on that rank). Which whole Ψ
    is the largest that fits?
    """
    # BEGIN SOLUTION
    from fractions import Fraction  # memory_bytes as an exact number, whatever its type

    param_bytes, grad_bytes, k = PRECISION_BYTES[precision]
    level = STAGES.index(stage)
    n = world_size
    # In N-ths of a byte, so that every number is whole: a float 16/3 or 3.2 is not exact,
    # and the floor of an inexact quotient can miss by one parameter.
    per_param_n = (param_bytes * (1 if level >= 3 else n) + grad_bytes * (1 if level >= 2 else n)
                   + k * (1 if level >= 1 else n))
    return math.floor(Fraction(memory_bytes) * n / per_param_n)
    # END SOLUTION


def ring_time(nbytes: float, world_size: int, op: str, bandwidth: float,
              latency: float) -> float:
    """Exercise 7.2: How long a ring collective takes, by the latency-bandwidth model.

    Inputs: nbytes: S, the full tensor's bytes. world_size: N ranks in a ring. op:
    "all_reduce", "reduce_scatter" or "all_gather". bandwidth: bytes per second one link
    carries; latency: seconds each message costs.
    Returns: the seconds, a float (0.0 on one rank). In the model, the ring runs in steps;
    in each, every rank sends one message to its neighbour, all at once, and a step costs
    latency + (the message's bytes) / bandwidth.
    Example: an all-reduce of 28e9 bytes (7B fp32 gradients) on 8 ranks, 100e9 B/s, no
    latency: 0.49 s.
    Graded on: S = 28e9 and 1000 bytes; N = 1, 2, 3 and 8; each op; latency 0 and 5 µs.

    Hint: how many steps does each ring collective take, and how big is one message?
    """
    # BEGIN SOLUTION
    steps = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}[op] * (world_size - 1)
    return steps * (latency + nbytes / world_size / bandwidth)
    # END SOLUTION
