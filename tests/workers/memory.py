"""Workers for the memory tracker's tests that need a process group (DTensor)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import zerolab
from zerolab.grading.engine_memory import tracked
from zerolab.memory import track_memory


def dtensor_op_bytes() -> dict[str, int]:
    """A DTensor op under the tracker: the bytes it counts, and the local and global bytes."""
    ctx = zerolab.init_from_env()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    d = distribute_tensor(torch.zeros(1024), mesh, [Shard(0)])  # 4 KiB in all
    with track_memory() as trace:
        doubled = d * 2  # runs `mul` on the local shard, below the tracker
    with tracked(dict) as grader:  # the grader's tracker, over a learner's engine
        grader.sampling = True
        tripled = d * 3
    return {"peak": trace.peak_bytes, "local": doubled.to_local().untyped_storage().nbytes(),
            "global": doubled.numel() * doubled.element_size(), "grader": grader.trace.peak_bytes,
            "grader_local": tripled.to_local().untyped_storage().nbytes()}
