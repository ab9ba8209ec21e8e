"""Worker functions for the engine tests (spawned ranks import them from here).

Each worker does as much as it can in one launch, because starting ranks costs seconds.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import zerolab
from zerolab import checkpoint, engines, harness, models

# The engines under test, by the harness's names (engines.engine_class(name) builds each).
ENGINES_TESTED = {name: engines.engine_class(name) for name in
              ("ddp", "zero1", "zero1_after_backward", "zero1_all_reduce", "zero2",
               "zero2_after_backward", "zero3")}
STEPS = 5
GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4
LR = 1e-2
YARDSTICK_MULTIPLE = 5  # allowed distance from the reference, in units of torch DDP's
SMALL_BUCKETS = 2000  # bytes: several buckets even for the tiny models


def build_model(kind: str, seed: int = 0) -> torch.nn.Module:
    if kind == "gpt":
        return models.GPT(models.GPTConfig(seed=seed))
    if kind == "gpt4":  # four blocks: several buckets for ZeRO-2
        return models.GPT(models.GPTConfig(n_layer=4, seed=seed))
    if kind == "gpt8":  # eight blocks: at 2 ranks, shards + 2 units in flight < the full model
        return models.GPT(models.GPTConfig(n_layer=8, seed=seed))
    if kind == "mlp":  # frozen bias, a numel-1 parameter, a buffer
        return models.MLP(models.MLPConfig(seed=seed))
    if kind == "mlp_reuse":  # the middle layer runs twice in one forward
        return models.MLP(models.MLPConfig(dims=(16, 24, 24, 24, 8), reuse_hidden=True,
                                           seed=seed))
    raise ValueError(kind)


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def batches(model, rank: int, world_size: int):
    for step in range(STEPS):
        yield harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)


def reference_run(kind: str) -> dict[str, torch.Tensor]:
    """One process, the whole global batch: what every engine must reproduce."""
    model = build_model(kind)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    for x, y in batches(model, 0, 1):
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def engine_kwargs(engine_key: str) -> dict:
    return {} if engine_key == "zero3" else {"bucket_bytes": SMALL_BUCKETS}


def train_zerolab(engine_key: str, kind: str) -> dict:
    """Ranks start from different seeds: the engine must broadcast rank 0's state."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(kind, seed=rank)
    engine = ENGINES_TESTED[engine_key](model, torch.optim.AdamW, lr=LR, weight_decay=0.1,
                                  **engine_kwargs(engine_key))
    with zerolab.record_comm() as log:
        for x, y in batches(model, rank, world_size):
            model.loss(engine(x), y).backward()
            engine.step()
            state_bytes = engine.model_state_bytes()  # after step, before zero_grad
            engine.zero_grad()
    layouts = [(b.layout.numel, b.layout.padded_numel) for b in engine.buckets]
    out = {"state": engine.full_state_dict(), "bytes": state_bytes, "log": log,
           "layouts": layouts}
    if engine_key == "zero3":
        out["unit_layouts"] = [[(b.layout.padded_numel, b.params[0].requires_grad)
                                for b in u.buckets] for u in engine.units]
    return out


def train_torch_ddp(kind: str) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(kind)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    for x, y in batches(model, rank, world_size):
        model.loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_torch_fsdp2(kind: str) -> dict[str, torch.Tensor]:
    """torch's own fully_shard, one unit per block plus the root, like zerolab's default."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerolab.bench.baselines import fully_shard_blocks

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = fully_shard_blocks(build_model(kind), init_device_mesh("cpu", (world_size,)))
    opt = make_optimizer(model.parameters())
    for x, y in batches(model, rank, world_size):
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def equivalence(kinds: list[str], engine_keys: list[str], fsdp2: bool) -> dict:
    """Everything the equivalence tests compare, at this world size, in one launch."""
    out: dict = {}
    for kind in kinds:
        out[kind] = {"torch_ddp": train_torch_ddp(kind)}
        for engine_key in engine_keys:
            out[kind][engine_key] = train_zerolab(engine_key, kind)
        if fsdp2 and hasattr(build_model(kind), "blocks"):
            out[kind]["torch_fsdp2"] = train_torch_fsdp2(kind)
    return out


def peak_memory(kind: str, engine_key: str, kwargs: dict) -> dict:
    """Live bytes by category over one training step (the second: optimizer state exists)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(kind)
    full_param_bytes = sum(p.numel() * 4 for p in model.parameters())
    trainable_bytes = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    engine = ENGINES_TESTED[engine_key](model, torch.optim.AdamW, lr=LR, **kwargs)
    steps = batches(model, rank, world_size)
    harness.train_step(engine, *next(steps))  # the first step creates Adam's state
    measured = harness.measured_step(engine, *next(steps))  # the second is measured
    trace, log = measured.memory, measured.log
    out = {"max": trace.max_by_category, "peak": trace.peak_bytes, "log": log,
           "full_param_bytes": full_param_bytes, "trainable_bytes": trainable_bytes,
           "bucket_bytes": [4 * b.layout.padded_numel for b in engine.buckets],
           "grad_shard_bytes": sum(4 * b.layout.shard_numel for b in engine.buckets)}
    if engine_key == "zero3":
        units = [sum(b.layout.padded_numel * 4 for b in u.buckets) for u in engine.units]
        out["unit_bytes"] = units[:-1]
        out["root_bytes"] = units[-1]
        out["shard_bytes"] = sum(b.local_shard.numel() * 4
                                 for u in engine.units for b in u.buckets)
    return out


def step_without_backward(engine_key: str) -> None:
    model = build_model("mlp")
    engine = ENGINES_TESTED[engine_key](model, torch.optim.AdamW, lr=LR)
    engine.step()


def peaks() -> dict:
    """The memory lessons in one launch: ZeRO-2 hooked vs naive, ZeRO-3 with/without prefetch."""
    return {
        "zero2": peak_memory("gpt4", "zero2", {"bucket_bytes": 20_000}),
        "zero2_after_backward": peak_memory("gpt4", "zero2_after_backward",
                                            {"bucket_bytes": 20_000}),
        "zero3": peak_memory("gpt8", "zero3", {"prefetch": True}),
        "zero3_no_prefetch": peak_memory("gpt8", "zero3", {"prefetch": False}),
    }


def _trained(engine_key: str, prefetch: bool, log=None):
    """GPT with four blocks, small buckets, STEPS steps; returns the engine right after step()."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model("gpt4")
    engine = ENGINES_TESTED[engine_key](model, torch.optim.AdamW, lr=LR, prefetch=prefetch,
                                  bucket_bytes=SMALL_BUCKETS)
    for i, (x, y) in enumerate(batches(model, rank, world_size)):
        harness.train_step(engine, x, y, zero_grad=i < STEPS - 1)  # the last: right after step
    return engine


def prefetched_params(engine_keys: list[str], folder: str) -> dict:
    """ZeRO-1/2 gather the parameters asynchronously at the end of step(): a state-dict read, a
    checkpoint save, or no forward at all must still see (or leave) the gathered values."""
    out = {}
    for engine_key in engine_keys:
        reader = _trained(engine_key, prefetch=True)
        pending_before_read = len(reader._param_gathers)
        read = reader.full_state_dict()
        saver = _trained(engine_key, prefetch=True)
        pending_before_save = len(saver._param_gathers)
        checkpoint.save(saver, os.path.join(folder, engine_key))
        _trained(engine_key, prefetch=True)  # and one left with its gathers in flight: no hang
        with zerolab.record_comm() as log:
            _trained(engine_key, prefetch=True).wait_params()
        out[engine_key] = {
            "pending_before_read": pending_before_read, "read": read,
            "pending_before_save": pending_before_save,
            "saved": checkpoint.consolidate(os.path.join(folder, engine_key))["model"],
            "no_prefetch": _trained(engine_key, prefetch=False).full_state_dict(), "log": log}
    return out


def checkpointed_zero3(prefetch: bool) -> dict:
    """ZeRO-3 on a GPT whose blocks are checkpointed (torch.utils.checkpoint on each unit):
    backward recomputes each block's forward, and the unit's hooks fire again."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for mode in ("none", "block"):
        model = models.GPT(models.GPTConfig(n_layer=4, checkpoint=mode))
        engine = zerolab.ZeRO3(model, torch.optim.AdamW, lr=LR, prefetch=prefetch)
        with zerolab.record_comm() as log:
            for x, y in batches(model, rank, world_size):
                harness.train_step(engine, x, y)
        gathers: dict[str, int] = {}
        for e in log.events:
            if e.op == "all_gather":
                key = "/".join(e.tag.split("/")[1:])  # "fwd/blocks.2"
                gathers[key] = gathers.get(key, 0) + 1
        out[mode] = {"state": engine.full_state_dict(), "gathers": gathers,
                     "wire": log.total_wire_bytes(), "ring": log.total_ring_bytes()}
    return out
