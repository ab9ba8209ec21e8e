"""torch.distributed's collective functions, wrapped to write to the flight recorder.

    flight.install(path, rank, world_size); flight_torch.hook()   # in every rank of a launch

Note: why wrapping torch.distributed's functions. Collectives reach gloo three ways:
zerolab.comm (which records its own calls, tagged), torch.distributed's Python functions called
directly (a learner's `dist.all_reduce`, ZeroRedundancyOptimizer, FSDP2), and C++ (DDP's
reducer). A TorchDispatchMode sees all three, but routes every aten op of the step through
Python: +45% on a ZeRO-3 step of the course GPT (measured, 2 ranks, 20 paired steps). Wrapping
the Python functions costs a few microseconds per collective and nothing per aten op. Not seen:
collectives issued from C++ (torch's DDP buckets), and functions another module imported from
torch.distributed by name before `hook()`. An async call is complete when its Work's wait()
returns (Work.wait is wrapped too).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerolab.wire import flight
from zerolab.wire.flight import COLLECTIVE, P2P

# function -> (op recorded, kind, argument ranks must agree on (None: no tensor), argument
# naming the peer). Aliases share an op name: torch 2.13's all_gather_single is the old
# all_gather_into_tensor, and ranks calling one and the other do match.
HOOKS: dict[str, tuple[str, int, str | None, str | None]] = {
    "all_reduce": ("all_reduce", COLLECTIVE, "tensor", None),
    "all_reduce_coalesced": ("all_reduce_coalesced", COLLECTIVE, "tensors", None),
    "broadcast": ("broadcast", COLLECTIVE, "tensor", "src"),
    "reduce": ("reduce", COLLECTIVE, "tensor", "dst"),
    "all_gather": ("all_gather", COLLECTIVE, "tensor", None),
    "all_gather_single": ("all_gather_into_tensor", COLLECTIVE, "output_tensor", None),
    "all_gather_into_tensor": ("all_gather_into_tensor", COLLECTIVE, "output_tensor", None),
    "_all_gather_base": ("all_gather_into_tensor", COLLECTIVE, "output_tensor", None),
    "all_gather_coalesced": ("all_gather_coalesced", COLLECTIVE, "input_tensor_list", None),
    "gather": ("gather", COLLECTIVE, "tensor", "dst"),
    "scatter": ("scatter", COLLECTIVE, "tensor", "src"),
    "reduce_scatter": ("reduce_scatter", COLLECTIVE, "output", None),
    "reduce_scatter_single": ("reduce_scatter_tensor", COLLECTIVE, "input", None),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", COLLECTIVE, "input", None),
    "_reduce_scatter_base": ("reduce_scatter_tensor", COLLECTIVE, "input", None),
    "all_to_all_single": ("all_to_all_single", COLLECTIVE, "input", None),
    "all_to_all": ("all_to_all", COLLECTIVE, None, None),
    "barrier": ("barrier", COLLECTIVE, None, None),
    "monitored_barrier": ("monitored_barrier", COLLECTIVE, None, None),
    "broadcast_object_list": ("broadcast_object_list", COLLECTIVE, None, "src"),
    "all_gather_object": ("all_gather_object", COLLECTIVE, None, None),
    "gather_object": ("gather_object", COLLECTIVE, None, "dst"),
    "scatter_object_list": ("scatter_object_list", COLLECTIVE, None, "src"),
    "send": ("send", P2P, "tensor", "dst"),
    "recv": ("recv", P2P, "tensor", "src"),
    "isend": ("isend", P2P, "tensor", "dst"),
    "irecv": ("irecv", P2P, "tensor", "src"),
    "send_object_list": ("send_object_list", P2P, None, "dst"),
    "recv_object_list": ("recv_object_list", P2P, None, "src"),
    "batch_isend_irecv": ("batch_isend_irecv", P2P, None, None),
}
_originals: list[tuple[Any, str, Any]] = []  # (module or class, name, what it was)
_pending: dict[int, tuple[Any, int]] = {}  # id(work) -> (work, position) of async calls
_MAX_PENDING = 4096  # async works never waited for are forgotten beyond this many


def hook() -> None:
    """Wrap torch.distributed's collective functions (and Work.wait) in this process."""
    if _originals:
        return
    c10d = dist.distributed_c10d
    for name, spec in HOOKS.items():
        original = getattr(c10d, name, None)
        if original is None:  # not in this torch
            continue
        wrapped = _wrap(original, name, spec)
        for module in (c10d, dist):
            if getattr(module, name, None) is original:
                _originals.append((module, name, original))
                setattr(module, name, wrapped)
    work = torch._C._distributed_c10d.Work
    _originals.append((work, "wait", work.wait))
    work.wait = _wait_wrapper(work.wait)


def unhook() -> None:
    """Give torch.distributed its own functions back."""
    for module, name, original in _originals:
        setattr(module, name, original)
    _originals.clear()
    _pending.clear()


def _argument(names: list[str], defaults: dict, args: tuple, kwargs: dict, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    index = names.index(name)
    return args[index] if index < len(args) else defaults.get(name)


def _wrap(fn: Callable, name: str, spec: tuple[str, int, str | None, str | None]) -> Callable:
    op, kind, tensor_arg, peer_arg = spec
    parameters = inspect.signature(fn).parameters
    names = list(parameters)
    defaults = {k: p.default for k, p in parameters.items()
                if p.default is not inspect.Parameter.empty}

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        rec = flight.recorder()
        if rec is None or rec.inside():
            return fn(*args, **kwargs)
        try:
            def arg(key: str) -> Any:
                return _argument(names, defaults, args, kwargs, key) if key in names else None

            group, async_op = arg("group"), bool(arg("async_op"))
            tensors = arg(tensor_arg) if tensor_arg else None
            peer = arg(peer_arg) if peer_arg else None
            if peer is None and peer_arg and arg("group_" + peer_arg) is not None:
                peer = dist.get_global_rank(group, arg("group_" + peer_arg))
            comparable = tensor_arg is not None and not (
                name == "all_to_all_single" and (arg("output_split_sizes")
                                                 or arg("input_split_sizes")))
            if name == "batch_isend_irecv":
                async_op = True
            reduce_op = flight.reduce_op_name(arg("op")) if "op" in names else ""
            pos = rec.issue(op, tensors, group, async_op, kind=kind,
                            peer=-1 if peer is None else int(peer), comparable=comparable,
                            reduce_op=reduce_op)
        except Exception:  # recording must never break the call itself
            return fn(*args, **kwargs)
        with rec.calling(pos, blocking=not async_op):
            result = fn(*args, **kwargs)
        if not async_op:
            rec.complete(pos)
        else:
            works = result if isinstance(result, list) else [result]
            for work in works:
                if work is not None:
                    _pending[id(work)] = (work, pos)
            while len(_pending) > _MAX_PENDING:
                _pending.pop(next(iter(_pending)))
        return result

    return recorded


def _wait_wrapper(wait: Callable) -> Callable:
    @functools.wraps(wait)
    def recorded_wait(self, *args, **kwargs):
        found = _pending.pop(id(self), None)
        rec = flight.recorder()
        if found is None or rec is None:
            return wait(self, *args, **kwargs)
        pos = found[1]
        with rec.calling(pos, blocking=True):
            result = wait(self, *args, **kwargs)
        if not any(p == pos for _, p in _pending.values()):  # the last work of its call
            rec.complete(pos)
        return result

    return recorded_wait
