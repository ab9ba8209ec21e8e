"""Exercises for notebook 01: where the memory of training goes.

Check your answers with `grade("ex01")` in the notebook, or `python -m zerolab.grade ex01`.
"""

from __future__ import annotations

import torch

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def model_state_bytes(num_params: float, world_size: int, stage: str, param_bytes: float = 4,
                      grad_bytes: float = 4, optimizer_bytes: float = 8) -> dict[str, float]:
    """Exercise 1.1: Bytes of parameters, gradients and optimizer state that one rank holds.

    Ψ = num_params parameters are trained on N = world_size ranks. Each parameter costs
    `param_bytes` (4 in fp32), its gradient `grad_bytes` (4 in fp32) and its optimizer state
    `optimizer_bytes` (K: 8 for Adam's m and v in fp32; 12 in mixed precision, where the
    optimizer also keeps fp32 master weights). DDP keeps all three whole on every rank. Each
    ZeRO stage shards one more of them over the N ranks (each rank keeps 1/N):
    ZeRO-1 the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters.

    stage: one of STAGES. Returns {"params": .., "grads": .., "optimizer": ..} in bytes (floats:
    Ψ/N need not be whole; ignore padding).
    Example: Ψ = 7e9, N = 8, "ZeRO-2", fp32 Adam -> {"params": 28e9, "grads": 3.5e9,
    "optimizer": 7e9}: 38.5 GB in all, against 112 GB for DDP.

    Hint: STAGES.index(stage) (0 to 3) says how many of the three categories are sharded.
    """
    # BEGIN SOLUTION
    level = STAGES.index(stage)
    n = world_size
    return {
        "params": param_bytes * num_params / (n if level >= 3 else 1),
        "grads": grad_bytes * num_params / (n if level >= 2 else 1),
        "optimizer": optimizer_bytes * num_params / (n if level >= 1 else 1),
    }
    # END SOLUTION


def distinct_storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Exercise 1.2: Bytes of memory behind `tensors`, each storage counted once.

    A view (a slice, a reshape, a parameter that points into a flat buffer) shares the storage
    of the tensor it was taken from, and a tied weight is the same tensor listed twice: adding
    up numel * element_size per tensor counts that memory several times. Count every storage
    (t.untyped_storage()) once, and count all of it: a small view keeps its whole storage
    alive. A freed storage (0 bytes) counts 0.

    tensors: any shapes and dtypes, on the CPU. Returns bytes, an int.
    Example: a (12,) float32 buffer and three (4,) views into it -> 48, not 96.

    Hint: two tensors share a storage when their t.untyped_storage().data_ptr() are equal;
    a storage's size is t.untyped_storage().nbytes().
    """
    # BEGIN SOLUTION
    seen: set[int] = set()
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
    # END SOLUTION
