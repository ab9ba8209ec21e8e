"""Worker functions for the strategy tests (spawned ranks import them from here)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import models
from zerolab.ddp import DDP
from zerolab.zero1 import ZeRO1, ZeRO1Naive
from zerolab.zero2 import ZeRO2, ZeRO2Naive
from zerolab.zero3 import ZeRO3

STRATEGIES = {"ddp": DDP, "zero1": ZeRO1, "zero1naive": ZeRO1Naive, "zero2": ZeRO2,
              "zero2naive": ZeRO2Naive, "zero3": ZeRO3}


def build_model(kind: str, seed: int = 0):
    if kind == "gpt":
        return models.GPT(models.GPTConfig(seed=seed))
    if kind == "mlp":
        return models.MLP(models.MLPConfig(seed=seed))
    if kind == "mlp_reuse":
        return models.MLP(models.MLPConfig(dims=(16, 24, 24, 24, 8), reuse_hidden=True, seed=seed))
    raise ValueError(kind)


def local_slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = x.shape[0] // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]


def reference_run(kind: str, steps: int, global_batch: int, lr: float = 1e-2) -> dict:
    """Single process, whole global batch."""
    model = build_model(kind)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.1)
    for step in range(steps):
        x, y = model.make_batch(global_batch, seed=100 + step)
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(strategy: str, kind: str, steps: int, global_batch: int, lr: float = 1e-2,
          engine_kwargs: dict | None = None) -> dict:
    """Train with a zerolab strategy; ranks start from different seeds (rank 0's wins)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(kind, seed=rank)  # different on every rank: construction broadcasts
    engine = STRATEGIES[strategy](model, torch.optim.AdamW, lr=lr, weight_decay=0.1,
                                  **(engine_kwargs or {}))
    with zerolab.record_comm() as log:
        for step in range(steps):
            x, y = model.make_batch(global_batch, seed=100 + step)
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
            model.loss(engine(x), y).backward()
            engine.step()
            if step == steps - 1:
                state_bytes = engine.model_state_bytes()
            engine.zero_grad()
    return {"state": engine.full_state_dict(), "bytes": state_bytes, "log": log}


def train_torch_ddp(kind: str, steps: int, global_batch: int, lr: float = 1e-2) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(kind, seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                            weight_decay=0.1)
    for step in range(steps):
        x, y = model.make_batch(global_batch, seed=100 + step)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        model.loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}}
