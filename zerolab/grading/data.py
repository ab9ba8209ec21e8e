"""What a learner's process sends back to the grader: data, never objects.

The learner's code runs in processes of its own (zerolab.grading.worker); what it returned, and
what the grader measured there, comes back through files as plain data: tensors (copies of
their values), numbers, strings, None, and lists, tuples and dicts of them. `encode` makes
that data in the learner's process; `save` writes it with torch.save; `load` reads it with
torch.load(weights_only=True), which builds tensors and plain containers only: reading a file
runs none of the learner's code.

Two things are not plain values and get a record of their own: a tensor whose storage was freed
(resized to 0 bytes: its values cannot be read, reading them can crash the process) becomes a
`Freed`, and any other object (a numpy array, a generator, ...) a `Described`, its description.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

_FREED, _DESCRIBED = "__zerolab_freed__", "__zerolab_described__"


@dataclass(frozen=True)
class Freed:
    """A tensor whose storage no longer holds its elements (freed): its shape and storage."""

    shape: tuple[int, ...]
    dtype: str  # "torch.float32"
    storage_bytes: int


@dataclass(frozen=True)
class Described:
    """An object that is not plain data, by its description ("a numpy.ndarray ...")."""

    text: str


def readable(t: torch.Tensor) -> bool:
    """Whether t's storage holds every element t addresses (a freed storage holds 0 bytes)."""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size() <= t.untyped_storage().nbytes()


def describe(x: Any) -> str:
    """A short description of any value, for messages."""
    if isinstance(x, torch.Tensor | Freed):
        return f"a tensor of shape {tuple(x.shape)} ({x.dtype})"
    if isinstance(x, list | tuple | dict):
        return f"a {type(x).__name__} of {len(x)}"
    if isinstance(x, Described):
        return x.text
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) < 40 else text[:37] + '...'}"


def encode(value: Any) -> Any:
    """`value` as plain data (in the process that holds it): see the module docstring."""
    if isinstance(value, torch.Tensor):
        if not readable(value):
            return {_FREED: [list(value.shape), str(value.dtype),
                             value.untyped_storage().nbytes()]}
        return value.detach().clone().contiguous()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        items = [encode(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {(k if isinstance(k, str | int) else repr(k)): encode(v) for k, v in value.items()}
    if isinstance(value, torch.dtype | torch.Size):
        return str(value) if isinstance(value, torch.dtype) else tuple(value)
    return {_DESCRIBED: f"{type(value).__module__}.{type(value).__qualname__} "
                        f"{_short(repr(value))}"}


def _short(text: str) -> str:
    return text if len(text) < 60 else text[:57] + "..."


def decode(value: Any) -> Any:
    """The data `encode` made, with Freed and Described records back in place."""
    if isinstance(value, dict):
        if set(value) == {_FREED}:
            shape, dtype, nbytes = value[_FREED]
            return Freed(tuple(shape), dtype, nbytes)
        if set(value) == {_DESCRIBED}:
            return Described(value[_DESCRIBED])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [decode(v) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


@dataclass(frozen=True)
class Malformed:
    """A result the grader could not take as what its own code writes: a file the safe loader
    refuses, a file missing, a record of the wrong shape. Why, in words."""

    why: str


def save(value: Any, path: str) -> None:
    """Write encoded data to `path` (whole, or not at all: a reader never sees half a file)."""
    tmp = path + ".tmp"
    torch.save(value, tmp)
    os.replace(tmp, path)


def load(path: str) -> Any:
    """Read what `save` wrote, as data only (weights_only: no code runs), decoded."""
    return decode(torch.load(path, weights_only=True))


def load_result(path: str) -> Any:
    """`load`, for a file a learner's process wrote: what it holds, or a Malformed saying why
    not (a learner's code can write into its own process's files)."""
    try:
        return load(path)
    except Exception as e:  # refused by the safe loader, missing, cut short, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Malformed(f"{os.path.basename(path)} could not be read as data "
                         f"({type(e).__name__}: {first[:120]})")
