"""Exercises for notebook 01b (01b_memory): where the memory of training goes.

Check them with `grade("ex01_memory")` in the notebook, or `python -m zerolab.grade ex01_memory`.
"""

from __future__ import annotations

import torch

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def model_state_bytes(num_params: float, world_size: int, stage: str, param_bytes: float = 4,
                      grad_bytes: float = 4, optimizer_bytes: float = 8) -> dict[str, float]:
    """Exercise 1.1: Bytes of parameters, gradients and optimizer state that one rank holds.

    Inputs: Ψ = num_params parameters, trained on N = world_size ranks at `stage` (one of
    STAGES). Each parameter costs `param_bytes`, its gradient `grad_bytes` and its optimizer
    state `optimizer_bytes` (K: 8 for Adam's m and v in fp32; 12 in mixed precision).
    Returns: {"params": .., "grads": .., "optimizer": ..}: the bytes of each that one rank
    holds, as floats (Ψ/N need not be whole; ignore padding).
    Example: Ψ = 7e9, N = 8, "DDP", fp32 Adam (4, 4, 8) -> {"params": 28e9, "grads": 28e9,
    "optimizer": 56e9}: 112 GB on every rank.
    Graded on: every stage; N = 1, 8 and 64; Ψ = 7e9 and 1001; fp32 (4, 4, 8) and mixed
    (2, 2, 12) byte counts. Each of the three values is compared.

    Hint: what does each stage shard over the ranks, and what stays whole on every rank?
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

    Inputs: tensors: any shapes and dtypes, on the CPU. Some may be views of others (slices,
    reshapes, parameters pointing into a flat buffer), the same tensor listed twice (a tied
    weight), or a tensor whose storage was freed (resized to 0 bytes).
    Returns: an int, the bytes of memory these tensors keep alive: every storage counted
    once, and all of it (a small view keeps its whole storage alive; a freed one holds 0).
    Must: leave the tensors unchanged. (Do not read the values of a tensor whose storage was
    freed: that can crash the process.)
    Example: a (12,) float32 buffer and three (4,) views into it -> 48, not 96.
    Graded on: views of one buffer, a tied weight, a (2,) slice of a (100,) tensor, a freed
    storage, parameters in a flat buffer with gradients apart, mixed dtypes, non-contiguous
    views (a transpose, a strided slice), a buffer seen as another dtype; the tensors
    afterwards.

    Hint: every tensor has a storage, t.untyped_storage(): how can you tell that two tensors
    share one, and how big it is?
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
