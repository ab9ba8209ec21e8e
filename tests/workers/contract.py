"""Workers for tests/test_torch_contract.py: torch habits beyond nanoGPT's loop, each run on
every engine and held to the same loop on one process (`reference(habit)`).

SGD with momentum, not Adam: Adam turns the ranks' reduction order into ~1e-5 of the weights,
SGD leaves it at rounding, so 1e-6 tells a right step from a wrong one.

- "own optimizer": the user's SGD over `engine.parameters()`, zeroed and stepped by the user
  (a peer course's DDP tests do this): DDP's parameters are the model's, whose .grad holds the
  average when backward returns; ZeRO's are this rank's shards, as FSDP2's;
- "grad scaler": torch's GradScaler, enabled (scale 2^10), with unscale_, clip_grad_norm_ over
  engine.parameters(), scaler.step(engine.optimizer) and update();
- "adafactor" (DDP): a matrix optimizer stepped on whole parameters, whatever the tile size.
Also: an optimizer over the sharded model's own parameters, refused at its first step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import engines, harness, models

ENGINES = ("ddp", "zero1", "zero2", "zero3")
STEPS, GLOBAL_BATCH, LR = 3, 8, 1e-2
SGD = {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}


def batch(model, step: int, rank: int, world_size: int):
    return harness.local_batch(model.make_batch, GLOBAL_BATCH, 300 + step, rank, world_size)


def loop(habit: str, model, runner, optimizer, rank: int, world_size: int) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=habit == "grad scaler")
    params = runner.parameters  # the wrapper's: the engine's, or the plain model's
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = batch(model, step, rank, world_size)
        loss = model.loss(runner(x), y)
        scaler.scale(loss).backward()
        if habit == "grad scaler":
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params(), 0.5)
        scaler.step(optimizer)
        scaler.update()


def optimizer_of(habit: str, params) -> torch.optim.Optimizer:
    if habit == "adafactor":
        return torch.optim.Adafactor(params, lr=LR)
    return torch.optim.SGD(params, **SGD)


def reference(habit: str) -> dict[str, torch.Tensor]:
    model = models.GPT()
    loop(habit, model, model, optimizer_of(habit, model.parameters()), 0, 1)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(key: str, habit: str) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT(models.GPTConfig(seed=rank))  # rank 0's weights must win
    optimizer_cls = torch.optim.Adafactor if habit == "adafactor" else torch.optim.SGD
    kwargs = {"lr": LR} if habit == "adafactor" else dict(SGD)
    if key != "zero3":
        kwargs["bucket_bytes"] = 1 << 14
    engine = engines.make_engine(key, model, optimizer_cls, optimizer_tile_numel=64, **kwargs)
    optimizer = engine.optimizer
    if habit == "own optimizer":
        optimizer = optimizer_of(habit, engine.parameters())
    loop(habit, model, engine, optimizer, rank, world_size)
    return engine.full_state_dict()


def raw_params_refused(key: str) -> str:
    """An optimizer over the wrapped model's own parameters: refused at its first step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT()
    engine = engines.make_engine(key, model, torch.optim.AdamW, lr=LR)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = batch(model, 0, rank, world_size)
    model.loss(engine(x), y).backward()
    try:
        optimizer.step()
    except RuntimeError as e:
        return str(e)
    return ""


def shard_numel(key: str) -> tuple[int, int]:
    """(numel of engine.parameters(), this rank's numel of it): FSDP2's view of shards."""
    model = models.GPT()
    engine = engines.make_engine(key, model, torch.optim.AdamW, lr=LR)
    ps = list(engine.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in ps)
    return sum(p.numel() for p in ps), local


def when_backward_returns(key: str) -> dict:
    """Right after loss.backward(), nothing else called: every reduction waited for, and under
    DDP the model's own .grad the average over ranks (torch's DDP's promise)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT()
    extra = {} if key == "zero3" else {"bucket_bytes": 1 << 14}
    engine = engines.make_engine(key, model, torch.optim.SGD, **SGD, **extra)
    x, y = batch(model, 0, rank, world_size)
    with zerolab.record_comm(align=False) as log:
        model.loss(engine(x), y).backward()
        waited = [e.end is not None for e in log.events]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if key == "ddp"}
    return {"waited": waited, "grads": grads}


def reference_grads() -> dict[str, torch.Tensor]:
    model = models.GPT()
    x, y = batch(model, 0, 0, 1)
    model.loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def scaler_with_inf(where: str) -> dict:
    """ZeRO-2 with an enabled GradScaler and an inf in the gradients: `everywhere` (every
    rank's shard holds one: every rank skips the step, as GradScaler would) or `one element`
    of rank 0's (only the rank owning its shard finds it: refused, naming what to do)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT()
    engine = engines.make_engine("zero2", model, torch.optim.SGD, **SGD, bucket_bytes=1 << 14)
    first = engine.buckets[0].params[0]  # its first element: offset 0 of bucket 0, shard 0

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        if where == "everywhere":
            grad.fill_(float("inf"))
        elif rank == 0:
            grad.view(-1)[0] = float("inf")
        return grad

    for p in (model.parameters() if where == "everywhere" else [first]):
        p.register_hook(poison)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = engine.full_state_dict()
    x, y = batch(model, 0, rank, world_size)
    scaler.scale(model.loss(engine(x), y)).backward()
    try:
        scaler.step(engine.optimizer)
        scaler.update()
        said = ""
    except RuntimeError as e:
        said = str(e)
    return {"said": said, "unchanged": harness.max_diff(engine.full_state_dict(), before) == 0,
            "scale": scaler.get_scale()}


HABITS = ("own optimizer", "grad scaler")


def run_all() -> dict:
    out = {(habit, key): run(key, habit) for habit in HABITS for key in ENGINES}
    out["adafactor", "ddp"] = run("ddp", "adafactor")
    out["refused"] = {key: raw_params_refused(key) for key in ENGINES}
    out["numel"] = {key: shard_numel(key) for key in ENGINES}
    out["backward returns"] = {key: when_backward_returns(key) for key in ENGINES}
    out["inf"] = {where: scaler_with_inf(where) for where in ("everywhere", "one element")}
    return out
