"""The engines' sharded state dicts, in the terms of torch.distributed.checkpoint (DCP).

    sd = engine_state_dict(engine)      # this rank's part, keyed like the plain model's
    dcp_files.write(sd, path, group)    # DCP: every rank writes its chunks, rank 0 the metadata
    load_engine_state_dict(engine, full)  # a full state dict ({"model": .., "optimizer": ..})

The keys are torch's: `sd["model"]` is keyed like the plain model's `state_dict()` (a tied
weight under each of its names), `sd["optimizer"]` like FSDP2's
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`: {"state": {name: {"exp_avg":
.., "exp_avg_sq": .., "step": ..}}, "param_groups": [{"lr": .., ..., "params": [names]}]}, a
tied weight under its first name. So a checkpoint written from these loads into FSDP2, into a
plain model (`format_utils.dcp_to_torch_save`), and back, at any world size.

Note: why chunks. FSDP2 shards each parameter on dim 0 (a DTensor, Shard(0)): a rank holds some
whole rows of every parameter. A zerolab rank holds a range of a flat buffer that runs through
several parameters end to end (sharding.py), so of one (rows, cols) parameter it holds a
partial row, then whole rows, then a partial row. DCP describes a tensor as rectangular chunks
(offsets, sizes) that any ranks wrote, and reads any chunking into any other (it intersects the
rectangles). So each rank cuts its flat range into the fewest rectangles (`boxes`), each a
contiguous run of its flat shard: a view, no copy; DCP's metadata lists them, and a reader at
another world size, or FSDP2, or a single process, reads the rectangles it needs.

DCP's default planners take plain tensors, DTensors and ShardedTensors. Chunks are none of
those, so two small planners (subclasses of the documented DefaultSavePlanner /
DefaultLoadPlanner) add a write item per piece on save and a read item per overlap on load
(DCP's `planner_helpers.create_read_items_for_chunk_list`); everything else (buffers, Adam's
step, the param groups) goes through DCP's own code. They live in parts/dcp_files.py.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zerolab.parts.whole_params import refuse_optimizer_state
from zerolab.sharding import Slot

if TYPE_CHECKING:  # the engine contract: the shell (a cycle at run time)
    from zerolab.shell import EngineShell

MODEL, OPTIMIZER = "model", "optimizer"  # the top-level keys (torchtitan's)
Path = tuple[Any, ...]  # where a value sits in a nested state dict: ("model", "wte.weight")


# ---- a flat range of a tensor as rectangles ------------------------------------------------


@dataclass(frozen=True)
class Box:
    """A rectangle of a tensor that is one contiguous run of its row-major elements."""

    offsets: tuple[int, ...]  # its first element, per dimension
    sizes: tuple[int, ...]  # its extent, per dimension
    start: int  # the flat (row-major) index of its first element

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def boxes(shape: tuple[int, ...], start: int, end: int) -> list[Box]:
    """The fewest rectangles that cover the flat elements [start, end) of a tensor of `shape`,
    in flat order: a partial first row, the whole rows, a partial last row (each partial row
    cut the same way, one dimension down)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [Box((start,) * len(shape), (end - start,) * len(shape), start)]
    row = math.prod(shape[1:])  # elements per index of dim 0
    first_full, end_full = -(-start // row), end // row  # whole rows [first_full, end_full)

    def inside(r: int, a: int, b: int) -> list[Box]:  # flat [a, b) of row r, 0 <= a < b <= row
        return [Box((r, *x.offsets), (1, *x.sizes), r * row + x.start)
                for x in boxes(shape[1:], a, b)]

    if first_full > end_full:  # start and end in the same row
        r = start // row
        return inside(r, start - r * row, end - r * row)
    out = inside(first_full - 1, start % row, row) if start % row else []
    if end_full > first_full:
        out.append(Box((first_full, *(0,) * (len(shape) - 1)),
                       (end_full - first_full, *shape[1:]), first_full * row))
    if end % row:
        out += inside(end_full, 0, end % row)
    return out


@dataclass
class Chunks:
    """What this rank holds of one full tensor: rectangular pieces, each a view of its own."""

    shape: torch.Size  # the full tensor's
    pieces: list[tuple[tuple[int, ...], torch.Tensor]]  # (offsets, a tensor of the piece's shape)


def slot_pieces(slot: Slot, flat: torch.Tensor, rank: int,
                shapes: list[torch.Size]) -> list[list[tuple[Box, torch.Tensor]]]:
    """Per parameter of `slot`: the boxes of it that `flat` holds, with their views into `flat`.

    flat: 1-D, what this rank holds under the slot's layout: the parameter itself, whole
    (layout None), or its (shard_numel,) shard of the flat run of the slot's parameters.
    """
    if slot.layout is None:
        (shape,) = shapes
        return [[(Box((0,) * len(shape), tuple(shape), 0), flat.view(shape))]]
    lo, hi = slot.layout.shard_range(rank)
    out = []
    for offset, shape in zip(slot.layout.offsets, shapes):
        a, b = max(offset, lo), min(offset + math.prod(shape), hi)  # its elements in my range
        out.append([(x, flat[offset + x.start - lo:offset + x.start - lo + x.numel].view(x.sizes))
                    for x in boxes(tuple(shape), a - offset, b - offset)])
    return out


# ---- what an engine holds, keyed like the plain model ----------------------------------------


def state_dict_keys(module: nn.Module) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    """The keys of module.state_dict() and the tensors behind them, without calling it (under
    ZeRO-3 the parameters are empty at rest): {key: parameter} (a tied weight under each of
    its names) and {key: persistent buffer}."""
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, buf in m.named_buffers(recurse=False):
            # nn.Module keeps which buffers state_dict() leaves out in this set (no public API)
            if name not in m._non_persistent_buffers_set:
                buffers[f"{prefix}.{name}" if prefix else name] = buf
    return params, buffers


def held(engine: EngineShell) -> list[tuple[Slot, torch.Tensor]]:
    """(slot, the fp32 tensor holding its values): the trainable slots with their masters (what
    the optimizer steps), then the frozen ones with their own tensors."""
    return [*zip(engine.slots, engine.masters), *((s, s.tensor) for s in engine.frozen_slots())]


def _shapes(slot: Slot) -> list[torch.Size]:
    # The layout keeps the shapes: ZeRO-3's parameters are empty at rest.
    return [p.shape for p in slot.params] if slot.layout is None else list(slot.layout.shapes)


def engine_state_dict(engine: EngineShell) -> dict:
    """This rank's part of the engine's model and optimizer, as Chunks of the full tensors
    (views of the masters; the optimizer state joined from its tiles), plain tensors (buffers,
    Adam's step) and the param groups. Collective-free; call engine.wait_params() first."""
    refuse_optimizer_state(engine)  # a whole-parameter step's state (parts/whole_params.py)
    keys, buffers = state_dict_keys(engine.module)
    names_of: dict[nn.Parameter, list[str]] = {}
    for key, p in keys.items():
        names_of.setdefault(p, []).append(key)
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for i, (slot, values) in enumerate(held(engine)):
        shapes = _shapes(slot)
        for p, shape, pieces in zip(slot.params, shapes,
                                    slot_pieces(slot, values.detach().reshape(-1), engine.rank,
                                                shapes)):
            for key in names_of[p]:
                model[key] = Chunks(shape, [(b.offsets, v) for b, v in pieces])
        if i >= len(engine.slots):
            continue  # frozen: no optimizer state
        for k, v in engine.tiles.state(engine.optimizer, values).items():
            per_element = torch.is_tensor(v) and v.dim() > 0 and v.numel() == values.numel()
            by_param = slot_pieces(slot, v.reshape(-1), engine.rank, shapes) if per_element \
                else None
            for j, (p, shape) in enumerate(zip(slot.params, shapes)):
                state.setdefault(names_of[p][0], {})[k] = (
                    Chunks(shape, [(b.offsets, t) for b, t in by_param[j]]) if per_element
                    else v)
    model.update({k: b.detach() for k, b in buffers.items()})
    return {MODEL: model, OPTIMIZER: {"state": state, "param_groups": param_groups(engine)}}


def param_groups(engine: EngineShell) -> list[dict[str, Any]]:
    """The optimizer's param groups as torch's state dicts write them: the options, and the
    names of the parameters in each group (a group's tiles -> masters -> slots -> parameters)."""
    first_name = {p: n for n, p in engine.module.named_parameters()}
    order = list(first_name)
    master_of = {id(t): i for i, ts in enumerate(engine.tiles.tiles) for t, _, _ in ts}
    groups = []
    for group in engine.optimizer.param_groups:
        params = {p for t in group["params"] for p in engine.slots[master_of[id(t)]].params}
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [first_name[p] for p in order if p in params]})
    return groups


# ---- loading into an engine ------------------------------------------------------------------


@dataclass
class Targets:
    """Where a load puts each value it reads: a nested state dict of Chunks whose pieces are
    views of the engine's own tensors (parameters, masters, shards) or of optimizer state
    waiting to be handed to the optimizer (`optimizer_state`), plus plain values."""

    sd: dict  # {"model": {key: Chunks | buffer}, "optimizer": {"state": .., "param_groups": ..}}
    optimizer_state: list[dict[str, Any]]  # per master: {key: (master numel,) tensor | value}


TensorKind = tuple[torch.Size, torch.dtype] | None  # a saved tensor's shape, dtype; None: not one


def targets(engine: EngineShell, optimizer_keys: dict[str, dict[str, TensorKind]],
            group_keys: list[list[str]]) -> Targets:
    """Load targets for `engine`. optimizer_keys: per parameter name, its optimizer state keys
    in the checkpoint, with what each is; group_keys: per param group saved, its keys. Every
    rank builds them from the same checkpoint."""
    check_saved_optimizer(engine, optimizer_keys, len(group_keys))
    _, buffers = state_dict_keys(engine.module)
    first_name = {p: n for n, p in engine.module.named_parameters()}
    model: dict[str, Any] = {}
    for slot, values in held(engine):
        shapes = _shapes(slot)
        own = slot_pieces(slot, values.detach().reshape(-1), engine.rank, shapes)
        stepped = own if slot.tensor is values else slot_pieces(
            slot, slot.tensor.detach().reshape(-1), engine.rank, shapes)
        for p, shape, pieces, stepped_pieces in zip(slot.params, shapes, own, stepped):
            # Every tensor that holds this parameter's values, each storage once: the module's
            # parameter where it is held whole now (DDP, ZeRO-1/2: the other ranks' part of it
            # too), the master (fp32; in ZeRO-1/2 a view of the same flat buffer), and the
            # stepped tensor where it is another (bf16).
            groups = [(values, pieces), (slot.tensor, stepped_pieces)]
            if p.numel() == math.prod(shape):
                groups.insert(0, (p, [(Box((0,) * len(shape), tuple(shape), 0), p.detach())]))
            dest, used = Chunks(shape, []), set()
            for tensor, group in groups:
                if tensor.untyped_storage().data_ptr() not in used:
                    used.add(tensor.untyped_storage().data_ptr())
                    dest.pieces += [(b.offsets, t) for b, t in group]
            model[first_name[p]] = dest
    model.update({k: b.detach() for k, b in buffers.items()})
    state: dict[str, dict[str, Any]] = {}
    per_master: list[dict[str, Any]] = []
    for slot, master in zip(engine.slots, engine.masters):
        shapes = _shapes(slot)
        saved = optimizer_keys.get(first_name[slot.params[0]], {})
        joined: dict[str, Any] = {}
        for k, kind in saved.items():
            if kind is not None and len(kind[0]) > 0:  # per element: (master numel,) zeros
                joined[k] = torch.zeros(master.numel(), dtype=kind[1], device=master.device)
                for p, shape, pieces in zip(slot.params, shapes,
                                            slot_pieces(slot, joined[k], engine.rank, shapes)):
                    state.setdefault(first_name[p], {})[k] = Chunks(
                        shape, [(b.offsets, t) for b, t in pieces])
            else:  # per tensor (Adam's step): read from the slot's first parameter
                joined[k] = torch.zeros(kind[0], dtype=kind[1]) if kind is not None else None
                state.setdefault(first_name[slot.params[0]], {})[k] = joined[k]
        per_master.append(joined)
    groups = [dict.fromkeys(names) for names in group_keys]
    return Targets({MODEL: model, OPTIMIZER: {"state": state, "param_groups": groups}},
                   per_master)


def check_saved_optimizer(engine: EngineShell, optimizer_keys: dict[str, dict[str, TensorKind]],
                          saved_groups: int) -> None:
    """A checkpoint's optimizer loads only into the same kind of optimizer, with as many
    parameter groups: another optimizer's state would fail at the next step, and groups
    folded into fewer would lose their options without a word."""
    mine = len(engine.optimizer.param_groups)
    if saved_groups and saved_groups != mine:
        raise ValueError(f"the checkpoint's optimizer has {saved_groups} parameter groups, this "
                         f"engine's {mine}: build the engine with the param_groups=[...] the "
                         f"saved one had, then load.")
    saved = {frozenset(keys) for keys in optimizer_keys.values() if keys}
    if not saved:
        return
    expected = frozenset(_state_keys(engine.optimizer))
    if saved != {expected}:
        found = sorted({k for keys in saved for k in keys})
        raise ValueError(f"the checkpoint's optimizer state holds {found}; this engine's "
                         f"{type(engine.optimizer).__name__} keeps {sorted(expected)}: it was "
                         f"saved from another optimizer (or other options). Build the engine "
                         f"with the optimizer class and options it was saved with.")


def _state_keys(optimizer: torch.optim.Optimizer) -> set[str]:
    """The state keys one step of this optimizer's class and options gives a parameter."""
    probe = torch.zeros(1, requires_grad=True)
    probe.grad = torch.zeros(1)
    takes = inspect.signature(type(optimizer).__init__).parameters  # defaults hold some more
    one = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in takes})
    type(one).step(one)
    return set(one.state[probe])


def finish_load(engine: EngineShell, loaded: Targets) -> None:
    """After the targets are filled: the optimizer state into the optimizer's tiles, the
    options into its param groups, each stepped tensor from its master where they differ."""
    state = loaded.sd.get(OPTIMIZER, {}).get("state", {})
    if state:
        refuse_optimizer_state(engine)  # a whole-parameter step's state (parts/whole_params.py)
    first_name = {p: n for n, p in engine.module.named_parameters()}
    for slot, master, joined in zip(engine.slots, engine.masters, loaded.optimizer_state):
        if not joined:
            continue
        head = state[first_name[slot.params[0]]]
        engine.tiles.load_state(engine.optimizer, master,
                                {k: v if torch.is_tensor(v) and v.dim() > 0 else head[k]
                                 for k, v in joined.items()})
    saved_groups = loaded.sd.get(OPTIMIZER, {}).get("param_groups", [])
    mine = param_groups(engine)
    for group, names in zip(engine.optimizer.param_groups, mine):
        source = next((g for g in saved_groups if set(names["params"]) & set(g.get("params", ()))),
                      None)
        for k, v in (source or {}).items():
            if k != "params" and k in group:
                group[k] = v


def fill(target: Any, given: Any,
         fill_chunks: Callable[[Any, Chunks, Any], None] | None = None) -> None:
    """Fill load targets from `given`, walking both together. A Chunks leaf is filled by
    `fill_chunks(key, chunks, source)`; by default its source is a full tensor (a plain state
    dict) and each piece copies its rectangle of it."""
    items = enumerate(target) if isinstance(target, list) else list(target.items())
    for k, v in items:
        if (k >= len(given)) if isinstance(given, list) else (k not in given):
            continue
        src = given[k]
        if isinstance(v, Chunks):
            (fill_chunks or _from_full)(k, v, src)
        elif isinstance(v, (dict, list)):
            fill(v, src, fill_chunks)
        elif torch.is_tensor(v):
            v.copy_(src)
        else:
            target[k] = src


def _from_full(key: Any, chunks: Chunks, full: torch.Tensor) -> None:
    for offsets, t in chunks.pieces:
        t.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))])


def load_engine_state_dict(engine: EngineShell, full: dict) -> None:
    """Load a full state dict (torch's keys: {"model": .., "optimizer": {"state": ..,
    "param_groups": ..}}, the optimizer optional) into `engine`: each rank copies its part."""
    params, _ = state_dict_keys(engine.module)
    model = dict(full[MODEL])
    for key, p in params.items():  # a tied weight given under another of its names
        first = next(k for k, q in params.items() if q is p)
        if first not in model and key in model:
            model[first] = model[key]
    optimizer = full.get(OPTIMIZER, {})
    kinds = {name: {k: (v.shape, v.dtype) if torch.is_tensor(v) else None
                    for k, v in state.items()}
             for name, state in optimizer.get("state", {}).items()}
    loading = targets(engine, kinds, [list(g) for g in optimizer.get("param_groups", [])])
    engine.wait_params()
    fill(loading.sd, {MODEL: model, OPTIMIZER: optimizer})
    finish_load(engine, loading)

