"""Comparing the learner's outputs with the solution's, and saying how they differ: which
item, expected against got, shape and max error.

Floats and tensors are compared with a tolerance (tighter for float64 tensors, looser for
16-bit ones); ints (counts, bytes, parameters) exactly. Outputs arrive as data
(zerolab.grading.data): a tensor whose storage was freed is a `Freed`, an object that is not
data a `Described`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

from zerolab.grading.data import Described, Freed, describe, readable

# (rtol, atol) by dtype: float64 results must keep float64's precision (a float32 buffer on
# the way loses it); float32 allows for another order of summation; bfloat16 keeps 8 bits.
_TOLERANCE = {torch.float64: (1e-10, 1e-12), torch.bfloat16: (1e-2, 1e-2),
              torch.float16: (1e-3, 1e-3)}
describe_value = describe
readable_value = readable


def _fmt_values(t: torch.Tensor) -> str:
    def fmt(v: Any) -> str:
        return "[" + ", ".join(fmt(u) for u in v) + "]" if isinstance(v, list) else f"{v:.4g}"
    return fmt(t.detach().double().tolist())


def compare_values(expected: Any, got: Any) -> str | None:
    """Why `got` differs from `expected` (named from the top), or None when it matches."""
    if isinstance(expected, torch.Tensor):
        return compare_tensors(expected, got)
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"expected a dict, got {describe_value(got)}"
        if set(got) != set(expected):
            return f"expected keys {sorted(expected)}, got {sorted(got)}"
        for key in expected:
            if (why := compare_values(expected[key], got[key])) is not None:
                return f"[{key!r}]: {why}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"expected a list of {len(expected)}, got {describe_value(got)}"
        if all(isinstance(v, (str, bool, int, float)) for v in [*expected, *got]):
            # Short lists of plain values (comm ops, freed flags): show them whole.
            same = len(got) == len(expected) and all(
                compare_values(e, g) is None for e, g in zip(expected, got))
            return None if same else f"expected {list(expected)}, got {list(got)}"
        if len(got) != len(expected):
            return f"expected {len(expected)} items, got {len(got)}"
        return first_item(expected, got, compare_values)
    if isinstance(expected, numbers.Real) and not isinstance(expected, bool):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return f"expected a number, {expected:.6g}, got {describe_value(got)}"
        if isinstance(expected, numbers.Integral):  # counted, not measured: exactly
            return None if got == expected else f"expected {expected}, got {got!r}"
        if not math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12):
            return f"expected {expected:.6g}, got {got:.6g}"
        return None
    if got == expected:
        return None
    return f"expected {expected!r}, got {got.text if isinstance(got, Described) else repr(got)}"


def first_item(expected: Sequence, got: Sequence,
                compare: Callable[[Any, Any], str | None]) -> str | None:
    """The first pair of items that `compare` finds different, named by its index."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if (why := compare(e, g)) is not None:
            return f"[{i}]: {why}"
    return None


def compare_tensors(expected: torch.Tensor, got: Any) -> str | None:
    if not isinstance(got, torch.Tensor | Freed):
        return f"expected {describe_value(expected)}, got {describe_value(got)}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"expected shape {tuple(expected.shape)}, got shape {tuple(got.shape)}"
    if str(got.dtype) != str(expected.dtype):
        return f"expected dtype {expected.dtype}, got {got.dtype}"
    if isinstance(got, Freed):
        return (f"shape {tuple(got.shape)} as expected, but its storage holds only "
                f"{got.storage_bytes} bytes (freed?): its values cannot be read")
    e, g = expected.detach().double(), got.detach().double()
    rtol, atol = _TOLERANCE.get(expected.dtype, (1e-5, 1e-6))
    if torch.allclose(g, e, rtol=rtol, atol=atol, equal_nan=True):
        return None
    error = (g - e).abs().nan_to_num(nan=math.inf)
    if e.numel() <= 12:
        values = f"expected {_fmt_values(e)}, got {_fmt_values(g)}"
    else:
        worst = int(error.argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), e.shape))
        values = (f"at index {where}: expected {e.reshape(-1)[worst]:.4g}, "
                  f"got {g.reshape(-1)[worst]:.4g}")
    return f"shape {tuple(e.shape)} as expected, max error {error.max():.3g}; {values}"


