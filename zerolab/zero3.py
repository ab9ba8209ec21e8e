"""ZeRO-3: shard the parameters too. PyTorch calls this FSDP; the words here are FSDP2's.

What changes from ZeRO-2 (zero2.py):
- Parameters are grouped into *units* (a module, or modules named together: what FSDP2's
  `fully_shard` is called on), each flattened and padded as before; at rest a rank keeps only
  its shard (`local_shard`), `flat_param`'s storage resized to zero. Model state: 16Ψ/N bytes.
- unshard: before a unit's forward (pre_forward) and again before its backward (pre_backward),
  all-gather its shards into flat_param, the module's parameters pointing into it. reshard:
  after its forward (post_forward) and its backward (post_backward), resize the storage to
  zero again. At any moment a rank holds the shards plus the one or two units it works on.
- post_backward is ZeRO-2's bucket hook: a unit's last gradient in, reduce-scatter, reshard (or
  the end of its inputs' backward, where a branch this rank skipped leaves a gradient out).
  No all-gather after the step: the next forward gathers what it needs.
- Traffic per step: all-gather in forward (Ψ), again in backward (Ψ), reduce-scatter (Ψ): 3Ψ,
  1.5x DDP's 2Ψ; less the root's backward gather (kept gathered, as FSDP2 keeps its root).
- Prefetch (on by default): when a unit starts, the next unit's all-gather (in forward; the
  previous unit's in backward) is issued asynchronously, so communication overlaps compute.
- One bucket per unit (per parameter group and dtype), so `bucket_bytes` is refused.
  model.state_dict() gathers full tensors; model.load_state_dict(full) fills the shards.
- reshard_after_forward=False (FSDP2's knob): units stay gathered from forward to backward:
  2Ψ per step, the whole model's parameters at the peak. (FSDP2's int is ZeRO++'s hpZ.)

Units and the root: units.py. ZeRO++ (zeropp.py) changes `_gather` and `_reduce`, not when.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerolab import comm
from zerolab.parts.arguments import refuse_unit_arguments
from zerolab.parts.at_rest import AtRest
from zerolab.parts.habits import hook_gathered_state, keep_last
from zerolab.parts.materialize import materialize, materialize_flat, param_names
from zerolab.parts.nest import tensors_in
from zerolab.parts.post_backward import Uses
from zerolab.sharding import FlatLayout, Slot, unflatten
from zerolab.units import Unit, UnitSpec, bucket_runs, make_units, neighbour
from zerolab.zero2 import GradShardedBucket, ZeRO2


@dataclass(frozen=True)
class ZeRO3Options:
    """ZeRO-3's keyword arguments (FSDP2's knobs); no bucket_bytes: a unit is a bucket."""

    units: Sequence[UnitSpec] | None = None  # the modules that form the units (units.py)
    prefetch: bool = True  # gather the next unit while this one computes
    reshard_after_forward: bool = True  # False: units stay gathered from forward to backward


class ZeRO3(ZeRO2):
    name = "zero3"
    Options = ZeRO3Options
    keeps_root = True  # the root stays gathered from forward to backward (FSDP2's does)
    params_whole_at_rest = False  # shards only: a whole-parameter step gathers values too

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer],
                 **kwargs: Any):
        refuse_unit_arguments(type(self).__name__, self.Options, kwargs)  # parts/arguments.py
        super().__init__(model, optimizer_cls, **kwargs)

    @property
    def reshard_after_forward(self) -> bool:  # ZeRO3Options.reshard_after_forward
        return self.options.reshard_after_forward

    # ---- set-up: each unit's shards -----------------------------------------------------------

    def _make_buckets(self) -> list[GradShardedBucket]:
        """The units (units.py, the root last); per unit, a flat bucket of its trainable
        parameters and one of its frozen ones (never reduced); one per group and dtype."""
        self.units = make_units(self.module, self.options.units)
        self.root = self.units[-1]
        for unit in self.units:
            unit.buckets = [GradShardedBucket(name, run, FlatLayout.of(run, self.world_size))
                            for name, run in bucket_runs(unit, self.groups.key)]
        self._unit_of = {b.name: u for u in self.units for b in u.buckets}
        return [b for u in self.units for b in u.buckets if b.params[0].requires_grad]

    @property
    def reduce_order(self) -> list[GradShardedBucket]:  # backward's: blocks last first, root
        return [b for u in (*self.units[-2::-1], self.root) for b in u.buckets
                if b.params[0].requires_grad]

    def _materialize(self) -> None:  # buffers only: _shard_model builds a meta model's units
        materialize(self.module, self.device, params=False)

    def _shard_model(self) -> None:
        """Give each rank its own shard of every flat_param, then free the full buffers."""
        self._start_gathers()  # ZeRO-1's
        self.at_rest = AtRest()  # no write to a freed parameter is lost (parts/at_rest.py)
        names = param_names(self.module)
        for unit in self.units:
            for b in unit.buckets:
                flat = None
                if b.params[0].is_meta:  # born sharded: build this unit now, in full, once
                    flat = materialize_flat(self.module, b.params, [names[p] for p in b.params],
                                            b.layout, self.device)
                self._flatten_params(b, flat)  # ZeRO-1's: flat_param, views, local_shard view
                b.local_shard.data = b.local_shard.detach().clone()  # its own (shard_numel,)
                if b.local_shard.requires_grad:
                    self._grad_buffer(b)  # ZeRO-2's gradient shard
            self.reshard(unit)

    def frozen_slots(self) -> list[Slot]:
        """Frozen parameters are sharded too: this rank's shard of each unit's frozen bucket."""
        return [Slot(b.local_shard, tuple(b.params), b.layout)
                for u in self.units for b in u.buckets if not b.params[0].requires_grad]

    # ---- unshard / reshard ---------------------------------------------------------------------

    def unshard(self, unit: Unit, phase: str, async_op: bool = False) -> None:
        """All-gather the unit's full parameters (async_op: issue it now, finish on next call)."""
        if unit.unsharded:
            return
        if not unit.gathers:  # not already prefetched
            for b in unit.buckets:
                storage = b.flat_param.untyped_storage()
                storage.resize_(b.layout.padded_numel * b.flat_param.element_size())
                unit.gathers.append(self._gather(b, phase, async_op))
        if async_op:
            return
        for handle in unit.gathers:
            handle.wait()
        unit.gathers.clear()
        for b in unit.buckets:
            self.at_rest.check(b.params, type(self).__name__)
            for p, view in zip(b.params, unflatten(b.flat_param, b.layout)):
                p.data = view
        unit.unsharded = True

    def _gather(self, b: GradShardedBucket, phase: str, async_op: bool) -> comm.Handle:
        """Fill b.flat_param (padded_numel,) from every rank's b.local_shard (shard_numel,):
        an all-gather in full precision over the engine's group. (ZeRO++ moves fewer bytes.)"""
        return comm.all_gather(b.flat_param, b.local_shard.detach(),
                               tag=f"{self.name}/{phase}/{b.name}", group=self.group,
                               async_op=async_op)

    def reshard(self, unit: Unit) -> None:
        """Free the unit's full parameters; only the local shards remain."""
        for handle in unit.gathers:  # a prefetch that was never used
            handle.wait()
        unit.gathers.clear()
        for b in unit.buckets:
            for p in b.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self.at_rest.freed(b.params)
            # Resizing the storage (rather than dropping the tensor) frees the memory even where
            # autograd saved a view of a parameter for backward; unshard refills the same storage.
            b.flat_param.untyped_storage().resize_(0)
        unit.unsharded = False

    # ---- the hooks, in the order they run -----------------------------------------------------

    def _hook_modules(self) -> None:
        """Each unit's modules: unshard before their forward, reshard after it (and after any
        forward hook registered later: parts/habits.py, keep_last); inputs watched (_leave)."""
        for unit in self.units:
            unit.uses = Uses(unit, lambda u=unit: self._leave(u))  # parts/post_backward.py
            for module in unit.modules:
                module.register_forward_pre_hook(lambda m, args, u=unit: self.pre_forward(u))
                module.register_forward_pre_hook(lambda m, args, u=unit: u.uses.wrap(args))
                keep_last(module, lambda m, args, out, u=unit: self.post_forward(u, out))

    # Note: under activation checkpointing, backward runs a unit's forward again (its hooks
    # too) after pre_backward gathered it: pre_forward must not prefetch forward's next unit,
    # nor post_forward reshard what backward is about to use. As FSDP2's, a unit knows it is in
    # backward, and its forward hooks do nothing until post_backward.

    def pre_forward(self, unit: Unit) -> None:
        if unit.in_backward:  # a checkpoint's recompute: pre_backward gathered it
            return
        self.unshard(unit, "fwd")
        if self.prefetch and (nxt := neighbour(self.units, unit, +1)) is not None:
            self.unshard(nxt, "fwd", async_op=True)

    def post_forward(self, unit: Unit, output) -> None:
        if unit.in_backward:  # a checkpoint's recompute: keep the unit for its backward
            return
        if self.reshard_after_forward:  # False: every unit stays gathered for its backward
            for u in self._freed_after_forward(unit, output):
                self.reshard(u)
        for t in tensors_in(output):
            if t.requires_grad:  # fires when the gradient w.r.t. this output is ready
                t.register_hook(lambda grad, u=unit: self.pre_backward(u))

    def _freed_after_forward(self, unit: Unit, output) -> list[Unit]:
        """The unit; after the root's forward, every unit but the root if a backward follows."""
        if unit is not self.root:
            return [unit]
        keep = self.keeps_root and any(t.requires_grad for t in tensors_in(output))
        return [u for u in self.units if not (keep and u is self.root)]

    def pre_backward(self, unit: Unit) -> None:
        unit.in_backward = True
        self.unshard(unit, "bwd")
        if self.prefetch and (prev := neighbour(self.units, unit, -1)) is not None:
            self.unshard(prev, "bwd", async_op=True)

    def _bucket_ready(self, bucket: GradShardedBucket) -> None:
        """post_backward: every gradient of the unit is in: reduce-scatter, then reshard."""
        super()._bucket_ready(bucket)  # ZeRO-2's reduce-scatter (skipped inside no_sync())
        unit = self._unit_of[bucket.name]
        unit.ready += 1  # its buckets ready in this backward (post_backward counts afresh)
        if unit.ready == sum(b.params[0].requires_grad for b in unit.buckets):  # all of them
            self.post_backward(unit)

    def post_backward(self, unit: Unit) -> None:
        unit.in_backward, unit.ready = False, 0
        self.reshard(unit)

    def _leave(self, unit: Unit) -> None:
        """post_backward where a branch this rank skipped left a gradient out (parts/post_
        backward.py): it counts as zeros (ZeRO-2's _reduce), reduced in reduce_order as ever."""
        if unit.in_backward:
            for b in unit.buckets:
                if b.params[0].requires_grad and not b.due:
                    b.ready, b.due = 0, self._backward_syncs
            self._reduce_due()
            self.post_backward(unit)

    def _reduce_rest(self) -> None:  # the last backward left units: end them, then DDP's
        for unit in (*self.units[-2::-1], self.root):
            self._leave(unit)
        super()._reduce_rest()

    def _finish_backward(self) -> None:
        super()._finish_backward()  # reduces what backward did not (unused parameters)
        for unit in self.units:  # units with frozen parameters only, and unused prefetches
            self.post_backward(unit)

    def _after_step(self) -> None:  # nothing to gather: each forward gathers its units
        pass

    def _hook_module_state(self) -> None:  # first: a load fills the shards, then the masters
        hook_gathered_state(self)  # model.state_dict(): full tensors (parts/habits.py)
        super()._hook_module_state()

    def state_tensors(self):
        state = super().state_tensors()  # a gather writes straight into flat_param: "params"
        state["params"] = [t for u in self.units for b in u.buckets
                           for t in (b.local_shard, b.flat_param)]
        return state
