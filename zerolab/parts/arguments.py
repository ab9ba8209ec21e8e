"""The mistakes a learner can make when building an engine, caught with the fix in the message."""

from __future__ import annotations

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
