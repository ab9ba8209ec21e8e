"""Exercises for notebook 05: ZeRO-3's unshard and reshard of a unit.

5.1 runs on every rank at once (the grader spawns world_size processes and calls it on each,
with the same `group`): talk to the other ranks only through zerolab.comm, which records
every call with a tag. 5.2 is a plain function.

Check your answers with `grade("ex05")` in the notebook, or `python -m zerolab.grade ex05`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm


def unshard(local_shard: torch.Tensor, shapes: list[torch.Size], rank: int, world_size: int,
            group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Exercise 5.1: ZeRO-3's unshard: gather a unit's full parameters from every rank's shard.

    Inputs: local_shard: (shard_numel,), this rank's shard of a unit's flat padded
    parameters (3.1's layout). shapes: the unit's parameter shapes, in order.
    Returns: one tensor per shape, with that shape and local_shard's dtype, the same values
    on every rank: views into one new gathered flat buffer of world_size * shard_numel
    elements (the padding left out; on one rank too, not local_shard), so that 5.2 frees them
    all by freeing that one buffer.
    Must: leave local_shard unchanged; talk to the other ranks through zerolab.comm (a tag,
    `group`), sending (N-1)/N of the gathered buffer's bytes.
    Graded on: the groups of 3.1 (one in float64, one in bfloat16) on 1, 2 and 3 ranks: the
    tensors, the storages behind them (one, of world_size * shard_numel elements, not
    local_shard's), local_shard afterwards, the ops called and bytes sent.

    Hint: which collective brings every rank's shard to every rank, and where in its output
    does parameter 0 start?
    """
    raise NotImplementedError(
        "Exercise 5.1: ZeRO-3's unshard: gather a unit's full parameters from every rank's shard.")


def reshard(params: list[nn.Parameter], flat_param: torch.Tensor) -> None:
    """Exercise 5.2: ZeRO-3's reshard: free a unit's gathered parameters, in place.

    Inputs: flat_param: (padded_numel,), the unit's gathered flat buffer. params: the unit's
    parameters; their .data are views into flat_param (what 5.1 returned). A forward may
    have run: autograd then keeps views of the parameters for backward, and they point into
    flat_param's storage too. (This rank's own shard lives in another tensor and is kept.)
    Returns: nothing. Afterwards: the storage flat_param had holds 0 bytes, whoever still
    points at it; flat_param keeps its shape and that storage (the next unshard grows it
    back and refills it in place); every parameter is an empty tensor (numel 0, same dtype)
    so that nothing reads stale values.
    Graded on: the groups of 3.1 in float32 and float64, with and without a forward's saved
    views: the bytes still held by flat_param, the parameters and autograd's saved views;
    the parameters' numel and dtype; flat_param's shape and storage.

    Hint: dropping or replacing a reference frees nothing while other tensors point at the
    same storage. What can you shrink instead?
    """
    raise NotImplementedError(
        "Exercise 5.2: ZeRO-3's reshard: free a unit's gathered parameters, in place.")
