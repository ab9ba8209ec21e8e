"""Workers for tests/test_torch_state.py: what a torch user does to a model that torch's DDP and
FSDP2 take, on every engine at 2 ranks, held to one process on the whole batch.

- "branch": a parameter that gets no gradient on some ranks in a step (a branch one rank's data
  takes): its gradient counts as zeros there, as with FSDP2; with and without no_sync(), and two
  synced backward passes before a step; "spare": also a ZeRO-3 unit no rank runs in some steps;
- "dsd": torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) saved with
  DCP after a step, then set_state_dict into a new engine, which trains on as if it never
  stopped (torchtitan's habit), with the engine and with its raw module as `model`;
- "zero3 params": after ZeRO3(model), the raw model's parameters have their full shapes
  (FSDP2's DTensors), init in place after wrapping takes effect, and a forward hook registered
  on a submodule after wrapping sees the full weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from zerolab import engines, harness, models

ENGINES = ("ddp", "zero1", "zero2", "zero3")
STEPS, MICRO_STEPS, GLOBAL_BATCH, WIDTH = 3, 2, 12, 8  # 12 rows: 2 or 3 ranks
SGD = {"lr": 0.1, "momentum": 0.9}  # SGD: reduction order stays at rounding (contract.py)


class Block(nn.Module):
    """Linear, and a side Linear added only where `side` is True (inside a ZeRO-3 unit)."""

    def __init__(self):
        super().__init__()
        self.main = nn.Linear(WIDTH, WIDTH)
        self.side = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        h = self.main(x)
        return F.gelu(h + self.side(x) if side else h)


class Branchy(nn.Module):
    """Blocks (ZeRO-3's units) and an `extra` Linear in the root; `take` picks the branch.
    Three blocks, so that a unit whose branch this rank skipped ends its backward between two
    of backward's all-gathers. spare: a fourth block (a unit), run only where `use_spare`, on
    every rank alike."""

    def __init__(self, seed: int = 0, spare: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.extra = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 4)
        if spare:
            self.blocks.append(Block())
        self.take = self.use_spare = False
        # Broadcast before each synced forward, as BatchNorm's statistics are (not saved): a
        # rank that skipped the branch reduces what it owes before, not after, the broadcast.
        self.register_buffer("calls", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, WIDTH) -> (batch, 4)
        self.calls += 1
        for block in self.blocks[:3]:
            x = block(x, self.take)
        if self.use_spare:
            x = self.blocks[3](x, self.take)
        if self.take:
            x = x + self.extra(x)
        return self.head(x)

    @staticmethod
    def make_batch(batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, WIDTH, generator=gen), torch.randn(batch_size, 4,
                                                                           generator=gen)


def takes(rank: int, step: int, micro: int) -> bool:
    """One rank of two takes the branch in each micro-step, the ranks in turn."""
    return (rank + step + micro) % 2 == 0


def synced(step: int, micro: int) -> bool:
    """Even steps: both micro-steps reduce (accumulation without no_sync()); odd: no_sync()."""
    return step % 2 == 0 or micro == MICRO_STEPS - 1


def spare_used(step: int) -> bool:
    """The spare block runs in the middle step only (on every rank): unused in the others."""
    return step == 1


def branch_reference(world_size: int = 2, spare: bool = False) -> dict[str, torch.Tensor]:
    model = Branchy(spare=spare)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    for step in range(STEPS):
        optimizer.zero_grad()
        for micro in range(MICRO_STEPS):
            losses = []
            for r in range(world_size):  # each rank's part of the batch, its own branch
                x, y = harness.local_batch(Branchy.make_batch, GLOBAL_BATCH, 10 * step + micro,
                                           r, world_size)
                model.take = takes(r, step, micro)
                model.use_spare = spare and spare_used(step)
                losses.append(F.mse_loss(model(x), y))
            (torch.stack(losses).mean() / MICRO_STEPS).backward()
        for p in model.parameters():  # a block no rank ran: its gradient counts as zeros
            if p.grad is None:  # (momentum moves it; FSDP2's too, measured)
                p.grad = torch.zeros_like(p)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def branch(key: str, spare: bool = False) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = Branchy(seed=rank, spare=spare)  # rank 0's weights win
    extra = {} if key == "zero3" else {"bucket_bytes": 600}  # several buckets
    engine = engines.make_engine(key, model, torch.optim.SGD, **SGD, **extra)
    for step in range(STEPS):
        engine.optimizer.zero_grad()
        for micro in range(MICRO_STEPS):
            engine.require_backward_grad_sync = synced(step, micro)
            x, y = harness.local_batch(Branchy.make_batch, GLOBAL_BATCH, 10 * step + micro,
                                       rank, world_size)
            model.take = takes(rank, step, micro)
            model.use_spare = spare and spare_used(step)
            (F.mse_loss(engine(x), y) / MICRO_STEPS).backward()
        engine.optimizer.step()
    return engine.full_state_dict()


BRANCH_ENGINES = ("ddp", "zero2", "zero3")  # ZeRO-1 refuses between two backward passes


def run_branch() -> dict:
    return {key: branch(key) for key in BRANCH_ENGINES} | {"zero3 spare": branch("zero3", True)}


def run_branch_zero3() -> dict:
    return {"zero3": branch("zero3"), "zero3 spare": branch("zero3", spare=True)}


def run_branch_zero1() -> dict:
    return branch("zero1")


# ---- torch's get_state_dict / set_state_dict, through DCP ------------------------------------

def _gpt(seed: int):
    model = models.GPT(models.GPTConfig(seed=seed))
    return model, engines.make_engine("ddp", model, torch.optim.AdamW, lr=1e-2,
                                      bucket_bytes=1 << 14)


def _train(model, engine, steps: range) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in steps:
        engine.optimizer.zero_grad()
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)
        model.loss(engine(x), y).backward()
        engine.optimizer.step()


def dsd(folder: str, form: str) -> dict:
    """DDP, `model` = the engine or engine.module: 2 steps, get_state_dict and dcp.save, 2 more
    steps; a new engine (other weights) loads it with set_state_dict and takes the same 2."""
    rank = dist.get_rank()
    model, engine = _gpt(seed=rank)
    _train(model, engine, range(2))
    msd, osd = get_state_dict(engine if form == "engine" else model, engine.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{folder}/{form}")
    _train(model, engine, range(2, 4))
    model2, engine2 = _gpt(seed=rank + 5)
    who = engine2 if form == "engine" else model2
    msd, osd = get_state_dict(who, engine2.optimizer)  # DCP loads into these tensors
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=f"{folder}/{form}")
    set_state_dict(who, engine2.optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])
    _train(model2, engine2, range(2, 4))
    return {"straight": engine.full_state_dict(), "resumed": engine2.full_state_dict(),
            "keys": sorted(osd["state"])[:2]}


def run_dsd(folder: str) -> dict:
    return {form: dsd(folder, form) for form in ("engine", "module")}
