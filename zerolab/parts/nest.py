"""Tensors inside nested outputs: a module may return a tensor, a tuple, a list or a dict."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of tuples, lists and dicts, in order."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors_in(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors_in(y)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], x: Any) -> Any:
    """The same nest with fn applied to every tensor (other values kept as they are)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(map_tensors(fn, y) for y in x)
    if isinstance(x, dict):
        return {k: map_tensors(fn, v) for k, v in x.items()}
    return x
