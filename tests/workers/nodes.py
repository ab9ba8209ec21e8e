"""Workers for tests/test_hsdp.py, test_zeropp.py, test_peers.py and the checkpoints across world
sizes in test_checkpoint.py: 4 ranks as 2 "nodes" of 2 (HSDP, ZeRO++, per-peer bytes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import engines, harness, models
from zerolab.wire.peers import record_peer_bytes

CONFIG = models.GPTConfig(n_layer=4, n_embd=48, n_head=4)
STEPS = 4
GLOBAL_BATCH = 12  # divides by 2, 3 and 4
LR = 1e-2
NODE = 2  # ranks per node
YARDSTICK_MULTIPLE = 5  # allowed distance from the reference, in units of torch DDP's
VARIANTS = {  # name -> (engine, keyword arguments)
    "ddp": ("ddp", {}),
    "zero2": ("zero2", {}),
    "zero3": ("zero3", {}),
    "hsdp": ("hsdp", {"shard_size": NODE}),
    "qwz": ("zeropp", {"quantize_weights": True}),
    "hpz": ("zeropp", {"secondary_shard_size": NODE}),
    "qwz+hpz": ("zeropp", {"quantize_weights": True, "secondary_shard_size": NODE}),
}


MEASURED = ("ddp", "zero3", "hsdp", "qwz", "hpz", "qwz+hpz")  # what everything() trains

# SGD with momentum for the equality checks: Adam's update of an element whose gradient is
# about zero flips with the rounding of that gradient, which would hide real differences.
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": LR, "momentum": 0.9}),
              "adamw": (torch.optim.AdamW, {"lr": LR})}


def train(variant: str, optimizer: str = "adamw") -> dict:
    """STEPS steps; the last one measured: comm log, memory, bytes to each peer."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    name, kwargs = VARIANTS[variant]
    model = models.GPT(CONFIG)
    optimizer_cls, optimizer_kwargs = OPTIMIZERS[optimizer]
    engine = engines.make_engine(name, model, optimizer_cls, **optimizer_kwargs, **kwargs)
    for step in range(STEPS):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)
        if step < STEPS - 1:
            harness.train_step(engine, x, y)
            continue
        with record_peer_bytes() as peers:
            measured = harness.measured_step(engine, x, y)
    return {"state": engine.full_state_dict(), "log": measured.log, "peers": peers,
            "held": measured.held, "max": measured.memory.max_by_category}


def reference() -> dict[str, torch.Tensor]:
    """One process, the whole global batch."""
    model = models.GPT(CONFIG)
    optimizer_cls, optimizer_kwargs = OPTIMIZERS["sgd"]
    opt = optimizer_cls(model.parameters(), **optimizer_kwargs)
    for step in range(STEPS):
        x, y = model.make_batch(GLOBAL_BATCH, seed=100 + step)
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def torch_ddp() -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT(CONFIG)
    optimizer_cls, optimizer_kwargs = OPTIMIZERS["sgd"]
    engine = engines.make_engine("torch_ddp", model, optimizer_cls, **optimizer_kwargs)
    for step in range(STEPS):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)
        harness.train_step(engine, x, y)
    return engine.full_state_dict()


def everything() -> dict:
    """Per variant: trained with AdamW (bytes, memory) and with SGD (values); torch's DDP."""
    out = {"torch_ddp": torch_ddp()}
    for v in MEASURED:
        out[v] = train(v, "adamw")
        out[v]["sgd_state"] = train(v, "sgd")["state"]
    return out


def uneven_world(shard_size: int) -> str:
    """HSDP on a world size that does not split into nodes of shard_size: the message."""
    try:
        engines.make_engine("hsdp", models.GPT(CONFIG), torch.optim.AdamW, shard_size=shard_size)
    except ValueError as e:
        return str(e)
    return "no error"


# ---- checkpoints across world sizes and stages ---------------------------------------------

def _steps(variant: str, steps: range, load_from: str | None = None, save_to: str | None = None,
           **kwargs) -> dict[str, torch.Tensor]:
    from zerolab import checkpoint

    rank, world_size = dist.get_rank(), dist.get_world_size()
    name, variant_kwargs = VARIANTS[variant]
    model = models.GPT(CONFIG)
    optimizer_cls, optimizer_kwargs = OPTIMIZERS["sgd"]
    engine = engines.make_engine(name, model, optimizer_cls, **optimizer_kwargs,
                                 **{**variant_kwargs, **kwargs})
    if load_from:
        checkpoint.load(engine, load_from)
    for step in steps:
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)
        harness.train_step(engine, x, y)
    if save_to:
        checkpoint.save(engine, save_to)
    return engine.full_state_dict()


def save_at_4(folder: str) -> dict:
    """ZeRO-3 and HSDP each save after 2 steps; the uninterrupted 5-step run to compare with."""
    _steps("zero3", range(2), save_to=f"{folder}/zero3")
    _steps("hsdp", range(2), save_to=f"{folder}/hsdp")
    return _steps("ddp", range(5))


def resume(variant: str, folder: str, **kwargs) -> dict[str, torch.Tensor]:
    return _steps(variant, range(2, 5), load_from=folder, **kwargs)


def resume_hsdp(folder: str, shard_size: int) -> dict[str, torch.Tensor]:
    return _steps("hsdp", range(2, 5), load_from=folder, shard_size=shard_size)
