"""Counting torch's own collectives, which do not go through zerolab.comm.

torch's DDP (from its C++ reducer), ZeroRedundancyOptimizer and FSDP2 issue c10d collectives
that zerolab's recorder never sees. A dispatch mode sees every c10d op a process issues, from
Python or C++, and `CollectiveCounter` adds up the ring-model bytes of each, with the same
formula `record_comm` uses, so that the benchmark and notebook 06 can set torch's traffic next
to zerolab's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from zerolab.theory import rank_sent_bytes


def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


# c10d op name -> (zerolab's op name, which argument holds the full tensor(s) S).
# S follows zerolab.comm: the all-reduced tensor, the all-gather's output, the reduce-scatter's
# input. Argument 0 is the output (or the in-place tensors), argument 1 the input.
C10D_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),  # output: [[N tensors]]
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),  # input: [[N tensors]]
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "send": ("send", 0),  # point-to-point (zerolab's gloo reduce-scatter is made of these)
    "recv_": ("recv", 0),
    "barrier": ("barrier", None),
}


class CollectiveCounter(TorchDispatchMode):
    """Sees every c10d collective issued on this rank (from Python or from C++, e.g. DDP's
    reducer) and adds up the ring-algorithm bytes this rank sends, like `record_comm` does.

        with CollectiveCounter() as counter:
            ...
        counter.sent_bytes, counter.by_op, counter.unknown_ops
    """

    def __init__(self) -> None:
        super().__init__()
        self.sent_bytes = 0  # ring-algorithm bytes this rank sent
        self.by_op: dict[str, int] = {}  # the same, per zerolab op name
        self.calls: dict[str, int] = {}  # number of calls per zerolab op name
        self.unknown_ops: list[str] = []  # c10d ops seen but not counted (none expected)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._count(func._opname, args)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, args: tuple) -> None:
        if name not in C10D_OPS:
            self.unknown_ops.append(name)
            return
        op, arg = C10D_OPS[name]
        if arg is None:
            return
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        tensors = args[arg]
        if name in ("allgather_", "reduce_scatter_"):  # lists of N chunks: S is their sum
            tensors = tensors[0]
        src = args[2] if op == "broadcast" else 0  # broadcast_(tensors, group, root_rank, ...)
        sent = rank_sent_bytes(op, _bytes(tensors), world_size, rank, src)
        self.sent_bytes += sent
        self.by_op[op] = self.by_op.get(op, 0) + sent
        self.calls[op] = self.calls.get(op, 0) + 1
