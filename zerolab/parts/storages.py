"""Bytes a rank holds, each storage counted once: the model states by category.

Two tensors can share one storage (a view, a flat buffer and the parameters inside it), so
bytes are counted per storage, never per tensor: `distinct_bytes`. zerolab.memory tracks them
over time; the engines report what they hold now (`model_state_bytes`, shell.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CATEGORIES = ("params", "grads", "optimizer")  # the model states
StateTensors = dict[str, Iterable[torch.Tensor]]


def storage_key(t: torch.Tensor) -> tuple | None:
    """(device type, device index, address) of t's storage; None where it holds no memory."""
    if t.is_meta:  # a shape without memory (a model built on the meta device)
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (storage.device.type, storage.device.index, storage.data_ptr())


def distinct_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each storage counted once).

    `seen` carries the storages already counted elsewhere, so that one storage shared by two
    categories is counted in the first only.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        key = storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def model_state_bytes(state: StateTensors) -> dict[str, int]:
    """{"params": .., "grads": .., "optimizer": ..} bytes for the tensors in `state`."""
    seen: set = set()
    return {c: distinct_bytes(state.get(c, ()), seen) for c in CATEGORIES}
