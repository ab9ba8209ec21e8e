"""The mistakes a learner can make when building an engine, caught with the fix in the message."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from zerolab.parts.param_groups import GROUPS_SPELLING


def check_engine_arguments(model: nn.Module, optimizer_cls: object,
                           optimizer_kwargs: dict[str, Any] | None = None) -> None:
    """A model with trainable parameters, and an optimizer *class* (built per rank's shard)
    with keyword arguments for it that name no parameters."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters: there is nothing to train "
                         "or to shard.")
    if not any(p.requires_grad for p in params):
        raise ValueError(f"{type(model).__name__} has no trainable parameters "
                         "(all have requires_grad=False).")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_cls must be a torch.optim.Optimizer subclass such as torch.optim.AdamW "
            f"(the class, not an instance), got {optimizer_cls!r}")
    if "params" in (optimizer_kwargs or {}):
        raise TypeError(f"the engine builds the optimizer over the shards it steps, so it takes "
                        f"no params=; name parameter groups with {GROUPS_SPELLING}")


# Note: which optimizers may step a flat shard. An elementwise optimizer (SGD, Adam, AdamW, ...)
# updates each element from that element's own gradient history, so stepping any slice of a
# flat buffer, a ZeRO shard or a CPU tile (tiles.py), equals stepping each parameter whole. A
# matrix optimizer does not: Adafactor keeps a row and a column moment per matrix, Muon
# orthogonalises each matrix's update. Cut into 1-D pieces, they would train a different model
# without a word, so DDP steps them on whole parameters (no tiles), and ZeRO-1/2/3 step each
# parameter whole on one owner rank (whole_params.py); the engines that do not (HSDP, ZeroPP)
# refuse them by name. LBFGS re-evaluates the loss through a closure inside its step: refused.
ELEMENTWISE = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
    "Rprop", "ASGD") if hasattr(torch.optim, name))


def elementwise(optimizer_cls: type[torch.optim.Optimizer]) -> bool:
    """Whether each element's update depends on that element alone (the Note above)."""
    return issubclass(optimizer_cls, ELEMENTWISE)


def check_optimizer(optimizer_cls: type[torch.optim.Optimizer], engine: str,
                    shards: bool) -> None:
    """Refuse, by name, an optimizer the engine cannot step as torch would (shards: the engine
    steps flat shards and cannot step parameters whole)."""
    name = optimizer_cls.__name__
    if issubclass(optimizer_cls, torch.optim.LBFGS):
        raise TypeError(f"{engine} cannot run {name}: it calls a closure that re-evaluates "
                        f"the loss inside its step, while the engine reduces gradients in "
                        f"backward and steps once. Use a first-order optimizer (AdamW, SGD).")
    if issubclass(optimizer_cls, torch.optim.SparseAdam):
        raise TypeError(f"{engine} cannot run {name}: it needs sparse gradients, and the "
                        f"engine reduces dense ones.")
    if shards and not elementwise(optimizer_cls):
        raise TypeError(
            f"{engine} steps flat 1-D shards that cut parameters apart, so it runs only "
            f"elementwise optimizers ({', '.join(c.__name__ for c in ELEMENTWISE)}); {name} "
            f"is not one of them (a matrix optimizer such as Adafactor or Muon needs each "
            f"matrix whole). Use zerolab.ZeRO1, ZeRO2 or ZeRO3 (each parameter stepped whole "
            f"by one rank) or zerolab.DDP for {name}.")


ZEROPP_OPTIONS = {"quantize_weights", "secondary_shard_size", "quantize_grads", "node_size"}


def refuse_unit_arguments(engine: str, options: type, kwargs: dict[str, Any]) -> None:
    """ZeRO-3 and its subclasses: bucket_bytes means nothing (a unit is a bucket), and ZeRO++'s
    options belong to zerolab.ZeroPP (whose Options take them)."""
    if "bucket_bytes" in kwargs:
        raise TypeError(f"{engine} takes no bucket_bytes: each unit's gradients are reduced as "
                        f"one bucket when its backward is over (choose units=[...]).")
    taken = {f.name for f in dataclasses.fields(options)}
    zeropp = sorted(ZEROPP_OPTIONS & set(kwargs) - taken)
    if zeropp:
        raise TypeError(f"{engine} takes no {', '.join(zeropp)}: ZeRO++'s options build "
                        f"zerolab.ZeroPP(model, optimizer_cls, {zeropp[0]}=..., ...)")
