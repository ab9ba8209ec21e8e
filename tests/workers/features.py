"""Workers for the training-feature tests, every stage: accumulation (test_engines.py), clipping
(test_clipping.py), mixed precision (test_mixed_precision.py), checkpoints (test_checkpoint.py)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import zerolab
from workers import engines as W
from zerolab import checkpoint, harness

STAGES = ["ddp", "zero1", "zero2", "zero3"]  # the engines those tests train
KIND = "gpt"  # tied weights; the MLP (frozen, tiny, reused) is covered by test_engines
MICRO = 4  # micro-batches per step
ACC_STEPS = 3
MAX_NORM = 0.05  # small enough that every step clips
# Checkpoints are written and read with the optimizer stepping tiles of 7 elements (tiles.py),
# so that the state saved is joined from tiles and loaded into tiles again (a master is cut
# otherwise only past 2^18 elements, which the tests' models have none of).
CHECKPOINT_TILE = 7


def _rank():
    return dist.get_rank(), dist.get_world_size()


def _engine(engine_key: str, kind: str, seed: int = 0, **kwargs):
    model = W.build_model(kind, seed=seed)
    engine = W.ENGINES_TESTED[engine_key](model, torch.optim.AdamW, lr=W.LR, weight_decay=0.1,
                                    **W.engine_kwargs(engine_key), **kwargs)
    return model, engine


def _micro_batches(model, step: int, rank: int, world_size: int):
    """MICRO micro-batches of GLOBAL_BATCH each: together a global batch MICRO times larger."""
    x, y = model.make_batch(MICRO * W.GLOBAL_BATCH, seed=200 + step)
    for m in range(MICRO):
        rows = slice(m * W.GLOBAL_BATCH, (m + 1) * W.GLOBAL_BATCH)  # micro-batch m
        yield harness.local_rows((x[rows], y[rows]), rank, world_size)


# ---- gradient accumulation ---------------------------------------------------------------------

def reference_big_batch(kind: str) -> dict:
    """One process, one step per MICRO * GLOBAL_BATCH samples."""
    model = W.build_model(kind)
    opt = W.make_optimizer([p for p in model.parameters() if p.requires_grad])
    for step in range(ACC_STEPS):
        x, y = model.make_batch(MICRO * W.GLOBAL_BATCH, seed=200 + step)
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def accumulate(engine_keys: list[str], kind: str) -> dict:
    rank, world_size = _rank()
    out = {}
    model = W.build_model(kind)  # torch's own DDP.no_sync: the yardstick
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = W.make_optimizer([p for p in model.parameters() if p.requires_grad])
    for step in range(ACC_STEPS):
        for m, (x, y) in enumerate(_micro_batches(model, step, rank, world_size)):
            if m < MICRO - 1:
                with ddp.no_sync():
                    (model.loss(ddp(x), y) / MICRO).backward()
            else:
                (model.loss(ddp(x), y) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    out["torch_ddp"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for engine_key in engine_keys:  # zerolab's: the harness's step, as the notebooks run it
        model, engine = _engine(engine_key, kind, seed=rank)
        reductions_inside_no_sync = 0
        for step in range(ACC_STEPS):
            x, y = (torch.cat(part) for part in zip(*_micro_batches(model, step, rank,
                                                                     world_size)))
            with zerolab.record_comm(align=False) as log:
                harness.train_step(engine, x, y, micro_batches=MICRO)
            # Every reduction must come in the last micro-batch's backward.
            last_backward = [s for s in log.spans if s.name == "backward"][-1]
            reductions_inside_no_sync += sum(
                e.op in ("all_reduce", "reduce_scatter") and e.start < last_backward.start
                for e in log.events)
        out[engine_key] = {"state": engine.full_state_dict(),
                         "reductions_inside_no_sync": reductions_inside_no_sync}
    return out


# ---- clipping ----------------------------------------------------------------------------------

def reference_clipped(kind: str) -> dict:
    model = W.build_model(kind)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = W.make_optimizer(params)
    norms = []
    for x, y in W.batches(model, 0, 1):
        model.loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, MAX_NORM).item())
        opt.step()
        opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "norms": norms}


def clipped(engine_keys: list[str], kind: str) -> dict:
    rank, world_size = _rank()
    out = {}
    for engine_key in engine_keys:
        model, engine = _engine(engine_key, kind, seed=rank)
        norms = []
        for x, y in W.batches(model, rank, world_size):
            model.loss(engine(x), y).backward()
            norms.append(engine.clip_grad_norm_(MAX_NORM))
            engine.step()
            engine.zero_grad()
        out[engine_key] = {"state": engine.full_state_dict(), "norms": norms}
    return out


# ---- mixed precision ---------------------------------------------------------------------------

def mixed(engine_keys: list[str], kind: str) -> dict:
    rank, world_size = _rank()
    out = {}
    for engine_key in engine_keys:
        model, engine = _engine(engine_key, kind, seed=rank, param_dtype=torch.bfloat16)
        losses = []
        with zerolab.record_comm() as log:
            for x, y in W.batches(model, rank, world_size):
                loss = model.loss(engine(x), y)
                loss.backward()
                losses.append(loss.item())
                engine.step()
                state_bytes = engine.model_state_bytes()
                engine.zero_grad()
        wire = {e.dtype for e in log.events if e.op in ("all_reduce", "reduce_scatter")}
        out[engine_key] = {"state": engine.full_state_dict(), "bytes": state_bytes,
                         "losses": losses, "log": log, "wire": wire,
                         "layouts": [(b.layout.numel, b.layout.padded_numel)
                                     for b in engine.buckets]}
    return out


def fp32_losses(kind: str) -> list[float]:
    model = W.build_model(kind)
    opt = W.make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x, y in W.batches(model, 0, 1):
        loss = model.loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


# ---- checkpoints -------------------------------------------------------------------------------

def train_steps(engine, model, steps: range) -> None:
    rank, world_size = _rank()
    for step in steps:
        x, y = harness.local_batch(model.make_batch, W.GLOBAL_BATCH, 100 + step, rank,
                                   world_size)
        harness.train_step(engine, x, y)


def save_after(engine_key: str, kind: str, folder: str, steps: int) -> dict:
    """Train `steps` steps, save into `folder`; returns what the engine held when it saved."""
    model, engine = _engine(engine_key, kind, seed=dist.get_rank(),
                            optimizer_tile_numel=CHECKPOINT_TILE)
    train_steps(engine, model, range(steps))
    checkpoint.save(engine, folder)
    return engine.full_state_dict()


def resume(engine_key: str, kind: str, folder: str, first: int, last: int) -> dict:
    model, engine = _engine(engine_key, kind, seed=dist.get_rank() + 7,  # weights get overwritten
                            optimizer_tile_numel=CHECKPOINT_TILE)
    checkpoint.load(engine, folder)
    train_steps(engine, model, range(first, last))
    return engine.full_state_dict()


def uninterrupted(engine_key: str, kind: str, steps: int) -> dict:
    model, engine = _engine(engine_key, kind, seed=dist.get_rank(),
                            optimizer_tile_numel=CHECKPOINT_TILE)
    train_steps(engine, model, range(steps))
    return engine.full_state_dict()


def save_killed_half_way(engine_key: str, kind: str, folder: str) -> None:
    """Rank 0 dies as DCP writes the manifest, once every rank's file is written: a crash
    mid-save (rank 1 then waits for a rank that is gone, and the launch ends both)."""
    import torch.distributed.checkpoint as dcp

    model, engine = _engine(engine_key, kind, seed=dist.get_rank())
    train_steps(engine, model, range(1))
    if dist.get_rank() == 0:
        def crash(writer, metadata, results):
            os._exit(1)

        dcp.FileSystemWriter.finish = crash
    checkpoint.save(engine, folder)


def save_train_resume(engine_keys: list[str], kind: str, root: str) -> dict:
    """At this world size, per engine: save after 2 steps, run 5 straight, resume 2->5."""
    out = {}
    for engine_key in engine_keys:
        folder = os.path.join(root, engine_key)
        out[engine_key] = {"saved": save_after(engine_key, kind, folder, 2),
                           "straight": uninterrupted(engine_key, kind, 5),
                         "resumed": resume(engine_key, kind, folder, 2, 5)}
    return out


def resume_all(engine_keys: list[str], kind: str, root: str, loader: str | None = None) -> dict:
    """Resume each engine's checkpoint (optionally into another stage) at this world size."""
    return {s: resume(loader or s, kind, os.path.join(root, s), 2, 5) for s in engine_keys}


# ---- optimizer tiles -----------------------------------------------------------------------------

def tiled_against_whole(engine_keys: list[str], kind: str = "gpt") -> dict:
    """Each engine trained 3 steps with tiles of 5 elements and with whole masters, in fp32
    and with bf16 parameters (the optimizer then steps fp32 master copies, whose gradients
    mixed_precision.py sets just before the step)."""
    runs = {}
    for engine_key in engine_keys:
        for param_dtype in (None, torch.bfloat16):
            states, counts = [], []
            for tile_numel in (5, None):
                model, engine = _engine(engine_key, kind, optimizer_tile_numel=tile_numel,
                                        param_dtype=param_dtype)
                train_steps(engine, model, range(3))
                states.append(engine.full_state_dict())
                counts.append(len(engine.optimizer.param_groups[0]["params"]))
            runs[engine_key, str(param_dtype)] = (*states, *counts)
    # A weight of 360,000 elements, more than a tile on a CPU: cut by default.
    big = zerolab.DDP(torch.nn.Linear(600, 600), torch.optim.AdamW, lr=W.LR)
    return {"runs": runs, "default_tile_numel": _tile_numel(big.tiles)}


def _tile_numel(tiles) -> int | None:
    """The largest tile of a cut master (the tile size, where a master is cut)."""
    cut = [b - a for m, ts in zip(tiles.masters, tiles.tiles) for t, a, b in ts if t is not m]
    return max(cut, default=None)
