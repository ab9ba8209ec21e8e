"""Matrix optimizers (Adafactor, Muon) on ZeRO-1/2/3: each parameter stepped whole, by one rank.

    engine = zerolab.ZeRO3(model, torch.optim.Adafactor, lr=1e-2)
    engine = zerolab.ZeRO2(model, torch.optim.Muon, lr=0.02, param_groups=[
        {"params": matrices}, {"params": others, "optimizer": torch.optim.AdamW, "lr": 3e-4}])

Why: an elementwise optimizer (SGD, AdamW) updates each element from that element's history,
so it may step any slice of a flat buffer (parts/arguments.py). A matrix optimizer may not:
Adafactor keeps one second moment per row and one per column of a matrix (and scales its step
by the parameter's RMS), Muon orthogonalises each matrix's update (Newton-Schulz on the whole
matrix). Stepped on a flat shard, a 1-D piece of several matrices, either trains another model.

The design: ZeRO-1/2/3 keep their layout, their reduce-scatter and their gathers. At step()
every trainable parameter has an owner, the rank whose shard holds most of its elements
(ties: the lower rank), and one all-to-all per bucket moves each piece where it must go:

1. `whole.grad`: every rank sends the owner its part of the parameter's reduced gradient;
2. `whole.value`: where the owner does not hold the parameter's fp32 value whole (ZeRO-3 keeps
   shards at rest; a 16-bit model's fp32 masters are shards), the ranks send their parts of it;
3. the owner's torch optimizer steps the whole tensor: its state (Muon's momentum, Adafactor's
   row and column moments) lives on the owner alone, so it stays sharded, by parameter;
4. `whole.update`: the owner sends each rank the new values of its part, into its shard (then
   ZeRO-1/2 all-gather the parameters as always; ZeRO-3's next forward gathers them).

Bytes. For a parameter p, outside(p) = its elements outside its owner's shard (0 when p lies
in one shard, at most (N-1)/N of it). Each transfer moves Σ_p outside(p) elements over all
ranks: 2 transfers in fp32 on ZeRO-1/2 (the owner reads p's values from the full flat_param),
3 on ZeRO-3 and with param_dtype (the values travel too). `extra_bytes` is the formula.
Other designs, for Ψ matrix elements cut across all N shards: every rank all-gathers each
gradient and orthogonalises redundantly (Moonlight's Muon; FSDP2's dim-0 shards need the same
gather): (N-1)Ψ elements received over all ranks, and each matrix computed N times. The owner
moves 2(N-1)/N·Ψ (ZeRO-1/2): the same at N = 2, fewer from N = 3, each matrix computed once.
The owner holds its whole matrices (fp32) during step() only: their storage is freed after.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerolab import comm
from zerolab.sharding import FlatLayout, Slot

GROUP_OPTIMIZER = "optimizer"  # a param group's own optimizer class (Muon's 1-D parameters)
MUON_GROUPS = ("param_groups=[{'params': matrices}, {'params': others, "
               "'optimizer': torch.optim.AdamW, 'lr': 3e-4}]")


def parts_in_shards(layout: FlatLayout) -> list[list[int]]:
    """Per parameter of the layout, its elements in each rank's shard: [k][rank]."""
    s = layout.shard_numel
    out = []
    for offset, shape in zip(layout.offsets, layout.shapes):
        a, b = offset, offset + shape.numel()
        out.append([max(0, min(b, (r + 1) * s) - max(a, r * s)) for r in range(layout.world_size)])
    return out


def owners(layout: FlatLayout) -> list[int]:
    """Per parameter, the rank whose shard holds most of it (ties: the lower rank)."""
    return [max(range(len(parts)), key=lambda r: (parts[r], -r))
            for parts in parts_in_shards(layout)]


def outside_numel(layout: FlatLayout) -> int:
    """Σ_p outside(p): elements of the parameters outside their owners' shards (the Note)."""
    return sum(sum(parts) - parts[o] for parts, o in zip(parts_in_shards(layout), owners(layout)))


def extra_bytes(layouts: list[FlatLayout], grad_bytes: int, value_bytes: int,
                values_travel: bool) -> int:
    """The formula: bytes all ranks send together in one step() for the whole-parameter step
    (gradients in grad_bytes per element; values and updates in value_bytes, the masters')."""
    outside = sum(outside_numel(layout) for layout in layouts)
    return outside * (grad_bytes + value_bytes * (2 if values_travel else 1))


@dataclass(frozen=True)
class Route:
    """How one bucket's pieces travel, from this rank: to the owners, and back."""

    owned: tuple[int, ...]  # the bucket's parameters this rank owns (indices into its params)
    send_index: torch.Tensor  # positions in this rank's shard, grouped by owner (rank order)
    send_splits: list[int]  # elements this rank sends each rank
    recv_index: torch.Tensor  # where what arrives (source rank order) goes in `owned`'s flat
    recv_splits: list[int]  # elements this rank receives from each rank


def route(layout: FlatLayout, rank: int) -> Route:
    s, n = layout.shard_numel, layout.world_size
    who = owners(layout)
    spans = [(o, o + shape.numel()) for o, shape in zip(layout.offsets, layout.shapes)]
    owned = tuple(k for k in range(len(spans)) if who[k] == rank)
    at, start = {}, 0  # owned parameter -> its first element in the owned flat
    for k in owned:
        at[k], start = start, start + spans[k][1] - spans[k][0]

    def part(k: int, r: int) -> tuple[int, int]:  # parameter k's elements in rank r's shard
        return max(spans[k][0], r * s), min(spans[k][1], (r + 1) * s)

    send, send_splits, recv, recv_splits = [], [], [], []
    for j in range(n):  # to rank j: my parts of the parameters j owns
        pieces = [part(k, rank) for k in range(len(spans)) if who[k] == j]
        send += [torch.arange(a - rank * s, b - rank * s) for a, b in pieces if a < b]
        send_splits.append(sum(max(0, b - a) for a, b in pieces))
    for i in range(n):  # from rank i: its parts of the parameters I own
        pieces = [(k, *part(k, i)) for k in owned]
        recv += [torch.arange(at[k] + a - spans[k][0], at[k] + b - spans[k][0])
                 for k, a, b in pieces if a < b]
        recv_splits.append(sum(max(0, b - a) for _, a, b in pieces))
    empty = torch.zeros(0, dtype=torch.long)
    return Route(owned, torch.cat(send) if send else empty, send_splits,
                 torch.cat(recv) if recv else empty, recv_splits)


class OwnerOptimizer(torch.optim.Optimizer):
    """engine.optimizer: the user's parameter groups, in their order, on every rank (an LR
    scheduler's lambdas line up), each holding the whole tensors this rank owns (maybe none).
    A group is stepped by its own torch optimizer: the engine's class, or the one it names
    (GROUP_OPTIMIZER); their state is one dict, keyed by the whole tensors."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        super().__init__([{"params": []}], {})
        self.parts = parts
        self.defaults = parts[0].defaults
        self.param_groups = [g for o in parts for g in o.param_groups]  # the same dicts
        self.state = defaultdict(dict)
        for o in parts:
            o.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # the engine's own call (parts/habits.py routes the user's)
        for o in self.parts:
            o.step()


class WholeParams:
    """The whole-parameter step of a sharded engine (the module docstring)."""

    def __init__(self, engine: Any, optimizer_cls: type[torch.optim.Optimizer],
                 kwargs: dict[str, Any]):
        self.engine = engine
        slots: list[Slot] = engine.slots
        # The owner reads p whole from the module (ZeRO-1/2's full flat_param) in fp32 only.
        self.values_travel = [not engine.params_whole_at_rest or m is not s.tensor
                              for s, m in zip(slots, engine.masters)]
        self.routes = [route(s.layout, engine.rank) for s in slots]
        self.flats: list[torch.Tensor] = []  # per slot, the owned parameters end to end
        self.wholes: list[list[nn.Parameter]] = []  # views of it, shaped as the parameters
        for s, m, r in zip(slots, engine.masters, self.routes):
            numel = sum(s.layout.shapes[k].numel() for k in r.owned)
            flat = torch.zeros(numel, dtype=m.dtype, device=m.device)
            views, at = [], 0
            for k in r.owned:
                shape = s.layout.shapes[k]
                views.append(nn.Parameter(flat[at:at + shape.numel()].view(shape)))
                at += shape.numel()
            flat.untyped_storage().resize_(0)  # held during step() only
            self.flats.append(flat)
            self.wholes.append(views)
        self.optimizer = OwnerOptimizer(self._parts(optimizer_cls, kwargs))

    def _parts(self, optimizer_cls: type[torch.optim.Optimizer],
               kwargs: dict[str, Any]) -> list[torch.optim.Optimizer]:
        """One torch optimizer per parameter group, over this rank's whole tensors in it."""
        groups = self.engine.groups
        names = {p: n for n, p in self.engine.module.named_parameters()}
        mine: dict[int, list[nn.Parameter]] = defaultdict(list)
        not_2d: dict[int, list[str]] = defaultdict(list)  # ZeRO-3's params are empty: shapes
        for s, r, wholes in zip(self.engine.slots, self.routes, self.wholes):
            for p, shape in zip(s.params, s.layout.shapes):
                if len(shape) != 2:
                    not_2d[groups.index[p]].append(names[p])
            for k, w in zip(r.owned, wholes):
                mine[groups.index[s.params[k]]].append(w)
        parts = []
        for g, options in enumerate(groups.options):
            cls = options.get(GROUP_OPTIMIZER, optimizer_cls)
            own = {k: v for k, v in options.items() if k != GROUP_OPTIMIZER}
            check_group_optimizer(cls, g, not_2d[g])
            # A group naming its own class takes its own options only (as a second torch
            # optimizer would); the engine's keyword arguments are its class's defaults.
            parts.append(cls([{"params": mine[g], **own}],
                             **(kwargs if cls is optimizer_cls else {})))
        return parts

    # ---- step() ----------------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer,
             pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The engine's step, in place of MixedPrecisionPolicy.step (same signature): the
        gradient shards go to the owners, the owners step, the new values come back."""
        e = self.engine
        e.wait_params()  # ZeRO-1/2 prefetch: the module's values are the last step's
        tags = [f"{e.name}/step/{b.name}" for b in e.buckets]  # a slot per bucket
        for i, (s, (master, _)) in enumerate(zip(e.slots, pairs)):
            r, flat = self.routes[i], self.flats[i]
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            grad = s.tensor.grad if s.tensor.grad is not None else torch.zeros_like(s.tensor)
            arrived = to_owners(grad, r, f"{tags[i]}/whole.grad", e.group)
            at = 0
            for w in self.wholes[i]:  # a view of what arrived, in the master's dtype
                w.grad = arrived[at:at + w.numel()].view_as(w).to(w.dtype)
                at += w.numel()
            if self.values_travel[i]:
                flat.copy_(to_owners(master.detach(), r, f"{tags[i]}/whole.value", e.group))
            else:
                with torch.no_grad():
                    for k, w in zip(r.owned, self.wholes[i]):
                        w.copy_(s.params[k].detach())
        optimizer.step()
        with torch.no_grad():
            for i, (master, t) in enumerate(pairs):
                r, flat = self.routes[i], self.flats[i]
                from_owners(flat, master.detach(), r, f"{tags[i]}/whole.update", e.group)
                for w in self.wholes[i]:
                    w.grad = None
                flat.untyped_storage().resize_(0)
                if master is not t:
                    t.copy_(master)  # rounded to the compute dtype


def to_owners(shard: torch.Tensor, r: Route, tag: str, group: Any = None) -> torch.Tensor:
    """This rank's parts of each parameter (from its (shard_numel,) shard) to their owners,
    one all-to-all; returns what this rank received, laid out as its owned parameters end to
    end (it arrives by source rank, then parameter: r.recv_index says where each goes)."""
    sent = shard.reshape(-1)[r.send_index]
    got = torch.empty(sum(r.recv_splits), dtype=shard.dtype, device=shard.device)
    comm.all_to_all(got, sent, tag=tag, group=group, output_split_sizes=r.recv_splits,
                    input_split_sizes=r.send_splits)
    out = torch.empty_like(got)
    out[r.recv_index] = got
    return out


def from_owners(owned: torch.Tensor, shard: torch.Tensor, r: Route, tag: str,
                group: Any = None) -> None:
    """The reverse: each owner sends every rank the new values of that rank's parts (owned:
    its owned parameters end to end), written into `shard` (shard_numel,) in place."""
    back = torch.empty(sum(r.send_splits), dtype=owned.dtype, device=owned.device)
    comm.all_to_all(back, owned[r.recv_index], tag=tag, group=group,
                    output_split_sizes=r.send_splits, input_split_sizes=r.recv_splits)
    with torch.no_grad():
        shard.view(-1).index_copy_(0, r.send_index, back.to(shard.dtype))


def check_group_optimizer(cls: Any, group: int, not_2d: list[str]) -> None:
    """A param group's optimizer: a torch optimizer class; Muon's parameters 2-D."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"param_groups[{group}]['{GROUP_OPTIMIZER}'] must be a torch.optim."
                        f"Optimizer subclass such as torch.optim.AdamW, got {cls!r}")
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and issubclass(cls, muon) and not_2d:
        raise ValueError(
            f"torch.optim.Muon orthogonalises 2-D matrices only, and {len(not_2d)} trainable "
            f"parameter(s) are not 2-D ({', '.join(not_2d[:4])}{', ...' if len(not_2d) > 4 else ''}"
            f"). As torch's docs advise, give them a standard optimizer in a group of their "
            f"own: {MUON_GROUPS}")


def refuse_optimizer_state(engine: Any) -> None:
    """Checkpoints of a whole-parameter engine's optimizer state: not written yet (its state is
    keyed by the owners' whole tensors, not by the shards a checkpoint saves)."""
    if getattr(engine, "whole", None) is not None:
        raise NotImplementedError(
            f"{type(engine).__name__} with {type(engine.optimizer.parts[0]).__name__}: each "
            f"parameter is stepped whole by one rank, which holds its optimizer state, and "
            f"checkpoints of that state are not written yet. Save the weights "
            f"(engine.full_state_dict()) and restart the optimizer, or train with AdamW.")


def refuse_group_optimizers(groups: Any, engine: str) -> None:
    """A param group naming its own optimizer, where the engine steps flat shards or tiles
    with one optimizer (an elementwise one, or DDP): refused, not silently ignored."""
    named = [g for g, options in enumerate(groups.options) if GROUP_OPTIMIZER in options]
    if named:
        raise TypeError(f"{engine}: param_groups[{named[0]}] names its own '{GROUP_OPTIMIZER}'; "
                        f"only ZeRO-1/2/3 with a matrix optimizer (Adafactor, Muon) step "
                        f"groups with optimizers of their own. Leave the key out, or use "
                        f"torch.optim.Muon on zerolab.ZeRO1/ZeRO2/ZeRO3.")
