"""Notebook 09b, checkpoints in torch's format (torch.distributed.checkpoint, DCP): zerolab's read
by a plain single-process model and by FSDP2 (fully_shard), FSDP2's read by zerolab.

    trips = n09_dcp.round_trips(workdir)      # three launches (09b: inside its own, `compare`)
    n09_dcp.trip_table(trips)                 # each round trip: the largest difference
    n09_dcp.chunk_table(path, rank)           # what one rank's file holds: rectangles

Each trip compares the values that arrive with the values that left: the parameters, and Adam's
exp_avg, exp_avg_sq and step for every parameter. They are copies, so the differences are 0.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import checkpoint, engines, harness
from zerolab.harness import max_diff
from zerolab.models import GPT, GPTConfig

MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)  # notebooks 09 and 09b's
LR, GLOBAL_BATCH, STEPS = 1e-3, 12, 2


def _train(model, engine_or_optimizer, fsdp2: bool = False) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank,
                                   world_size)
        if fsdp2:
            model.loss(model(x), y).backward()
            engine_or_optimizer.step()
            engine_or_optimizer.zero_grad()
        else:
            harness.train_step(engine_or_optimizer, x, y)


def zerolab_saves(folder: str, key: str = "zero3", config: GPTConfig = MODEL) -> dict:
    """Run on every rank: `key` trains STEPS AdamW steps and saves into `folder`; returns what
    it holds (full tensors) and the DCP folder it wrote."""
    model = GPT(config)
    engine = engines.make_engine(key, model, torch.optim.AdamW, lr=LR)
    _train(model, engine)
    path = checkpoint.save(engine, folder)
    return {"full": engine.full_state_dict(), "path": path}


def fsdp2(config: GPTConfig = MODEL, seed: int = 5):
    """FSDP2 as torchtitan applies it: fully_shard on every block, then on the root."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerolab.bench.baselines import fully_shard_blocks

    model = GPT(GPTConfig(**{**config.__dict__, "seed": seed}))
    fully_shard_blocks(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def fsdp2_full(model, optimizer) -> dict:
    """FSDP2's state in full tensors, as torch's state-dict API gives it (a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    params, state = get_state_dict(model, optimizer,
                                   options=StateDictOptions(full_state_dict=True))
    return {"model": params, "optimizer": state["state"], "groups": state["param_groups"]}


def fsdp2_loads_and_saves(zerolab_folder: str, fsdp2_folder: str,
                          config: GPTConfig = MODEL) -> dict:
    """Run on every rank: FSDP2 loads zerolab's checkpoint the documented way (get_state_dict,
    dcp.load, set_state_dict); then a fresh FSDP2 trains STEPS steps and saves with dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optimizer = fsdp2(config)
    params, state = get_state_dict(model, optimizer)
    sd = {"model": params, "optimizer": state}
    dcp.load(sd, checkpoint_id=checkpoint.latest(zerolab_folder))
    set_state_dict(model, optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optimizer"])
    loaded = fsdp2_full(model, optimizer)
    model, optimizer = fsdp2(config)
    _train(model, optimizer, fsdp2=True)
    params, state = get_state_dict(model, optimizer)
    dcp.save({"model": params, "optimizer": state}, checkpoint_id=fsdp2_folder)
    return {"loaded": loaded, "saved": fsdp2_full(model, optimizer)}


def zerolab_loads(fsdp2_folder: str, folder: str, key: str = "zero2",
                  config: GPTConfig = MODEL) -> dict:
    """Run on every rank: `key` loads FSDP2's checkpoint, and saves it again into `folder`
    (so that its optimizer state can be read back in full)."""
    model = GPT(GPTConfig(**{**config.__dict__, "seed": 9}))
    engine = engines.make_engine(key, model, torch.optim.AdamW, lr=1.0)
    checkpoint.load(engine, fsdp2_folder)
    return {"full": engine.full_state_dict(), "lr": engine.optimizer.param_groups[0]["lr"],
            "path": checkpoint.save(engine, folder)}


@dataclass
class Trip:
    """One round trip: where from, where to, and how far what arrived is from what left."""

    what: str
    params: float  # the largest |difference| over the parameters
    optimizer: float | None  # over Adam's state (None: the trip carries none)


def optimizer_diff(a: dict, b: dict) -> float:
    """The largest difference over two {name: {"exp_avg": .., ...}} optimizer states."""
    if sorted(a) != sorted(b):
        raise ValueError(f"different parameters: {sorted(set(a) ^ set(b))}")
    return max(max_diff(a[name], b[name]) for name in a)


def round_trips(workdir: str) -> list[Trip]:
    """In the notebook's process: ZeRO-3 at 2 ranks saves; a plain model loads it through
    dcp_to_torch_save; FSDP2 at 2 ranks loads it, then saves its own; ZeRO-2 at 3 loads that.
    Three launches (notebook 09b runs the same functions inside its own launches: `compare`)."""
    import zerolab

    folder = os.path.join(workdir, "zero3")
    saved = zerolab.launch(zerolab_saves, 2, args=(folder,), timeout=600)[0]
    fsdp = zerolab.launch(fsdp2_loads_and_saves, 2, args=(
        folder, os.path.join(workdir, "fsdp2")), timeout=600)[0]
    back = zerolab.launch(zerolab_loads, 3, args=(
        os.path.join(workdir, "fsdp2"), os.path.join(workdir, "zero2")), timeout=600)[0]
    return compare(workdir, saved, fsdp, back)


def compare(workdir: str, saved: dict, fsdp: dict, back: dict) -> list[Trip]:
    """In this process, after the launches: rank 0's results of zerolab_saves (into
    workdir/zero3), fsdp2_loads_and_saves (workdir/fsdp2) and zerolab_loads (workdir/zero2);
    a plain model loads the first checkpoint through dcp_to_torch_save. The three trips."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    on_disk = checkpoint.consolidate(os.path.join(workdir, "zero3"))
    plain_file = os.path.join(workdir, "plain.pt")
    dcp_to_torch_save(saved["path"], plain_file)
    plain = GPT(GPTConfig(**{**MODEL.__dict__, "seed": 3}))
    full = torch.load(plain_file)
    plain.load_state_dict(full["model"])  # strict: every key, the tied head's too
    again = checkpoint.consolidate(os.path.join(workdir, "zero2"))
    return [
        Trip("zerolab ZeRO-3 (2 ranks) -> dcp_to_torch_save -> plain GPT",
             max_diff(plain.state_dict(), saved["full"]),
             optimizer_diff(full["optimizer"]["state"], on_disk["optimizer"]["state"])),
        Trip("zerolab ZeRO-3 (2 ranks) -> FSDP2 (2 ranks)",
             max_diff(fsdp["loaded"]["model"], saved["full"]),
             optimizer_diff(fsdp["loaded"]["optimizer"], on_disk["optimizer"]["state"])),
        Trip("FSDP2 (2 ranks) -> zerolab ZeRO-2 (3 ranks)",
             max_diff(back["full"], fsdp["saved"]["model"]),
             optimizer_diff(again["optimizer"]["state"], fsdp["saved"]["optimizer"])),
    ]


def trip_table(trips: list[Trip]) -> list[str]:
    return [f"{'round trip':58}{'params':>8}{'Adam':>8}",
            *(f"{t.what:58}{t.params:8.1g}{'-' if t.optimizer is None else f'{t.optimizer:.1g}':>8}"
              for t in trips)]


def chunk_table(path: str, rank: int, prefix: str = "model.", limit: int = 12) -> list[str]:
    """The rectangles rank `rank`'s file holds, of the tensors whose key starts with `prefix`:
    key, offsets, sizes, elements (zerolab.parts.state_dicts.boxes cut them)."""
    metadata = checkpoint.manifest(path)
    rows = []
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: kv[1].offset):
        if info.relative_path != f"__{rank}_0.distcp" or not index.fqn.startswith(prefix):
            continue
        sizes = next(c.sizes for c in metadata.state_dict_metadata[index.fqn].chunks
                     if c.offsets == index.offset)
        rows.append(f"{index.fqn:36} at {str(tuple(index.offset)):12} "
                    f"{str(tuple(sizes)):12} {math.prod(sizes):>7,} elements")
    return rows[:limit] + ([f"... {len(rows) - limit} more"] if len(rows) > limit else [])
