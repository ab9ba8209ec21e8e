"""Checkpoints in torch's format (torch.distributed.checkpoint, DCP) that survive a crash and
load at any world size, into any engine, and into FSDP2 or a plain model.

    path = zerolab.checkpoint.save(engine, "ckpt/")   # collective; returns the DCP folder
    zerolab.checkpoint.load(engine, "ckpt/")          # collective: any engine, any world size
    full = zerolab.checkpoint.consolidate("ckpt/")    # one process: full tensors, torch's keys

What is written: DCP's format, keyed as torch keys it (parts/state_dicts.py): "model" holds the
plain model's state_dict keys, "optimizer" what FSDP2's get_optimizer_state_dict gives
({"state": {name: {"exp_avg", "exp_avg_sq", "step"}}, "param_groups": [...]}). Each rank writes
what it holds as rectangular chunks of the full tensors. So:

    torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path, "model.pt")
    model.load_state_dict(torch.load("model.pt")["model"])       # one process, exactly

and FSDP2 loads it with dcp.load({"model": get_model_state_dict(m), "optimizer":
get_optimizer_state_dict(m, opt)}, checkpoint_id=path) then set_state_dict; `load` reads a
folder FSDP2 wrote the same way.

Crash safety: each save writes a new version, `ckpt/save-000003/` (DCP writes every rank's file,
then `.metadata`, the manifest, last), and only then points `ckpt/LATEST` at it by an atomic
rename; older versions are deleted after that. A save killed half-way leaves `LATEST` on the
previous version, which still loads.

One writer per folder: the first save of a job into a folder takes `ckpt/LOCK` (an flock, which
the kernel drops when the process ends, however it ends) and writes who holds it; another job's
save is refused with that job's pid, host and start time.

A damaged checkpoint is refused by name, with what to do: LATEST not naming a version folder of
its own folder (`../x`, `/abs`, garbage, not UTF-8), a manifest missing or unreadable, a rank's
file missing, empty or shorter than the manifest says, a tensor whose chunks do not cover it
(a rank's part missing from the manifest: never zeros). Every rank checks the same files, and
the ranks agree (one all-reduce) before any of them reads.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from zerolab import comm
from zerolab.parts import dcp_files, state_dicts
from zerolab.parts.materialize import where
from zerolab.shell import EngineShell  # zerolab's engines; torch's keep engines.Engine

if TYPE_CHECKING:
    from zerolab.engines import Engine

LATEST = "LATEST"  # the name of the last complete version, replaced atomically
LOCK = "LOCK"  # held (flock) by the job that saves into this folder; says who that is
MANIFEST = ".metadata"  # DCP's manifest, written last by the coordinator
VERSION = re.compile(r"save-\d{6}")
_held_locks: dict[str, int] = {}  # this process's locks: real folder path -> open descriptor


class CheckpointError(RuntimeError):
    """The folder is not a complete, undamaged checkpoint (the message says which file)."""


# ---- save ----------------------------------------------------------------------------------


def save(engine: Engine, folder: str) -> str:
    """Collective: write a new version of `engine`'s state into `folder`; returns its DCP folder.

    Every rank of engine.job_group writes its own chunks (HSDP's replicas write theirs once).
    """
    rank, _, _ = where(engine.job_group)
    tag = f"{getattr(engine, 'name', 'engine')}/checkpoint"
    group = engine.job_group
    engine.wait_params()  # parameters gathered asynchronously after step() are complete
    os.makedirs(folder, exist_ok=True)
    _agree(lock(folder) if rank == 0 else None, group, tag, lambda: _locked(folder))
    version = f"save-{1 + max(_versions(folder), default=0):06d}"  # after any crashed one
    _barrier(tag, group)  # every rank chose before any creates it
    target = os.path.join(folder, version)
    if isinstance(engine, EngineShell):  # a zerolab engine: its chunks
        dcp_files.write(state_dicts.engine_state_dict(engine), target, group)
    else:  # torch's (zerolab.bench.baselines): its own state dicts, the same keys
        dcp.save(_torch_state_dict(engine), storage_writer=dcp.FileSystemWriter(target),
                 process_group=group)
    if rank == 0:
        # The moment the new version counts: before this rename, LATEST names the old one.
        _write_atomically(os.path.join(folder, LATEST), version.encode())
        for old in _versions(folder):
            if f"save-{old:06d}" != version:
                shutil.rmtree(os.path.join(folder, f"save-{old:06d}"), ignore_errors=True)
    _barrier(tag, group)
    return target


def _barrier(tag: str, group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():  # else one process: nobody to wait for
        comm.barrier(tag=tag, group=group)


def _torch_state_dict(engine: Engine) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(engine.module, engine.optimizer)
    return {state_dicts.MODEL: model, state_dicts.OPTIMIZER: optimizer}


def _versions(folder: str) -> list[int]:
    """The numbers of the save-NNNNNN folders in `folder` (complete or not)."""
    return [int(n[5:]) for n in os.listdir(folder) if VERSION.fullmatch(n)]


def _write_atomically(path: str, data: bytes) -> None:
    """The file at `path` is either the old one or complete: written aside, synced, renamed."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


# ---- one writer per folder -----------------------------------------------------------------


def lock(folder: str) -> str | None:
    """Take `folder`'s LOCK for this process (kept until it ends, or `unlock`). Returns None,
    or why not: the other job's pid, host and start time."""
    key = os.path.realpath(folder)
    if key in _held_locks:
        return None
    path = os.path.join(folder, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return _locked(folder)
    owner = {"pid": os.getpid(), "host": socket.gethostname(),
             "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    _held_locks[key] = fd
    return None


def unlock(folder: str) -> None:
    """Let another job save into `folder` while this process lives on (a notebook's kernel)."""
    fd = _held_locks.pop(os.path.realpath(folder), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor drops the flock


def _locked(folder: str) -> str:
    return (f"{folder} is being saved into by another job: {_owner_text(folder)}. Two jobs "
            f"saving into one folder would delete each other's versions. Save into another "
            f"folder, or wait for that job to end (its lock ends with its process).")


def _owner_text(folder: str) -> str:
    try:
        with open(os.path.join(folder, LOCK), "rb") as f:
            owner = json.loads(f.read().decode())
        return f"pid {owner['pid']} on host {owner['host']}, saving here since {owner['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a job that has not written its name yet"


# ---- finding and checking a version --------------------------------------------------------


def latest(folder: str) -> str:
    """The DCP folder to load from `folder`: the version its LATEST names, or `folder` itself
    when it is a DCP checkpoint (written by FSDP2's dcp.save, say)."""
    pointer = os.path.join(folder, LATEST)
    if not os.path.exists(pointer):
        if os.path.exists(os.path.join(folder, MANIFEST)):
            return folder
        started = sorted(_versions(folder)) if os.path.isdir(folder) else []
        complete = _complete(folder) if started else []
        raise CheckpointError(
            f"{folder} holds no complete checkpoint: {LATEST} is missing" +
            (f" (it names the last complete version), yet {complete[0]} has a manifest: if it "
             f"is whole, write its name into {pointer}." if complete else
             f", and the save that made save-{started[-1]:06d} did not finish." if started
             else "."))
    with open(pointer, "rb") as f:
        raw = f.read()
    fix = (f"Write into {pointer} the name of the newest version folder that holds a {MANIFEST} "
           f"({', '.join(_complete(folder)) or 'none here'}), or save again.")
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{pointer} is damaged: not UTF-8 text ({raw[:16]!r}...). "
                              f"{fix}") from None
    if not VERSION.fullmatch(name):
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a version folder of {folder} "
                              f"(save-NNNNNN): LATEST never leaves its own folder. {fix}")
    if not os.path.isdir(os.path.join(folder, name)):
        raise CheckpointError(f"{pointer} names {name}, which is not in {folder}. {fix}")
    return os.path.join(folder, name)


def _complete(folder: str) -> list[str]:
    return [f"save-{v:06d}" for v in sorted(_versions(folder), reverse=True)
            if os.path.exists(os.path.join(folder, f"save-{v:06d}", MANIFEST))]


def manifest(version: str) -> Metadata:
    """The DCP manifest of the checkpoint folder `version`, every file it names checked:
    present, and as long as the manifest says; every tensor covered by its chunks."""
    path = os.path.join(version, MANIFEST)
    again = "Load an earlier version (a save-NNNNNN folder with a whole manifest) or save again."
    if not os.path.exists(path):
        raise CheckpointError(f"{version} is not a complete checkpoint: {path} is missing (DCP "
                              f"writes it last, once every rank's file is complete): the save "
                              f"did not finish. {again}")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{path} is empty: the checkpoint's manifest is damaged. {again}")
    try:
        metadata = dcp_files.read_metadata(version)
    except Exception as e:  # a pickle cut short or overwritten: many exception types
        raise CheckpointError(f"{path} is damaged: not a DCP manifest ({type(e).__name__}: "
                              f"{str(e)[:120]}). {again}") from None
    if not isinstance(metadata, Metadata) or metadata.storage_data is None:
        raise CheckpointError(f"{path} is damaged: not a DCP manifest. {again}")
    needed: dict[str, int] = {}  # file -> the bytes the manifest reads from it
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(version, name)
        if not os.path.exists(file):
            raise CheckpointError(f"{file} is missing: the manifest reads {size:,} bytes of "
                                  f"this checkpoint from it (one rank's part). {again}")
        have = os.path.getsize(file)
        if have < size:
            raise CheckpointError(f"{file} is {'empty' if have == 0 else 'truncated'}: "
                                  f"{have:,} bytes, the manifest reads {size:,} from it. {again}")
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            _check_covered(path, key, md, metadata, again)
    return metadata


def _check_covered(path: str, key: str, md: TensorStorageMetadata, metadata: Metadata,
                   again: str) -> None:
    """Every element of tensor `key` in exactly one chunk, and every chunk's data named."""
    numel, covered = math.prod(md.size), 0
    for i, c in enumerate(md.chunks):
        if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, md.size)):
            raise CheckpointError(f"{path}: a chunk of {key} lies outside its shape "
                                  f"{tuple(md.size)}. {again}")
        for d in md.chunks[:i]:
            if all(a < b + t and b < a + s
                   for a, s, b, t in zip(c.offsets, c.sizes, d.offsets, d.sizes)) and numel:
                raise CheckpointError(f"{path}: two chunks of {key} overlap. {again}")
        covered += math.prod(c.sizes)
        if MetadataIndex(key, c.offsets) not in metadata.storage_data:
            raise CheckpointError(f"{path}: a chunk of {key} at {tuple(c.offsets)} has no data "
                                  f"in any file. {again}")
    if covered != numel:
        raise CheckpointError(f"{path}: {key} is not whole: its chunks cover {covered:,} of its "
                              f"{numel:,} elements (a rank's part is missing from the manifest). "
                              f"{again}")


def _agree(problem: str | None, group: dist.ProcessGroup | None, tag: str,
           otherwise: Callable[[], str]) -> None:
    """Raise CheckpointError on every rank if any rank has a problem (so that none of them
    goes on into a collective the others never join)."""
    if dist.is_initialized():
        flag = torch.tensor([0 if problem is None else 1])
        comm.all_reduce(flag, tag=f"{tag}/agree", group=group)
        if flag.item() and problem is None:
            problem = otherwise()
    if problem is not None:
        raise CheckpointError(problem)


def _checked(folder: str, group: dist.ProcessGroup | None, tag: str) -> tuple[str, Metadata]:
    """The version to load from `folder` and its manifest; every rank raises if any rank
    found it damaged."""
    try:
        version = latest(folder)
        metadata, problem = manifest(version), None
    except CheckpointError as e:
        version, metadata, problem = "", None, str(e)
    _agree(problem, group, tag, lambda: f"another rank found {folder} damaged (see its error)")
    return version, metadata


# ---- load ----------------------------------------------------------------------------------


def load(engine: Engine, folder: str, strict: bool = True) -> None:
    """Collective: restore `engine` from `folder` (a zerolab checkpoint folder, or any DCP
    folder keyed the same way: FSDP2's). strict: every key of the checkpoint's model must be
    one of the model's, as torch's load_state_dict(strict=True)."""
    group = engine.job_group
    tag = f"{getattr(engine, 'name', 'engine')}/checkpoint"
    version, metadata = _checked(folder, group, tag)
    if not isinstance(engine, EngineShell):  # torch's (bench/baselines.py)
        return _load_torch(engine, version, metadata)
    where_of = dcp_files.paths(metadata)
    model, optimizer_keys, group_keys, root = _layout(where_of, metadata)
    problem = _compare(engine, model, strict, version)
    _agree(problem, group, tag, lambda: "another rank refused the checkpoint (see its error)")
    loading = state_dicts.targets(engine, optimizer_keys, group_keys)
    if root != state_dicts.OPTIMIZER:  # "optim", as in torch's DCP tutorial
        loading.sd[root] = loading.sd.pop(state_dicts.OPTIMIZER)
    _prune(loading.sd)
    engine.wait_params()  # a gather still in flight would overwrite what we load
    try:
        dcp_files.read(loading.sd, version, group)
    except Exception as e:  # DCP gathers every rank's failure into one CheckpointException
        raise CheckpointError(f"reading {version} failed ({type(e).__name__}): "
                              f"{str(e)[:400]}") from e
    if root in loading.sd:
        loading.sd[state_dicts.OPTIMIZER] = loading.sd.pop(root)
    state_dicts.finish_load(engine, loading)


def _layout(where_of: dict[str, tuple], metadata: Metadata):
    """What a checkpoint holds: {model key: metadata}, {param name: {state key: tensor
    metadata or None}}, the option names of each param group, and the optimizer's root key."""
    model, optimizer_keys, groups = {}, {}, {}
    root = state_dicts.OPTIMIZER
    for key, path in where_of.items():
        md = metadata.state_dict_metadata[key]
        tensor_md = md if isinstance(md, TensorStorageMetadata) else None
        if len(path) == 2 and path[0] == state_dicts.MODEL:
            model[path[1]] = tensor_md
        elif len(path) == 4 and path[0] in ("optimizer", "optim") and path[1] == "state":
            root = path[0]
            optimizer_keys.setdefault(path[2], {})[path[3]] = (
                None if tensor_md is None else (tensor_md.size, tensor_md.properties.dtype))
        elif len(path) == 4 and path[0] in ("optimizer", "optim") and path[1] == "param_groups":
            root = path[0]
            groups.setdefault(int(path[2]), []).append(path[3])
    return model, optimizer_keys, [groups[i] for i in sorted(groups)], root


def _compare(engine: EngineShell, model: dict[str, TensorStorageMetadata | None], strict: bool,
             version: str) -> str | None:
    """Why the checkpoint's model does not fit `engine`'s, or None."""
    params, buffers = state_dicts.state_dict_keys(engine.module)
    missing = [k for k in params if k not in model and
               not any(q is params[k] and q_k in model for q_k, q in params.items())]
    missing += [k for k in buffers if k not in model]
    if missing:
        return (f"{version} has no values for {len(missing)} of the model's keys: "
                f"{missing[:5]}. Is it a checkpoint of this model?")
    unexpected = [k for k in model if k not in params and k not in buffers]
    if strict and unexpected:
        return (f"{version} holds keys this model does not have: {unexpected[:5]} (load with "
                f"strict=False to ignore them).")
    shapes = {**{k: p for k, p in params.items()}, **buffers}
    for key, md in model.items():
        if key in shapes and md is not None and tuple(md.size) != _full_shape(engine, shapes[key]):
            return (f"{version}: {key} has shape {tuple(md.size)}, the model's is "
                    f"{_full_shape(engine, shapes[key])}.")
    return None


def _full_shape(engine: EngineShell, t: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape (ZeRO-3's are empty at rest: their layout knows it)."""
    for slot, _ in state_dicts.held(engine):
        for i, p in enumerate(slot.params):
            if p is t and slot.layout is not None:
                return tuple(slot.layout.shapes[i])
    return tuple(t.shape)


def _prune(sd: dict) -> None:
    """Drop empty dicts and lists: DCP would look for them in the checkpoint."""
    for k in list(sd):
        if isinstance(sd[k], dict):
            _prune(sd[k])
        if isinstance(sd[k], (dict, list)) and not sd[k]:
            del sd[k]


def _load_torch(engine: Engine, version: str, metadata: Metadata) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    model, optimizer = get_state_dict(engine.module, engine.optimizer)
    has_optimizer = any(str(k).startswith("optimizer.") for k in metadata.state_dict_metadata)
    sd = {"model": model, **({"optimizer": optimizer} if has_optimizer else {})}
    dcp.load(sd, checkpoint_id=version, process_group=engine.job_group)
    set_state_dict(engine.module, engine.optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd.get("optimizer", optimizer),
                   options=StateDictOptions(strict=True))


# ---- one process: full tensors -------------------------------------------------------------


def consolidate(folder: str) -> dict[str, Any]:
    """Read a checkpoint (the version LATEST names) into full tensors, in this process only:
    {"model": the plain model's state_dict, "optimizer": {"state": .., "param_groups": ..}},
    what `format_utils.dcp_to_torch_save` writes to a file."""
    version = latest(folder)
    metadata = manifest(version)
    full: dict[str, Any] = {}
    for key, path in dcp_files.paths(metadata).items():
        md = metadata.state_dict_metadata[key]
        _set(full, path, torch.empty(md.size, dtype=md.properties.dtype)
             if isinstance(md, TensorStorageMetadata) else None)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(full, checkpoint_id=version, no_dist=True)
    return full


def _set(sd: Any, path: tuple, value: Any) -> None:
    """sd[path[0]][path[1]]... = value, making dicts (and lists, for integer keys) on the way."""
    for key, nxt in zip(path[:-1], path[1:]):
        empty: Any = [] if isinstance(nxt, int) else {}
        if isinstance(sd, list):
            sd.extend([None] * (key + 1 - len(sd)))
            if sd[key] is None:
                sd[key] = empty
        elif key not in sd:
            sd[key] = empty
        sd = sd[key]
    if isinstance(sd, list):
        sd.extend([None] * (path[-1] + 1 - len(sd)))
    sd[path[-1]] = value


def load_full(engine: EngineShell, full: dict[str, Any]) -> None:
    """Load full tensors (consolidate's, torch.load of dcp_to_torch_save's file, or
    {"model": a plain model's state_dict}) into `engine`: each rank takes its own part."""
    problem = _compare(engine, {k: None for k in full["model"]}, False, "the state dict")
    if problem:
        raise CheckpointError(problem)
    state_dicts.load_engine_state_dict(engine, full)
