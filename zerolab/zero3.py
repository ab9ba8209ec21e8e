"""ZeRO-3: shard the parameters too. PyTorch calls this FSDP; the words here are FSDP2's.

What changes from ZeRO-2 (zero2.py):
- Parameters are grouped into *units* (a module, or a group of modules you name: what FSDP2's
  `fully_shard` is called on). Each unit's parameters are flattened and padded as before, but
  at rest a rank keeps only its shard (`local_shard`, its own small tensor); the full buffer
  `flat_param` has its storage resized to zero. Model state at rest: 16Ψ/N bytes.
- unshard: just before a unit's forward (pre_forward) and again just before its backward
  (pre_backward), its shards are all-gathered into flat_param and the module's parameters point
  into it. reshard: right after its forward (post_forward) and after its backward
  (post_backward), the storage is resized to zero again. At any moment a rank holds the shards
  plus the one or two units it is working on.
- post_backward is ZeRO-2's bucket hook: when the last gradient of a unit is accumulated, the
  unit's gradient is reduce-scattered and the unit is resharded.
- No all-gather after the step: the next forward gathers what it needs.
- Traffic per step: all-gather in forward (Ψ), again in backward (Ψ), reduce-scatter (Ψ): 3Ψ,
  1.5x DDP's 2Ψ. That is the price of holding 1/N of the parameters.
- Prefetch (on by default): when a unit starts, the all-gather of the next unit (next in forward,
  previous in backward) is issued asynchronously, so communication overlaps compute.

The root unit is the model itself, holding every parameter no other unit claims (embeddings,
final LayerNorm, an output head tied to the embedding). It is gathered for the whole forward,
as in FSDP2. A parameter shared by two units (tied weights) belongs to the root.

Default units (units=None): every child of every top-level nn.ModuleList in the model (a
transformer's blocks, an MLP's layers), else every direct child that holds parameters; the root
gets the rest. List units in the order they run: prefetch follows that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from zerolab import comm
from zerolab.sharding import FlatLayout, unflatten
from zerolab.zero2 import GradShardedBucket, ZeRO2


@dataclass
class Unit:
    """Modules whose parameters are gathered and freed together (FSDP2: one fully_shard)."""

    name: str  # "blocks.0", or "root"; used in comm tags
    modules: list[nn.Module]  # pre/post forward hooks go on these
    flat_params: list[GradShardedBucket]  # trainable first; frozen ones in their own, no grads
    unsharded: bool = False  # parameters point into gathered full buffers
    gathers: list[comm.Handle] = field(default_factory=list)  # all-gathers issued, not waited


class ZeRO3(ZeRO2):
    name = "zero3"

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 units: list[nn.Module | list[nn.Module]] | None = None,
                 prefetch: bool = True, **kwargs):
        self._requested_units = units
        self.prefetch = prefetch
        super().__init__(model, optimizer_cls, **kwargs)
        for unit in self.units:
            for module in unit.modules:
                module.register_forward_pre_hook(lambda m, args, u=unit: self.pre_forward(u))
                module.register_forward_hook(
                    lambda m, args, out, u=unit: self.post_forward(u, out))

    # ---- set-up: units and their shards -------------------------------------------------------

    def _make_buckets(self) -> list[GradShardedBucket]:
        """ZeRO-3's buckets are its units' trainable flat_params."""
        self.units = self._make_units()
        self.root = self.units[-1]
        self._unit_of = {fp.name: u for u in self.units for fp in u.flat_params}
        return [u.flat_params[0] for u in self.units
                if u.flat_params and u.flat_params[0].params[0].requires_grad]

    def _make_units(self) -> list[Unit]:
        groups = self._unit_groups()  # [(name, [modules])], root last
        claims: dict[nn.Parameter, set[int]] = {}
        for i, (_, modules) in enumerate(groups[:-1]):
            for m in modules:
                for p in m.parameters():
                    claims.setdefault(p, set()).add(i)
        units = []
        for i, (name, modules) in enumerate(groups):
            is_root = i == len(groups) - 1
            # Parameters only this unit uses; the root takes the unclaimed and the shared ones.
            params = [p for p in _distinct(p for m in modules for p in m.parameters())
                      if (claims.get(p) == {i}) or (is_root and len(claims.get(p, ())) != 1)]
            flat_params = [
                GradShardedBucket(name if trainable else f"{name}.frozen", ps,
                                  FlatLayout.of(ps, self.world_size))
                for trainable in (True, False)
                if (ps := [p for p in params if p.requires_grad == trainable])
            ]
            units.append(Unit(name, modules, flat_params))
        return units

    def _unit_groups(self) -> list[tuple[str, list[nn.Module]]]:
        names = {m: n for n, m in self.module.named_modules()}
        if self._requested_units is None:
            chosen = _default_units(self.module)
        else:
            chosen = [u if isinstance(u, (list, tuple)) else [u] for u in self._requested_units]
        groups = []
        for modules in chosen:
            for m in modules:
                if m not in names or m is self.module:
                    raise ValueError(f"units must be submodules of the model (not the model "
                                     f"itself, which is the root unit); got {type(m).__name__}")
            groups.append(("+".join(names[m] for m in modules), list(modules)))
        return groups + [("root", [self.module])]

    def _shard_model(self) -> None:
        """Give each rank its own shard of every flat_param, then free the full buffers."""
        for unit in self.units:
            for b in unit.flat_params:
                self._flatten_params(b)  # ZeRO-1: flat_param, params as views, local_shard view
                b.local_shard.data = b.local_shard.detach().clone()  # its own (shard_numel,)
                if b.local_shard.requires_grad:
                    b.grad_shard = torch.zeros_like(b.local_shard)
                    b.local_shard.grad = b.grad_shard
            self.reshard(unit)

    # ---- unshard / reshard ---------------------------------------------------------------------

    def unshard(self, unit: Unit, phase: str, async_op: bool = False) -> None:
        """All-gather the unit's full parameters (async_op: issue it now, finish on next call)."""
        if unit.unsharded:
            return
        if not unit.gathers:  # not already prefetched
            for b in unit.flat_params:
                storage = b.flat_param.untyped_storage()
                storage.resize_(b.layout.padded_numel * b.flat_param.element_size())
                unit.gathers.append(comm.all_gather(
                    b.flat_param, b.local_shard.detach(), tag=f"{self.name}/{phase}/{b.name}",
                    group=self.group, async_op=async_op))
        if async_op:
            return
        for handle in unit.gathers:
            handle.wait()
        unit.gathers.clear()
        for b in unit.flat_params:
            for p, view in zip(b.params, unflatten(b.flat_param, b.layout)):
                p.data = view
        unit.unsharded = True

    def reshard(self, unit: Unit) -> None:
        """Free the unit's full parameters; only the local shards remain."""
        for handle in unit.gathers:  # a prefetch that was never used
            handle.wait()
        unit.gathers.clear()
        for b in unit.flat_params:
            for p in b.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            # Resizing the storage (rather than dropping the tensor) frees the memory even where
            # autograd saved a view of a parameter for backward; unshard refills the same storage.
            b.flat_param.untyped_storage().resize_(0)
        unit.unsharded = False

    # ---- the hooks, in the order they run -----------------------------------------------------

    def pre_forward(self, unit: Unit) -> None:
        self.unshard(unit, "fwd")
        if self.prefetch and (nxt := self._neighbour(unit, +1)) is not None:
            self.unshard(nxt, "fwd", async_op=True)

    def post_forward(self, unit: Unit, output) -> None:
        if unit is self.root:  # the whole forward is over: leave every unit sharded
            for u in self.units:
                self.reshard(u)
        else:
            self.reshard(unit)
        for t in _tensors(output):
            if t.requires_grad:  # fires when the gradient w.r.t. this output is ready
                t.register_hook(lambda grad, u=unit: self.pre_backward(u))

    def pre_backward(self, unit: Unit) -> None:
        self.unshard(unit, "bwd")
        if self.prefetch and (prev := self._neighbour(unit, -1)) is not None:
            self.unshard(prev, "bwd", async_op=True)

    def _bucket_ready(self, bucket: GradShardedBucket) -> None:
        """post_backward: every gradient of the unit is in: reduce-scatter, then reshard."""
        super()._bucket_ready(bucket)  # ZeRO-2's reduce-scatter (skipped inside no_sync())
        self.reshard(self._unit_of[bucket.name])

    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        order = self.units[:-1]  # the root is gathered for the whole forward: never prefetched
        if unit is self.root:  # first block in forward, last block in backward
            return (order[0] if step > 0 else order[-1]) if order else None
        i = order.index(unit) + step
        return order[i] if 0 <= i < len(order) else None

    # ---- step and state ------------------------------------------------------------------------

    def _finish_backward(self) -> None:
        super()._finish_backward()  # reduces what backward did not (unused parameters)
        for unit in self.units:  # units with frozen parameters only, and unused prefetches
            self.reshard(unit)

    def _after_step(self) -> None:
        """Nothing to gather: the next forward gathers each unit when it needs it."""

    def state_tensors(self):
        state = super().state_tensors()
        state["params"] = [t for u in self.units for b in u.flat_params
                           for t in (b.local_shard, b.flat_param)]
        return state

    def pieces(self):
        names = self._names()
        master_of = {id(t): m for m, (t, _, _) in zip(self.masters, self._slots)}
        return [self._flat_piece(b, master_of.get(id(b.local_shard), b.local_shard), names)
                for u in self.units for b in u.flat_params]

    def _load_params(self, params, names) -> None:
        for unit in self.units:
            for b in unit.flat_params:
                b.local_shard.copy_(self._slice([params[names[p]] for p in b.params], b.layout))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        for unit in self.units:
            self.unshard(unit, "state_dict")
        state = super().full_state_dict()
        for unit in self.units:
            self.reshard(unit)
        return state


def _default_units(model: nn.Module) -> list[list[nn.Module]]:
    lists = [m for m in model.children() if isinstance(m, nn.ModuleList)]
    if lists:
        return [[child] for ml in lists for child in ml]
    return [[child] for child in model.children() if any(True for _ in child.parameters())]


def _distinct(params):
    seen = set()
    for p in params:
        if p not in seen:
            seen.add(p)
            yield p


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
