"""ZeRO-3's units: which parameters are gathered and freed together.

A unit is what FSDP2's `fully_shard` is called on: a module (a transformer block), or a few
modules listed together. `make_units` decides, before the engine is built, which parameters
each unit owns; ZeRO-3 then gives each unit flat, padded buckets (trainable parameters in one,
frozen ones in their own, which is never reduced nor stepped).

The last unit is the root: the model itself, holding every parameter no other unit claims
(embeddings, the final LayerNorm) and every parameter two units share (an output head tied to
the token embedding). The root is gathered for the whole forward, as in FSDP2.

Default units (units=None): every child of every top-level nn.ModuleList (a transformer's
blocks, an MLP's layers), else every direct child that holds parameters. List units in the
order they run: prefetching follows that order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from zerolab.parts.param_groups import bucket_params

UnitSpec = nn.Module | Sequence[nn.Module]  # what a caller names as one unit


@dataclass
class Unit:
    """Modules whose parameters are gathered and freed together (FSDP2: one fully_shard)."""

    name: str  # "blocks.0", "blocks.0+blocks.1", or "root"; used in comm tags
    modules: list[nn.Module]  # forward hooks go on these
    params: list[nn.Parameter]  # the parameters this unit owns, each in exactly one unit
    buckets: list = field(default_factory=list)  # its flat buckets, set by the engine
    unsharded: bool = False  # parameters point into gathered full buffers
    gathers: list = field(default_factory=list)  # all-gathers issued and not yet waited on
    in_backward: bool = False  # pre_backward ran: a forward now is a checkpoint's recompute
    ready: int = 0  # ZeRO-3: its trainable buckets whose gradients are all in, this backward
    uses: Any = None  # ZeRO-3: its calls whose inputs wait for gradients (parts/post_backward.py)


def make_units(model: nn.Module, units: Sequence[UnitSpec] | None = None) -> list[Unit]:
    """The model's units in running order, root last. Each parameter belongs to one unit."""
    groups = _unit_groups(model, units)
    claims: dict[nn.Parameter, set[int]] = {}
    for i, (_, modules) in enumerate(groups):
        for p in _distinct(p for m in modules for p in m.parameters()):
            claims.setdefault(p, set()).add(i)
    out = [Unit(name, modules, [p for p in _distinct(p for m in modules for p in m.parameters())
                                if claims[p] == {i}])
           for i, (name, modules) in enumerate(groups)]
    # The root: what no unit claims, and what several units share (tied weights).
    out.append(Unit("root", [model], [p for p in _distinct(model.parameters())
                                      if len(claims.get(p, ())) != 1]))
    return out


def bucket_runs(unit: Unit, key: Callable[[nn.Parameter], Hashable]
                ) -> list[tuple[str, list[nn.Parameter]]]:
    """The unit's flat buckets, (name, parameters): its trainable parameters, then its frozen
    ones (never reduced), one per parameter group and dtype (`key`): "blocks.0", "blocks.0.1",
    "blocks.0.frozen"."""
    runs = []
    for trainable in (True, False):
        ps = [p for p in unit.params if p.requires_grad == trainable]
        name = unit.name if trainable else f"{unit.name}.frozen"
        runs += [(name + (f".{i}" if i else ""), run)
                 for i, run in enumerate(bucket_params(ps, 1e30, key))]
    return runs


def neighbour(units: Sequence[Unit], unit: Unit, step: int) -> Unit | None:
    """The unit to prefetch: the next one in forward (step +1), the one before in backward
    (-1). The root (units[-1]) is gathered for the whole forward and never prefetched: it
    comes before the first block in forward and after the last one in backward."""
    order = units[:-1]
    if unit is units[-1]:
        return (order[0] if step > 0 else order[-1]) if order else None
    i = order.index(unit) + step
    return order[i] if 0 <= i < len(order) else None


def _unit_groups(model: nn.Module, units: Sequence[UnitSpec] | None
                 ) -> list[tuple[str, list[nn.Module]]]:
    names = {m: n for n, m in model.named_modules()}
    chosen = _default_units(model) if units is None else [
        list(u) if isinstance(u, (list, tuple)) else [u] for u in units]
    for modules in chosen:
        for m in modules:
            if m not in names or m is model:
                raise ValueError(f"units must be submodules of the model (not the model "
                                 f"itself, which is the root unit); got {type(m).__name__}")
    return [("+".join(names[m] for m in modules), modules) for modules in chosen]


def _default_units(model: nn.Module) -> list[list[nn.Module]]:
    lists = [m for m in model.children() if isinstance(m, nn.ModuleList)]
    if lists:
        return [[child] for ml in lists for child in ml]
    return [[child] for child in model.children() if any(True for _ in child.parameters())]


def _distinct(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Each parameter once, in first-seen order (a module used twice lists it twice)."""
    return list(dict.fromkeys(params))
