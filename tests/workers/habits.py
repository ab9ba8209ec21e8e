"""Workers for tests/test_habits.py: a torch user's habits on every engine, in one launch.

Each habit is a training loop a torch user writes (zeroing through the model or the optimizer,
two backward passes before step(), reading parameters right after step(), a state dict saved
and loaded, BatchNorm, parameter groups, mixed dtypes). `reference(...)` runs it on one process
with the whole global batch; `habits()` runs it on every rank under every engine, and under
torch's own DDP where that applies (the yardstick: torch's result, reached the same way).
"""

from __future__ import annotations

import copy
import io
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import zerolab
from zerolab import engines, harness, models

ENGINES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
SHARDED_PARAMS = ("zero3", "hsdp")  # parameters are 0-element shards between steps
STEPS = 3
GLOBAL_BATCH = 12  # divides by 2 and 3
LR = 1e-2
SMALL_BUCKETS = 2000  # bytes: several buckets for the small models

# ---- models ------------------------------------------------------------------------------------


def gpt(seed: int = 0) -> models.GPT:
    return models.GPT(models.GPTConfig(seed=seed))


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> GELU -> Linear: running statistics are buffers."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, 16) -> (batch, 8)
        return self.head(F.gelu(self.bn(self.fc(x))))

    make_batch = models.MLP.make_batch
    loss = staticmethod(F.mse_loss)
    config = models.MLPConfig(dims=(16, 32, 8))


class MixedDtypeNet(nn.Module):
    """fp32 Linears around a float64 scale and a bf16 shift: three dtypes of parameters."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(16, 32)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(32, dtype=torch.float64))
        self.shift = nn.Parameter((0.1 * torch.randn(32)).to(torch.bfloat16))
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale.float() + self.shift.float()
        return self.head(F.gelu(h))

    make_batch = models.MLP.make_batch
    loss = staticmethod(F.mse_loss)
    config = models.MLPConfig(dims=(16, 32, 8))


MODELS = {"gpt": gpt, "batchnorm": BatchNormNet, "dtypes": MixedDtypeNet}


def groups_of(model: nn.Module) -> list[dict]:
    """The GPT recipe: decay on matrices, none (and a larger lr) on biases and gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 2 * LR}]


# ---- the loops ---------------------------------------------------------------------------------
# A loop trains `model` through `runner` (an engine, torch's DDP, or the model itself on one
# process) with `opt` (what the user holds as "the optimizer"), on this rank's rows, and
# returns what the user reads after each step.

def batch(model, step: int, rank: int, world_size: int, rows: int = GLOBAL_BATCH):
    return harness.local_batch(model.make_batch, rows, 100 + step, rank, world_size)


def loop(habit: str, model, runner, opt, engine, rank: int, world_size: int) -> list:
    reads = []
    for step in range(STEPS):
        if habit in ("two_backward", "three_backward"):  # no no_sync(): each backward reduces
            k = 2 if habit == "two_backward" else 3
            x, y = batch(model, step, 0, 1, k * GLOBAL_BATCH)
            for m in range(k):
                rows = slice(m * GLOBAL_BATCH, (m + 1) * GLOBAL_BATCH)
                xs, ys = harness.local_rows((x[rows], y[rows]), rank, world_size)
                (model.loss(runner(xs), ys) / k).backward()
        else:
            x, y = batch(model, step, rank, world_size)
            loss = model.loss(runner(x), y)
            if habit == "optimizer.zero_grad before backward":  # the tutorials' order
                opt.zero_grad()
            loss.backward()
        (engine or opt).step()
        if habit == "read after step":  # before anything else runs
            reads.append([p.detach().clone() for p in model.parameters()])
        elif habit == "state_dict after step":
            reads.append({k: v.clone() for k, v in model.state_dict().items()})
        zero(habit, model, opt, engine)
    return reads


def zero(habit: str, model, opt, engine) -> None:
    if habit == "model.zero_grad":
        model.zero_grad()
    elif habit == "model.zero_grad(set_to_none=False)":
        model.zero_grad(set_to_none=False)
    elif habit == "optimizer.zero_grad(set_to_none=False)":
        opt.zero_grad(set_to_none=False)
    elif habit == "p.grad = None":  # torch's performance guide's loop
        for p in model.parameters():
            p.grad = None
    elif habit == "engine.zero_grad" and engine is not None:
        engine.zero_grad()
    elif habit != "optimizer.zero_grad before backward":
        opt.zero_grad()


ZEROING = ("engine.zero_grad", "model.zero_grad", "model.zero_grad(set_to_none=False)",
           "optimizer.zero_grad", "optimizer.zero_grad(set_to_none=False)",
           "optimizer.zero_grad before backward", "p.grad = None")
HABITS = (*ZEROING, "two_backward", "three_backward", "read after step",
          "state_dict after step", "param_groups", "dtypes", "batchnorm")
MODEL_OF = {"param_groups": "gpt", "dtypes": "dtypes", "batchnorm": "batchnorm"}


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def optimizer_params(habit: str, model) -> list:
    if habit == "param_groups":
        return groups_of(model)
    return [p for p in model.parameters() if p.requires_grad]


def optimizer(habit: str) -> tuple[type[torch.optim.Optimizer], dict]:
    """AdamW, but SGD for BatchNorm: Adam turns the reduction order's rounding into ~1e-5 of
    the weights, and a variance over 4 rows (3 ranks) would make that ~1e-3 of the outputs."""
    if habit.startswith("batchnorm"):
        return torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1}


def reference(habit: str) -> dict:
    """One process, the whole global batch: what every engine must reproduce."""
    model = MODELS[MODEL_OF.get(habit, "gpt")]()
    optimizer_cls, kwargs = optimizer(habit)
    opt = optimizer_cls(optimizer_params(habit, model), **kwargs)
    reads = loop(habit, model, model, opt, None, 0, 1)
    return {"state": state(model), "reads": reads}


def make(key: str, model, habit: str = "", **kwargs):
    # HSDP: one node of 2 at 2 ranks (sharded, as ZeRO-3); 3 nodes of 1 at 3 (replicas only).
    hsdp = {"shard_size": 2 if dist.get_world_size() % 2 == 0 else 1}
    extra = hsdp if key == "hsdp" else {} if key == "zero3" else {"bucket_bytes": SMALL_BUCKETS}
    optimizer_cls, optimizer_kwargs = optimizer(habit)
    return engines.make_engine(key, model, optimizer_cls, **optimizer_kwargs, **extra, **kwargs)


def run_engine(key: str, habit: str, **kwargs) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = MODELS[MODEL_OF.get(habit, "gpt")](seed=rank)  # rank 0's must win
    if habit == "param_groups":
        kwargs["param_groups"] = groups_of(model)
    engine = make(key, model, habit, **kwargs)
    with zerolab.record_comm(align=False) as log, warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        reads = loop(habit, model, engine, engine.optimizer, engine, rank, world_size)
    out = {"state": engine.full_state_dict(), "reads": reads,
           "warnings": [str(w.message) for w in said],
           "tags": sorted({e.tag for e in log.events if "buffers" in e.tag}),
           "buffer_broadcasts": sum("buffers" in e.tag for e in log.events)}
    if habit == "batchnorm":
        out["local_buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        with torch.no_grad():
            model.eval()
            out["eval"] = engine(batch(model, 99, 0, 1)[0])
    if habit == "param_groups":
        out["group_options"] = [(g["weight_decay"], g["lr"])
                                for g in engine.optimizer.param_groups]
    return out


def run_torch_ddp(habit: str, **kwargs) -> dict:
    """torch's own DDP, the same loop: its result is what the engines are held to."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = MODELS[MODEL_OF.get(habit, "gpt")]()
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    optimizer_cls, optimizer_kwargs = optimizer(habit)
    opt = optimizer_cls(optimizer_params(habit, model), **optimizer_kwargs)
    loop(habit, model, ddp, opt, None, rank, world_size)
    out = {"state": state(model)}
    if habit == "batchnorm":
        out["local_buffers"] = {n: b.clone() for n, b in model.named_buffers()}
        with torch.no_grad():
            ddp.eval()
            out["eval"] = ddp(batch(model, 99, 0, 1)[0])
    return out


# ---- state dicts -------------------------------------------------------------------------------

def trained(key: str) -> tuple:
    """(model, engine, rank, world_size): engine `key` after the habits' STEPS steps."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = gpt(seed=rank)
    engine = make(key, model)
    loop("engine.zero_grad", model, engine, engine.optimizer, engine, rank, world_size)
    return model, engine, rank, world_size


def state_dicts(key: str) -> dict:
    """model.state_dict() through torch.save/torch.load into a plain model; then the other way:
    model.load_state_dict(full) into a fresh engine, which trains on from there."""
    model, engine, rank, world_size = trained(key)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    saved_bytes = buffer.tell()
    buffer.seek(0)
    plain = gpt(seed=99)
    plain.load_state_dict(torch.load(buffer))
    # Load the trained weights into a fresh engine (other seeds), then train on.
    fresh_model = gpt(seed=rank + 7)
    fresh = make(key, fresh_model)
    fresh_model.load_state_dict(state(plain))
    loaded = fresh.full_state_dict()
    partial = {k: v for k, v in state(plain).items() if not k.startswith("blocks.1.")}
    other = make(key, gpt(seed=5))
    missing = other.module.load_state_dict(partial, strict=False).missing_keys
    for step in range(STEPS, STEPS + 2):
        x, y = batch(fresh_model, step, rank, world_size)
        fresh_model.loss(fresh(x), y).backward()
        fresh.step()
        fresh.zero_grad()
    return {"plain": state(plain), "saved_bytes": saved_bytes, "loaded": loaded,
            "trained_on": fresh.full_state_dict(), "partial": other.full_state_dict(),
            "missing": sorted(missing)}


def engine_state_dicts(key: str) -> dict:
    """engine.rank_state_dict() (this rank's part) through torch.save and torch.load (weights_only,
    torch's default) into a fresh engine of other seeds, which must then hold and train on
    exactly as the saved one does; and engine.load_state_dict() of a full state dict."""
    model, engine, rank, world_size = trained(key)
    buffer = io.BytesIO()
    torch.save(engine.rank_state_dict(), buffer)
    buffer.seek(0)
    fresh_model = gpt(seed=rank + 11)
    fresh = make(key, fresh_model)
    part = torch.load(buffer)
    try:  # another rank's part: refused, naming what loads at another world size
        fresh.load_state_dict({**part, "zerolab_part": {**part["zerolab_part"],
                                                        "rank": (rank + 1) % world_size}})
        refused = ""
    except ValueError as e:
        refused = str(e)
    chunked = next((k for k, v in part["model"].items() if isinstance(v, dict)), None)
    not_pieces = ""
    if chunked is not None:  # a sharded parameter given whole where its pieces belong
        try:
            fresh.load_state_dict({**part, "model": {**part["model"], chunked: torch.zeros(3)}})
        except ValueError as e:
            not_pieces = str(e)
    fresh.load_state_dict(part)
    same_loaded = harness.max_diff(fresh.full_state_dict(), engine.full_state_dict()) == 0
    for step in range(STEPS, STEPS + 2):  # Adam's moments and step count restored: the same
        for m, e in ((model, engine), (fresh_model, fresh)):
            x, y = batch(m, step, rank, world_size)
            m.loss(e(x), y).backward()
            e.step()
            e.zero_grad()
    other = make(key, gpt(seed=5))
    other.load_state_dict({"model": engine.full_state_dict()})
    saved = engine.full_state_dict()
    return {"same_loaded": same_loaded,
            "same_trained_on": harness.max_diff(fresh.full_state_dict(), saved) == 0,
            "full_form": harness.max_diff(other.full_state_dict(), saved) == 0,
            "refused": refused, "not_pieces": (chunked, not_pieces)}


def reference_state_dicts() -> dict:
    """One process: STEPS steps, then 2 more with a fresh optimizer (a model-only reload)."""
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loop("engine.zero_grad", model, model, opt, None, 0, 1)
    trained = state(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    for step in range(STEPS, STEPS + 2):
        x, y = batch(model, step, 0, 1)
        model.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    partial = {k: (trained[k] if not k.startswith("blocks.1.") else v)
               for k, v in state(gpt(seed=5)).items()}
    return {"trained": trained, "trained_on": state(model), "partial": partial}


# ---- a copy of the model (an EMA, an eval copy) ------------------------------------------------

def copies(key: str) -> dict:
    """copy.deepcopy of a wrapped model carries the engine's hooks: its zero_grad must not zero
    the engine's gradients, and its forward on one rank alone must issue no collective."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = BatchNormNet(seed=rank)
    engine = make(key, model)
    x, y = batch(model, 0, rank, world_size)
    model.loss(engine(x), y).backward()
    engine._sync_grads()  # the reductions are done: the gradients the optimizer will read
    before = [t.clone() for t in engine._owned_grads()]
    copied = copy.deepcopy(model)
    copied.zero_grad()
    kept = all(torch.equal(a, b) for a, b in zip(before, engine._owned_grads()))
    with zerolab.record_comm(align=False) as log:
        if rank == 0:  # a hook issuing a collective here would hang the launch
            copied.eval()
            with torch.no_grad():
                copied(x)
    engine.step()
    return {"grads_kept": kept, "copy_collectives": len(log.events)}


# ---- everything, one launch --------------------------------------------------------------------

# The zeroing spellings differ from one another in who zeroes what, not in how many ranks
# share a bucket: the odd world size (uneven shards, padding) runs them all, the even one these.
ZEROING_AT_EVERY_SIZE = ("engine.zero_grad", "model.zero_grad", "p.grad = None")


def habits() -> dict:
    out: dict = {"engines": {}, "torch_ddp": {}, "state_dicts": {}, "engine_state": {},
                 "prefetch": {}}
    odd = dist.get_world_size() % 2 == 1
    for habit in HABITS:
        if habit in ZEROING and habit not in ZEROING_AT_EVERY_SIZE and not odd:
            continue
        out["torch_ddp"][habit] = run_torch_ddp(habit)
        for key in ENGINES:
            if habit == "read after step" and key in SHARDED_PARAMS:
                continue  # ZeRO-3's parameters are shards: "state_dict after step" reads them
            out["engines"][habit, key] = run_engine(key, habit)
    out["torch_ddp"]["batchnorm, no broadcast"] = run_torch_ddp(
        "batchnorm", forward_sync_buffers=False)
    for key in ENGINES:
        out["engines"]["batchnorm, no broadcast", key] = run_engine(
            key, "batchnorm", broadcast_buffers=False)
        out["state_dicts"][key] = state_dicts(key)
        out["engine_state"][key] = engine_state_dicts(key)
    out["copies"] = {key: copies(key) for key in ("ddp", "zero1", "zero2")}
    for key in ("zero1", "zero2"):  # overlap opted into: readers of the model wait
        for habit in ("state_dict after step", "two_backward"):
            out["prefetch"][habit, key] = run_engine(key, habit, prefetch=True)
    return out
