"""When a ZeRO-3 unit's backward is over on this rank, though a parameter got no gradient there.

ZeRO-3 runs a unit's post_backward (reduce-scatter, reshard) when the unit's last gradient is
accumulated. A branch that some ranks take and others skip (`if rank == 0: x = x + extra(x)`,
or a data-dependent one) leaves a parameter without gradient on the ranks that skipped it:
there the last gradient never comes, and the reduce-scatter the other ranks issued waits for a
partner that is all-gathering the next unit instead. FSDP2 (`set_reduce_scatter_unused_params`)
ends such a unit's backward when the gradients of the unit's *inputs* are computed (an autograd
function on them, `RegisterPostBackwardFunction`): that moment comes on every rank, between the
same two collectives, whatever the unit did inside; the missing gradient counts as zeros.

Autograd accumulates a parameter's gradient as soon as it is computed (its accumulation runs
before any other ready node), so once the gradients of the unit's inputs are out, every
gradient the unit will give its parameters in this backward is in. A unit called several times
in one forward is over when the last of its calls' inputs have their gradients: `Uses` counts
the calls whose backward has not run; a graph dropped without backward drops its calls too.

A unit whose inputs need no gradient (the root, a first block fed the batch) gets no such
moment: as DDP's and ZeRO-2's unfinished buckets (ddp.py's Note), it ends when the gradients
are next read (step(), clipping, parameters()) or the next forward or backward starts, before
this rank communicates again; the ranks that went on wait for it in their last reduction.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from zerolab.parts.nest import map_tensors, tensors_in
from zerolab.units import Unit


class _InputsDone(torch.autograd.Function):
    """Identity on a unit call's inputs; its backward runs once their gradients are computed."""

    @staticmethod
    def forward(ctx, call: _Call, *inputs: torch.Tensor):
        ctx.call = call
        ctx.set_materialize_grads(False)  # an input the unit did not use gets None, as before
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        ctx.call.done()
        return (None, *grads)


class _Call:
    """One call of a unit in a forward, held by its autograd node (dropped with the graph)."""

    def __init__(self, uses: Uses):
        self.uses = uses

    def done(self) -> None:
        self.uses.calls.discard(self)
        if not self.uses.calls:  # the unit's last call in this backward
            self.uses.on_done()


class Uses:
    """A unit's calls whose inputs have not got their gradients yet; on_done when none are left."""

    def __init__(self, unit: Unit, on_done: Callable[[], None]):
        self.unit = unit
        self.on_done = on_done
        self.calls: weakref.WeakSet[_Call] = weakref.WeakSet()

    def wrap(self, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """A forward pre-hook's return: `args` with each input that requires grad passed through
        _InputsDone (values and gradients unchanged); None (args as they are) if none does, or
        in a checkpoint's recompute (the unit's backward is under way: zero3.py's Note)."""
        inputs = [t for t in tensors_in(args) if t.requires_grad]
        if not inputs or not torch.is_grad_enabled() or self.unit.in_backward:
            return None
        call = _Call(self)
        self.calls.add(call)
        outputs = iter(_InputsDone.apply(call, *inputs))
        return map_tensors(lambda t: next(outputs) if t.requires_grad else t, args)
