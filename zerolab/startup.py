"""How every rank starts from the same model.

Ranks may build their model from different seeds (or a learner may forget to seed at all); data
parallelism only works if every copy starts equal, so an engine first broadcasts rank 0's
parameters and buffers to every rank of its group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm


def broadcast_from_rank0(model: nn.Module, group: dist.ProcessGroup | None, tag: str) -> None:
    """Every rank starts from rank 0's parameters and buffers (ranks may have other seeds)."""
    if not dist.is_initialized():
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            comm.broadcast(t.data, src, tag=f"{tag}/{name}", group=group)
