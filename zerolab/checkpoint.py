"""Sharded checkpoints that survive a crash, and load at any world size or stage.

    zerolab.checkpoint.save(engine, "ckpt/")      # collective: each rank writes what it owns
    zerolab.checkpoint.load(engine, "ckpt/")      # collective: any engine, any world size
    full = zerolab.checkpoint.consolidate("ckpt/")  # {"model": state_dict, "optimizer": {...}}
    zerolab.checkpoint.load_full(engine, full)

What a rank owns is described by *pieces*: a run of named parameters laid end to end (a flat
bucket, or a single parameter), the slice of it this rank holds, and the optimizer state for
that slice. A piece says which parameter names it covers, so a checkpoint does not depend on the
layout that wrote it: loading assembles full per-parameter tensors and each rank cuts its own
shard under its own layout.

Crash safety: each save writes a new version, `ckpt/save-000003/` (every rank its file, then
rank 0 the manifest), and only then points `ckpt/LATEST` at it, with an atomic rename; older
versions are deleted after that. A save killed half-way leaves `LATEST` on the previous
version, which still loads; a folder whose only save never finished is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field

import torch

from zerolab import comm
from zerolab.parts.materialize import param_names, where
from zerolab.sharding import local_values

FORMAT = 2
MANIFEST = "manifest.json"
LATEST = "LATEST"  # the name of the last complete version, replaced atomically


class CheckpointError(RuntimeError):
    """The folder is not a complete zerolab checkpoint."""


@dataclass
class Piece:
    """A contiguous part of a run of named parameters laid end to end."""

    names: list[str]  # the parameters, in flat order
    shapes: list[tuple[int, ...]]  # their shapes
    start: int  # first flat element held here
    tensors: dict[str, torch.Tensor]  # "param" and per-element optimizer state, all (length,)
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)  # e.g. Adam's "step"


def pieces(engine) -> list[Piece]:
    """What this rank writes: a piece per slot it holds (read from the engine's public layout).

    A sharded slot (ZeRO) is this rank's shard of a bucket; a whole one (DDP, and frozen
    parameters outside ZeRO-3) is the same on every rank, so rank 0 alone writes it.
    """
    names = param_names(engine.module)
    held = [*zip(engine.slots, engine.masters), *((s, s.tensor) for s in engine.frozen_slots())]
    out = []
    for slot, master in held:
        if slot.layout is None and engine.rank != 0:
            continue
        start = 0 if slot.layout is None else slot.layout.shard_range(engine.rank)[0]
        tensors, scalars = _optimizer_state(engine.tiles.state(engine.optimizer, master),
                                            master.numel())
        # The layout keeps the shapes: ZeRO-3's parameters are empty at rest.
        shapes = [tuple(p.shape) for p in slot.params] if slot.layout is None else [
            tuple(s) for s in slot.layout.shapes]
        param = master.detach().float().reshape(-1).clone()
        out.append(Piece([names[p] for p in slot.params], shapes, start,
                         {"param": param, **tensors}, scalars))
    return out


def _optimizer_state(state: dict, numel: int):
    """Split one master's optimizer state (tiles.py joins its tiles') into per-element tensors
    and scalars."""
    tensors, scalars = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.numel() == numel and value.dim() > 0:
            tensors[key] = value.detach().reshape(-1).clone()
        else:
            scalars[key] = value.clone() if torch.is_tensor(value) else value
    return tensors, scalars


def save(engine, folder: str) -> None:
    """Collective: every rank writes rank{r}.pt; rank 0 writes the manifest last.

    r is the rank in the whole job (engine.job_group): HSDP's replicas each write their file.
    """
    rank, world_size, _ = where(engine.job_group)
    tag = f"{engine.name}/checkpoint"
    engine.wait_params()  # parameters gathered asynchronously after step() are complete
    os.makedirs(folder, exist_ok=True)
    version = f"save-{1 + max(_versions(folder), default=0):06d}"  # after any crashed one
    comm.barrier(tag=tag, group=engine.job_group)  # every rank chose before any creates it
    target = os.path.join(folder, version)
    os.makedirs(target, exist_ok=True)
    payload = {
        "pieces": [asdict(p) for p in pieces(engine)],
        "buffers": {k: v.detach().clone() for k, v in engine.module.named_buffers()}
        if rank == 0 else {},
    }
    _write_atomically(os.path.join(target, f"rank{rank}.pt"), lambda f: torch.save(payload, f))
    comm.barrier(tag=tag, group=engine.job_group)  # every rank's file is complete
    if rank == 0:
        first_name = {p: n for n, p in engine.module.named_parameters()}
        aliases = {n: first_name[p]  # tied weights: every name the model's state_dict uses
                   for n, p in engine.module.named_parameters(remove_duplicate=False)
                   if first_name[p] != n}
        manifest = {"format": FORMAT, "engine": engine.name, "world_size": world_size,
                    "files": [f"rank{r}.pt" for r in range(world_size)],
                    "aliases": aliases}
        _write_atomically(os.path.join(target, MANIFEST),
                          lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        # The moment the new version counts: before this rename, LATEST names the old one.
        _write_atomically(os.path.join(folder, LATEST), lambda f: f.write(version.encode()))
        for old in _versions(folder):
            if f"save-{old:06d}" != version:
                shutil.rmtree(os.path.join(folder, f"save-{old:06d}"), ignore_errors=True)
    comm.barrier(tag=tag, group=engine.job_group)


def _versions(folder: str) -> list[int]:
    """The numbers of the save-NNNNNN folders in `folder` (complete or not)."""
    return [int(n[5:]) for n in os.listdir(folder) if n.startswith("save-") and n[5:].isdigit()]


def _write_atomically(path: str, write) -> None:
    """The file at `path` is either the old one or complete: written aside, then renamed."""
    with open(path + ".tmp", "wb") as f:
        write(f)
    os.replace(path + ".tmp", path)


def latest(folder: str) -> str:
    """The folder of the last complete save in `folder`."""
    pointer = os.path.join(folder, LATEST)
    if not os.path.exists(pointer):
        started = sorted(_versions(folder)) if os.path.isdir(folder) else []
        raise CheckpointError(
            f"{folder} holds no complete checkpoint: {LATEST} is missing" +
            (f", and the save that made save-{started[-1]:06d} did not finish." if started
             else "."))
    with open(pointer) as f:
        return os.path.join(folder, f.read().strip())


def consolidate(folder: str) -> dict:
    """Read a checkpoint folder into full tensors: {"model": state, "optimizer": {name: state}}.

    "model" holds every parameter (by its first name, tied weights once) and buffer;
    "optimizer" holds, per trainable parameter, its full optimizer state.
    """
    folder = latest(folder)
    with open(os.path.join(folder, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: unknown checkpoint format {manifest.get('format')}")
    pieces, buffers = [], {}
    for name in manifest["files"]:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{folder} is not a complete checkpoint: {name} is missing.")
        payload = torch.load(path, weights_only=False)
        pieces += [Piece(**p) for p in payload["pieces"]]
        buffers.update(payload["buffers"])
    full = _assemble(pieces, buffers)
    for alias, name in manifest.get("aliases", {}).items():
        full["model"][alias] = full["model"][name]  # so that load_state_dict(strict=True) works
    return full


def _assemble(pieces: list[Piece], buffers: dict) -> dict:
    runs: dict[tuple[str, ...], list[Piece]] = {}
    for piece in pieces:
        runs.setdefault(tuple(piece.names), []).append(piece)
    model, optimizer = dict(buffers), {}
    for names, parts in runs.items():
        shapes = [torch.Size(s) for s in parts[0].shapes]
        numel = sum(s.numel() for s in shapes)
        for key in parts[0].tensors:
            # (padded numel,) the whole run, filled from every rank's part; padding dropped below
            flat = torch.zeros(max(p.start + p.tensors[key].numel() for p in parts),
                               dtype=parts[0].tensors[key].dtype)
            for p in parts:
                flat[p.start:p.start + p.tensors[key].numel()] = p.tensors[key]
            offset = 0
            for name, shape in zip(names, shapes):
                value = flat[offset:offset + shape.numel()].view(shape).clone()
                offset += shape.numel()
                if key == "param":
                    model[name] = value
                else:
                    optimizer.setdefault(name, {})[key] = value
            assert offset == numel
        for name in names:
            if name in optimizer:
                optimizer[name].update(parts[0].scalars)
    return {"model": model, "optimizer": optimizer}


def load(engine, folder: str) -> None:
    """Collective in effect (every rank must call it): restore a checkpoint into `engine`."""
    load_full(engine, consolidate(folder))


def load_full(engine, full: dict) -> None:
    """Load a consolidated checkpoint (or a plain model state_dict as full["model"]).

    Every rank cuts its own part of the full tensors under its own layout, so the checkpoint
    may come from any stage at any world size.
    """
    params, optimizer_state = full["model"], full.get("optimizer", {})
    missing = [n for n, _ in engine.module.named_parameters() if n not in params]
    if missing:
        raise CheckpointError(f"the checkpoint has no values for parameters {missing[:5]}")
    names = param_names(engine.module)
    held = [*zip(engine.slots, engine.masters), *((s, s.tensor) for s in engine.frozen_slots())]
    engine.wait_params()  # a gather still in flight would overwrite what we load
    with torch.no_grad():
        for name, p in engine.module.named_parameters():
            if p.numel() > 0:  # held in full now (ZeRO-3's resharded parameters are empty)
                p.copy_(params[name])
        for slot, master in held:
            values = [params[names[p]] for p in slot.params]
            for target in {id(t): t for t in (slot.tensor, master)}.values():
                target.copy_(local_values(values, slot.layout, engine.rank).view_as(target))
        for name, buf in engine.module.named_buffers():
            if name in params:
                buf.copy_(params[name])
    for slot, master in zip(engine.slots, engine.masters):
        state = _slot_optimizer_state(optimizer_state, [names[p] for p in slot.params], slot,
                                      engine.rank)
        if state:
            engine.tiles.load_state(engine.optimizer, master, state)


def _slot_optimizer_state(optimizer_state: dict[str, dict], names: list[str], slot,
                          rank: int) -> dict:
    """This rank's part of the full per-parameter optimizer state of one slot."""
    first = optimizer_state.get(names[0], {})
    state = {}
    for key, value in first.items():
        if torch.is_tensor(value) and value.dim() > 0:  # per element: take our part
            values = [optimizer_state[n][key] for n in names]
            state[key] = local_values(values, slot.layout, rank).clone()
        else:  # per tensor, e.g. Adam's step count
            state[key] = value.clone() if torch.is_tensor(value) else value
    return state
