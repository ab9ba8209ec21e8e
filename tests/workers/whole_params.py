"""Workers for tests/test_whole_params.py: Adafactor and Muon on ZeRO-1/2/3, each parameter
stepped whole by its owner (zerolab/parts/whole_params.py), against one process."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import harness, models
from zerolab.parts import whole_params

CONFIG = models.GPTConfig(n_layer=2, n_embd=32, n_head=2)
STEPS = 3
GLOBAL_BATCH = 12  # divides by 1, 2, 3 and 4
SMALL_BUCKETS = 1 << 13  # bytes: several buckets, matrices cut across the shards
ENGINES = {"zero1": zerolab.ZeRO1, "zero2": zerolab.ZeRO2, "zero3": zerolab.ZeRO3}
OPTIMIZERS = ("adafactor", "muon")
ADAFACTOR = {"lr": 1e-2}
MUON = {"lr": 2e-2}
ADAMW = {"lr": 3e-3}  # Muon's second optimizer: the parameters that are not 2-D


def groups(model: torch.nn.Module, optimizer: str, engine: bool) -> tuple[type, list, dict]:
    """(class, param groups, keyword arguments): the engine's spelling, or two torch
    optimizers' (engine=False: the second group's class is given apart)."""
    if optimizer == "adafactor":
        return torch.optim.Adafactor, [{"params": list(model.parameters())}], ADAFACTOR
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    second = {"params": others, **ADAMW}
    if engine:
        second[whole_params.GROUP_OPTIMIZER] = torch.optim.AdamW
    return torch.optim.Muon, [{"params": matrices}, second], MUON


def reference(optimizer: str, micro_batches: int = 1) -> dict[str, torch.Tensor]:
    """One process, the global batch (micro_batches > 1: the same, its gradient summed in
    another order: the yardstick of float rounding)."""
    model = models.GPT(CONFIG)
    cls, param_groups, kwargs = groups(model, optimizer, engine=False)
    opts = [cls(param_groups[:1], **kwargs)]
    if optimizer == "muon":
        opts.append(torch.optim.AdamW(param_groups[1:]))
    for step in range(STEPS):
        x, y = model.make_batch(GLOBAL_BATCH, seed=100 + step)
        for part in range(micro_batches):
            rows = slice(part * GLOBAL_BATCH // micro_batches,
                         (part + 1) * GLOBAL_BATCH // micro_batches)
            (model.loss(model(x[rows]), y[rows]) / micro_batches).backward()
        for o in opts:
            o.step()
            o.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(key: str, optimizer: str, **engine_kwargs) -> dict:
    """The engine's run: its final weights, and the comm log of its last step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT(CONFIG)
    cls, param_groups, kwargs = groups(model, optimizer, engine=True)
    if key != "zero3":
        engine_kwargs.setdefault("bucket_bytes", SMALL_BUCKETS)
    engine = ENGINES[key](model, cls, param_groups=param_groups, **kwargs, **engine_kwargs)
    for step in range(STEPS):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)
        with zerolab.record_comm() as log:
            model.loss(engine(x), y).backward()
            engine.optimizer.step()
        engine.optimizer.zero_grad()
    whole = engine.whole
    grad_bytes = engine.slots[0].tensor.element_size()
    formula = whole_params.extra_bytes([s.layout for s in engine.slots], grad_bytes,
                                       engine.masters[0].element_size(),
                                       any(whole.values_travel))
    return {"state": engine.full_state_dict(), "formula": formula,
            "sent": {kind: sum(e.ring_bytes for e in log.events
                               if e.tag.endswith(f"/whole.{kind}"))
                     for kind in ("grad", "value", "update")},
            "wire": [e.wire_bytes for e in log.events if "/whole." in e.tag],
            "calls": len([e for e in log.events if "/whole." in e.tag]),
            "other": sum(e.ring_bytes for e in log.events if "/whole." not in e.tag),
            "owned": sum(len(r.owned) for r in whole.routes),
            "n_params": sum(len(s.params) for s in engine.slots)}


AT_THREE = (("zero1", "adafactor"), ("zero3", "muon"))  # 3 ranks: a shard between two others


def everything(cases: tuple = ()) -> dict:
    """Each (engine, optimizer) of `cases` (default: every engine with both optimizers, then
    ZeRO-2 with bf16 parameters, whose fp32 masters travel, and DDP's bf16 run beside it;
    HSDP's refusal)."""
    if cases:
        return {case: train(*case) for case in cases}
    out = {(key, opt): train(key, opt) for key in ENGINES for opt in OPTIMIZERS}
    out["zero2", "adafactor", "bf16"] = train("zero2", "adafactor", param_dtype=torch.bfloat16)
    out["ddp", "adafactor", "bf16"] = {"state": _ddp_bf16()}
    try:
        zerolab.HSDP(models.GPT(CONFIG), torch.optim.Adafactor, shard_size=1, **ADAFACTOR)
        out["hsdp", "refused"] = {"message": "not refused"}
    except TypeError as e:
        out["hsdp", "refused"] = {"message": str(e)}
    return out


def _ddp_bf16() -> dict[str, torch.Tensor]:
    """DDP steps whole parameters (fp32 masters of bf16 ones): what ZeRO-2 in bf16 must give."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT(CONFIG)
    engine = zerolab.DDP(model, torch.optim.Adafactor, param_dtype=torch.bfloat16, **ADAFACTOR)
    for step in range(STEPS):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)
        model.loss(engine(x), y).backward()
        engine.optimizer.step()
        engine.optimizer.zero_grad()
    return engine.full_state_dict()
