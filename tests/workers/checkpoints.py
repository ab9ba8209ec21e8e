"""Workers for tests/test_checkpoint.py's DCP round trips: every engine saves at 4 ranks and
loads into another engine at 1, 2 and 3; zerolab <-> FSDP2 (fully_shard) both ways; a damaged
checkpoint refused on every rank."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from workers import engines as W
from zerolab import checkpoint, engines, harness
from zerolab.lessons import n09_dcp
from zerolab.models import GPTConfig

GPT_CONFIG = GPTConfig()  # W.build_model("gpt"): what the FSDP2 round trips use
KIND = "mlp"  # a frozen parameter, a parameter of one element, a buffer (the GPT: tied weights)
BF16 = {"param_dtype": torch.bfloat16}
# Every zerolab engine, by the name of its checkpoint folder: (engine key, keyword arguments).
SAVERS = {
    "ddp": ("ddp", {}), "ddp_after_backward": ("ddp_after_backward", {}),
    "zero1": ("zero1", {}), "zero1_after_backward": ("zero1_after_backward", {}),
    "zero1_all_reduce": ("zero1_all_reduce", {}), "zero2": ("zero2", {}),
    "zero2_after_backward": ("zero2_after_backward", {}), "zero3": ("zero3", {}),
    "hsdp": ("hsdp", {"shard_size": 2}),
    "zeropp": ("zeropp", {"quantize_weights": True, "secondary_shard_size": 2}),
    "ddp_bf16": ("ddp", BF16), "zero2_bf16": ("zero2", BF16), "zero3_bf16": ("zero3", BF16),
}
# What loads them at 1, 2 and 3 ranks (any world size): each checkpoint into another engine.
LOADERS = [("zero3", {}), ("ddp", {}), ("zero1", {}), ("zero2_bf16", BF16), ("zero2", {}),
           ("zero3_bf16", BF16), ("zero1_all_reduce", {})]


def _engine(key: str, kwargs: dict, seed: int):
    model = W.build_model(KIND, seed=seed)
    name = key.removesuffix("_bf16")
    return model, engines.make_engine(name, model, torch.optim.AdamW, lr=W.LR,
                                      weight_decay=0.1, optimizer_tile_numel=7, **kwargs)


def save_every_engine(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each of SAVERS trains 2 steps and saves into root/<name>; returns what each holds."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, (key, kwargs) in SAVERS.items():
        model, engine = _engine(key, kwargs, seed=rank)
        for step in range(2):
            harness.train_step(engine, *harness.local_batch(model.make_batch, W.GLOBAL_BATCH,
                                                            100 + step, rank, world_size))
        checkpoint.save(engine, os.path.join(root, name))
        out[name] = engine.full_state_dict()
    return out


def loader_of(name: str, world_size: int) -> tuple[str, dict]:
    return LOADERS[(list(SAVERS).index(name) + world_size) % len(LOADERS)]


def load_every_checkpoint(root: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each checkpoint of save_every_engine into `loader_of` it at this world size; returns
    what the loader holds, and saves it again into root/<name>-at-<N>."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in SAVERS:
        model, engine = _engine(*loader_of(name, world_size), seed=rank + 11)
        checkpoint.load(engine, os.path.join(root, name))
        out[name] = engine.full_state_dict()
        checkpoint.save(engine, os.path.join(root, f"{name}-at-{world_size}"))
    return out


# ---- zerolab <-> FSDP2 (notebook 09's functions, on the engine tests' GPT) -------------------


def fsdp2_both_ways(zerolab_folder: str, fsdp2_folder: str) -> dict:
    """FSDP2 loads zerolab's checkpoint (get_state_dict, dcp.load, set_state_dict); then a
    fresh FSDP2 trains and saves its own with dcp.save."""
    return n09_dcp.fsdp2_loads_and_saves(zerolab_folder, fsdp2_folder, GPT_CONFIG)


def zerolab_from_fsdp2(fsdp2_folder: str, root: str) -> dict[str, dict]:
    """ZeRO-3, ZeRO-2 and DDP load FSDP2's checkpoint at this world size, and save it again."""
    return {key: n09_dcp.zerolab_loads(fsdp2_folder, os.path.join(root, key), key, GPT_CONFIG)
            for key in ("zero3", "zero2", "ddp")}


def load_into_zero3(kind: str, folder: str) -> None:
    """Load `folder` into ZeRO-3 (a damaged one raises CheckpointError on every rank)."""
    engine = engines.make_engine("zero3", W.build_model(kind), torch.optim.AdamW, lr=W.LR)
    checkpoint.load(engine, folder)
