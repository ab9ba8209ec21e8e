"""Exercises for notebook 05: ZeRO-3's unshard and reshard of a unit.

5.1 runs on every rank at once (the grader spawns world_size processes and calls it on each,
with the same `group`): talk to the other ranks only through zerolab.comm, which records
every call with a tag. 5.2 is a plain function.

Check your answers with `grade("ex05")` in the notebook, or `python -m zerolab.grade ex05`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm


def unshard(local_shard: torch.Tensor, shapes: list[torch.Size], rank: int, world_size: int,
            group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Exercise 5.1: ZeRO-3's unshard: gather a unit's full parameters from every rank's shard.

    local_shard: (shard_numel,), this rank's shard of the unit's flat padded parameters
    (3.1's layout: parameters end to end, zero padding at the end, shard r = the r-th
    shard_numel elements). shapes: the unit's parameter shapes, in order.
    Return one tensor per shape, the same on every rank: views into one gathered flat buffer
    of world_size * shard_numel elements, the padding left out.

    Hint: comm.all_gather(flat, local_shard, tag=..., group=group) fills flat
    (world_size * shard_numel,); then cut it into views as in 3.2.
    """
    # BEGIN SOLUTION
    flat = torch.empty(world_size * local_shard.numel(), dtype=local_shard.dtype)
    comm.all_gather(flat, local_shard, tag="ex5.1/unshard", group=group)
    out, offset = [], 0
    for shape in shapes:
        numel = torch.Size(shape).numel()
        out.append(flat[offset:offset + numel].view(shape))
        offset += numel
    return out
    # END SOLUTION


def reshard(params: list[nn.Parameter], flat_param: torch.Tensor) -> None:
    """Exercise 5.2: ZeRO-3's reshard: free a unit's gathered parameters, in place.

    flat_param: (padded_numel,), the unit's gathered flat buffer. params: the unit's
    parameters; their .data are views into flat_param (what 5.1 returned). Free the memory:
    afterwards the storage behind flat_param must hold 0 bytes, and every parameter must be
    an empty tensor (numel 0, same dtype) so that nothing reads stale values. (This rank's
    own shard lives in another tensor and is kept.)

    Dropping a reference (`del flat_param`) frees nothing while the parameters' views, or
    tensors autograd saved for backward, still point at the storage: shrink the storage
    itself, and it can be grown and refilled in place by the next unshard.

    Hint: a storage can be resized in place: t.untyped_storage().resize_(nbytes). A
    parameter's tensor is replaced by assigning its .data.
    """
    # BEGIN SOLUTION
    for p in params:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    flat_param.untyped_storage().resize_(0)
    # END SOLUTION
