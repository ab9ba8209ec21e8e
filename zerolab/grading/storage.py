"""Storages behind tensors, as the grader measures them: snapshots of inputs (to tell whether
a function changed them), the storages a list of outputs lives in (views of one buffer, or
copies), and the bytes a set of tensors still holds (what a reshard must free).

Nothing here reads a tensor whose storage was freed (resized to 0 bytes): that would crash
the process. Such a tensor is described by its storage's size instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerolab.grading.compare import first_item, readable_value


@dataclass(frozen=True)
class _TensorState:
    """A tensor as it was: its values (None when its storage was freed) and storage size."""

    values: torch.Tensor | None
    storage_bytes: int
    shape: tuple[int, ...]


def snapshot_of(value: Any) -> Any:
    """A deep copy of tensors (in lists, tuples and dicts), to compare with later."""
    if isinstance(value, torch.Tensor):
        readable = readable_value(value)
        return _TensorState(value.detach().clone() if readable else None,
                            value.untyped_storage().nbytes(), tuple(value.shape))
    if isinstance(value, dict):
        return {k: snapshot_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [snapshot_of(v) for v in value]
    return value


def what_changed(before: Any, after: Any) -> str | None:
    """How `after` differs from the snapshot `before`, or None when it is unchanged."""
    if isinstance(before, _TensorState):
        if not isinstance(after, torch.Tensor):
            return f"it became {type(after).__name__}"
        if tuple(after.shape) != before.shape:
            return f"its shape went from {before.shape} to {tuple(after.shape)}"
        nbytes = after.untyped_storage().nbytes()
        if nbytes != before.storage_bytes:
            return f"its storage went from {before.storage_bytes} to {nbytes} bytes"
        if before.values is None:
            return None
        return _values_changed(before.values, after.detach())
    if isinstance(before, dict):
        for key, value in before.items():
            if key not in after:
                return f"[{key!r}] was removed"
            if (why := what_changed(value, after[key])) is not None:
                return f"[{key!r}]: {why}"
        return None if set(after) == set(before) else "keys were added"
    if isinstance(before, list):
        if len(after) != len(before):
            return f"its length went from {len(before)} to {len(after)}"
        return first_item(before, after, what_changed)
    return None


def _values_changed(before: torch.Tensor, after: torch.Tensor) -> str | None:
    if after.dtype != before.dtype:
        return f"its dtype went from {before.dtype} to {after.dtype}"
    same = (before == after) | (before.isnan() & after.isnan()) if before.is_floating_point() \
        else before == after
    if bool(same.all()):
        return None
    i = int((~same).reshape(-1).nonzero()[0])
    where = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), before.shape)) \
        if before.dim() else ()
    return (f"its values changed (first at index {where}: {before.reshape(-1)[i].item():.4g} "
            f"became {after.reshape(-1)[i].item():.4g})")


def _storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages behind `tensors`, in order of first appearance."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen.setdefault(storage_id(storage), storage)
    return list(seen.values())


def storage_id(storage: torch.UntypedStorage) -> int:
    """The storage itself (torch's C++ object), whatever Python wrapper shows it; stable when
    the storage is resized, unlike data_ptr() (0 for every freed storage)."""
    return storage._cdata


def storage_sizes(tensors: list[torch.Tensor]) -> list[int]:
    """The bytes of each distinct storage behind `tensors`: [one size] for views of one
    buffer, one size per tensor for copies."""
    return [s.nbytes() for s in _storages(tensors)]


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes that `tensors` keep alive, each storage counted once."""
    return sum(storage_sizes(tensors))


def shares_memory(tensor: torch.Tensor, others: list[Any]) -> bool:
    """Whether `tensor` lives in the storage of one of `others` (tensors, in lists)."""
    flat: list[torch.Tensor] = []
    for o in others:
        flat += [t for t in (o if isinstance(o, (list, tuple)) else [o])
                 if isinstance(t, torch.Tensor)]
    mine = storage_id(tensor.untyped_storage())
    return any(storage_id(t.untyped_storage()) == mine for t in flat)
