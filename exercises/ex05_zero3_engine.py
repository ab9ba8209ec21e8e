"""Exercise for notebook 05, the capstone: the ZeRO-3 engine (FSDP).

The class runs on every rank at once: the grader starts 1, 2 and 3 processes, builds the same
model on each and trains it with your engine, then with zerolab.zero3.ZeRO3 on the same
batches, and compares what they computed, held and sent. Talk to the other ranks only through
zerolab.comm (it records every call, with its tag). Use zerolab.sharding (FlatLayout, flatten,
unflatten, shard) and zerolab.units.make_units; not zerolab's engines.

zerolab's own engine is in zerolab/zero3.py (on top of zero2.py): solve this first, then read it.
Check your answer with `grade("5.3")` in the notebook, or `python -m zerolab.grade 5.3`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.sharding import FlatLayout, flatten, shard, unflatten
from zerolab.units import Unit, UnitSpec, make_units


class ZeRO3Engine:
    """ZeRO-3: parameters, gradients and optimizer state all sharded; units gathered on use.

        engine = ZeRO3Engine(model, torch.optim.AdamW, lr=1e-3, group=group)
        loss = model.loss(engine(x), y)  # your hooks gather and free each unit around its use
        loss.backward()
        engine.step()
        engine.zero_grad()

    The contract (what the grader calls):
    - Every rank is given the same model (same seed): no need to broadcast it.
    - Units: `make_units(model, units)` (zerolab.units) lists them in running order, the root
      last (the model itself: embeddings, final LayerNorm, and the weight the output head
      shares with the token embedding). Each unit's trainable parameters go in one flat,
      padded buffer, its frozen ones (requires_grad=False) in another: frozen parameters are
      sharded and gathered too, but get no gradient and no optimizer state.
    - At rest a rank keeps only its shard of each buffer, in a tensor of its own.
    - unshard(unit) before the unit's forward and again before its backward (a hook on the
      unit's output tensors): all-gather its shards into the full buffers (tags
      "zero3/fwd/<unit name>" and "zero3/bwd/<unit name>") and point the parameters at them.
      The root is gathered from the start to the end of the model's forward, and again for
      its backward (zerolab.zero3.ZeRO3 keeps it gathered in between, as FSDP2 does; not
      here). Gathering the next unit ahead (prefetch) is allowed, not required.
    - reshard(unit) right after its forward and after its backward frees the unit's full
      parameters. Freed means the memory is gone, measured (below), whoever still points at
      it: autograd keeps views of a unit's parameters from its forward until its backward.
    - After a unit's backward, its gradients are reduce-scattered (op="avg", tag
      "zero3/bwd/<unit name>") into this rank's gradient shard, and the full ones go. Several
      backward passes may come before step(): the shards add up.
    - step() steps the optimizer on this rank's shards; nothing is gathered after it.
    - full_state_dict() gathers every unit (a collective: every rank calls it) and returns a
      snapshot of the full state_dict().

    Measured, against zerolab.zero3.ZeRO3 (without prefetch, the root gathered again for
    backward) on the same batches (1 to 3 ranks; SGD with one and with two backward passes
    per step, AdamW with two): the parameters after every step; every live tensor on the
    rank, counted by the grader (not what your engine says it holds), at the end of each
    forward and backward and after step()
    (at most zerolab's + padding: after step() 16Ψ/N with fp32 AdamW, frozen layers sharded
    too) and at the step's peak (at most zerolab's + one unit); all_gather in forward,
    all_gather and reduce_scatter in backward, one per unit and buffer, in running order,
    nothing in step(); 3Ψ per step (ring model), 1.5x DDP's.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None,
                 units: Sequence[UnitSpec] | None = None, **optimizer_kwargs):
        """Exercise 5.3: Shard every unit, hook its forward and backward, build the optimizer.

        Each unit is one bucket (no bucket_bytes). Hint: p.data = view points a
        parameter into a buffer, p.data = torch.empty(0) points it at nothing; a module's
        register_forward_pre_hook / register_forward_hook run before and after its forward.
        """
        self.module = model
        self.group = group
        raise NotImplementedError(
            "Exercise 5.3: Shard every unit, hook its forward and backward, build the optimizer.")

    def unshard(self, unit: Unit, phase: str) -> None:
        """Exercise 5.3: All-gather the unit's full parameters (if not already gathered)."""
        raise NotImplementedError(
            "Exercise 5.3: All-gather the unit's full parameters (if not already gathered).")

    def reshard(self, unit: Unit) -> None:
        """Exercise 5.3: Free the unit's full parameters: only this rank's shards remain.

        Hint: notebook 05 and exercise 5.2: which of storage, tensor and reference frees the
        memory while autograd still holds views of the parameters?
        """
        raise NotImplementedError(
            "Exercise 5.3: Free the unit's full parameters: only this rank's shards remain.")

    def _forward_done(self, unit: Unit, output: torch.Tensor) -> None:
        """Exercise 5.3: After a unit's forward: reshard it, and hook its backward."""
        raise NotImplementedError(
            "Exercise 5.3: After a unit's forward: reshard it, and hook its backward.")

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Exercise 5.3: Once a unit's gradients are all in: reduce-scatter them, reshard it."""
        raise NotImplementedError(
            "Exercise 5.3: Once a unit's gradients are all in: reduce-scatter them, reshard it.")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self) -> None:
        """Exercise 5.3: Step the optimizer on this rank's shards."""
        raise NotImplementedError("Exercise 5.3: Step the optimizer on this rank's shards.")

    def zero_grad(self) -> None:
        """Exercise 5.3: Zero this rank's gradient shards."""
        raise NotImplementedError("Exercise 5.3: Zero this rank's gradient shards.")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Exercise 5.3: The model's full state_dict(), a snapshot, on every rank (collective)."""
        raise NotImplementedError(
            "Exercise 5.3: The model's full state_dict(), a snapshot, on every rank (collective).")
