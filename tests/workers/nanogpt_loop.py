"""Workers for tests/test_torch_contract.py: nanoGPT's train.py loop, ported as a torch user
ports it (`model = zerolab.ZeRO2(model, ...)` where nanoGPT writes `DDP(model)`,
`optimizer = model.optimizer`, `raw_model = model.module`), and the torch habits around it.

The loop keeps nanoGPT's shape: parameter groups by dimension, AdamW betas (0.9, 0.95), the
learning rate set by hand every iteration, micro-steps toggling `require_backward_grad_sync`,
a GradScaler (disabled, as nanoGPT's is outside float16: `scaler.step(optimizer)` is
`optimizer.step()`), `scaler.unscale_` and `clip_grad_norm_(model.parameters(), 1.0)`, an eval
under `no_grad` with model.eval()/model.train(), and a checkpoint `{"model": raw_model.
state_dict(), "optimizer": optimizer.state_dict()}` written by rank 0 and resumed by a new
engine. `reference()` runs the same loop on one process with the whole batch.
"""

from __future__ import annotations

import io
import math
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerolab
from zerolab import engines, harness, models

ENGINES = ("ddp", "zero1", "zero2", "zero3")
ITERS, MICRO_STEPS, GLOBAL_BATCH = 4, 2, 12  # iterations; micro-steps per iteration; rows
RESUME_AT = 2  # the checkpoint is written after this many iterations
LR, MIN_LR, WARMUP = 6e-3, 6e-4, 1
GRAD_CLIP = 1.0


class NanoGPT(nn.Module):
    """The course's GPT behind nanoGPT's interface: forward(idx, targets) -> (logits, loss)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.gpt = models.GPT(models.GPTConfig(seed=seed))  # head tied to the embedding

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.gpt(idx)
        loss = None if targets is None else F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """nanoGPT's configure_optimizers: decay the matrices, not the biases and gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def get_lr(it: int) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine decay to MIN_LR."""
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / max(1, ITERS - WARMUP)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)


def get_batch(it: int, micro: int, rank: int, world_size: int):
    make = models.GPT().make_batch
    return harness.local_batch(make, GLOBAL_BATCH, 1000 * it + micro, rank, world_size)


def train(model, optimizer, raw_model, scaler, start: int, stop: int, rank: int,
          world_size: int, ddp: bool) -> list[float]:
    """nanoGPT's inner loop, iterations [start, stop). Returns the eval losses."""
    evals = []
    for it in range(start, stop):
        lr = get_lr(it)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        model.eval()
        with torch.no_grad():
            x, y = get_batch(99, 0, rank, world_size)
            evals.append(model(x, y)[1].item())
        model.train()
        for micro_step in range(MICRO_STEPS):
            if ddp:
                model.require_backward_grad_sync = micro_step == MICRO_STEPS - 1
            x, y = get_batch(it, micro_step, rank, world_size)
            _, loss = model(x, y)
            loss = loss / MICRO_STEPS
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return evals


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def reference() -> dict:
    """One process, the whole batch: straight through, and what the checkpoint holds."""
    model = NanoGPT()
    optimizer = torch.optim.AdamW(model.optimizer_groups(0.1), lr=LR, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    evals = train(model, optimizer, model, scaler, 0, RESUME_AT, 0, 1, False)
    at_resume = state(model)
    evals += train(model, optimizer, model, scaler, RESUME_AT, ITERS, 0, 1, False)
    return {"state": state(model), "at_resume": at_resume, "evals": evals}


def wrap(key: str, raw: nn.Module):
    if key == "torch_ddp":
        model = nn.parallel.DistributedDataParallel(raw)
        return model, torch.optim.AdamW(raw.optimizer_groups(0.1), lr=LR, betas=(0.9, 0.95))
    extra = {} if key == "zero3" else {"bucket_bytes": 1 << 14}  # several buckets
    model = engines.make_engine(key, raw, torch.optim.AdamW, lr=LR, betas=(0.9, 0.95),
                                param_groups=raw.optimizer_groups(0.1), **extra)
    return model, model.optimizer


def nanogpt(key: str) -> dict:
    """The ported loop on this rank: straight, then resumed from rank 0's checkpoint."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    raw = NanoGPT(seed=rank)  # rank 0's weights must win
    model, optimizer = wrap(key, raw)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with zerolab.record_comm(align=False) as log:
        evals = train(model, optimizer, raw, scaler, 0, RESUME_AT, rank, world_size, True)
    reductions = sum(e.op in ("all_reduce", "reduce_scatter") and "/clip" not in e.tag
                     for e in log.events)
    # nanoGPT: `if master_process: torch.save({"model": raw_model.state_dict(), ...})`. Under
    # ZeRO-3 raw_model.state_dict() is a collective (full tensors, as FSDP2's): every rank
    # calls it; the sharded optimizers refuse a rank-0 state_dict() that cannot resume.
    checkpoint, refused = io.BytesIO(), ""
    model_state = raw.state_dict()
    try:
        optimizer_state = optimizer.state_dict()
    except RuntimeError as e:
        optimizer_state, refused = None, str(e)
    if rank == 0:
        torch.save({"model": model_state, "optimizer": optimizer_state}, checkpoint)
    parts = model.rank_state_dict() if refused else None  # the per-rank spelling that resumes
    straight_evals = evals + train(model, optimizer, raw, scaler, RESUME_AT, ITERS, rank,
                                   world_size, True)
    out = {"state": state(raw), "refused": refused, "evals": straight_evals,
           "reductions": reductions, "buckets": len(getattr(model, "buckets", []))}
    # A new launch resumes: nanoGPT loads the model before wrapping, the optimizer after.
    blob = [checkpoint.getvalue()]
    dist.broadcast_object_list(blob, src=0)
    ckpt = torch.load(io.BytesIO(blob[0]))
    raw2 = NanoGPT(seed=rank + 5)
    raw2.load_state_dict(ckpt["model"])
    model2, optimizer2 = wrap(key, raw2)
    if ckpt["optimizer"] is not None:
        optimizer2.load_state_dict(ckpt["optimizer"])
    else:
        model2.load_state_dict(parts)
    train(model2, optimizer2, raw2, scaler, RESUME_AT, ITERS, rank, world_size, True)
    out["resumed"] = raw2.state_dict()
    return out


def run_all() -> dict:
    return {key: nanogpt(key) for key in (*ENGINES, "torch_ddp")}


if __name__ == "__main__":  # by hand: python tests/workers/nanogpt_loop.py [world_size]
    ref = reference()
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 2  # GLOBAL_BATCH divides by it
    for key, got in zerolab.launch(run_all, world_size)[0].items():
        print(key, harness.max_diff(got["state"], ref["state"]),
              harness.max_diff(got["resumed"], ref["state"]), bool(got["refused"]))
