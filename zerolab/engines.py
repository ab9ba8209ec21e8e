"""Every engine zerolab can run, and the contract each one keeps.

    engine = zerolab.engines.make_engine("zero2", model, torch.optim.AdamW, lr=1e-3)
    zerolab.engines.ENGINES["zero2"].label         # "ZeRO-2": how the course names it
    zerolab.engines.ENGINES["zero2"].stage         # "ZeRO-2": the formulas that predict it

An *engine* is the object that wraps a model and an optimizer (`zerolab.DDP(model, AdamW)`,
torch's FSDP2 behind the same methods, a learner's own); a *stage* is a ZeRO level, whose
formulas live in zerolab.theory. The harness, the bench, the checkpoints, the notebooks and the
grader reach every engine through `Engine` below and find it by its key here: one table, so
that a label, a formula or a torch counterpart is written once.

Torch habits every zerolab engine keeps (zerolab/shell.py is the module a torch user meets;
tests/test_habits.py and tests/test_torch_contract.py hold each habit to the single-process
reference and to torch's DDP running the same loop):

- zeroing through the model or the optimizer: `model.zero_grad()`, `engine.optimizer.
  zero_grad()` (set_to_none either way) are `engine.zero_grad()` (parts/habits.py); DDP and
  ZeRO-1 also take back a `.grad` set to None by hand, as torch's DDP does (ZeRO-2/3 hold no
  `.grad` to set: they warn when a backward adds to gradients a step() has used);
- several backward passes before `step()` without `no_sync()`: each reduces its own gradients
  and step() takes their sum, as torch's DDP (no_sync() stays the way to save the traffic);
- parameters readable after `step()`: ZeRO-1/2 wait for their gathers in step() unless built
  with prefetch=True (then model.state_dict(), load_state_dict() and full_state_dict() wait;
  anything else calls `wait_params()` first);
- `model.state_dict()` and `model.load_state_dict(full)` in full tensors, under ZeRO-3 too
  (there, collectives: every rank calls them, as FSDP2's get_model_state_dict);
- `engine.rank_state_dict()`: this rank's part of the model and the optimizer (plain data:
  torch.save and torch.load's defaults take it), and `engine.load_state_dict(part or full)`:
  the same engine, rank and world size, or a full state dict (parts/rank_state.py;
  zerolab.checkpoint for any world size); `engine.state_dict()` is torch DDP's ("module.");
- buffers broadcast from rank 0 before a training forward, as torch's DDP
  (`broadcast_buffers=False` to keep each rank's own; parts/buffers.py);
- parameter groups, spelled as torch's: `param_groups=[{"params": [...], "weight_decay": 0.1},
  ...]` (parts/param_groups.py), and parameters of several dtypes (a bucket per dtype).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from zerolab import theory
from zerolab.parts.tiles import OptimizerTiles
from zerolab.sharding import Slot

# ---- the contract -------------------------------------------------------------------------------


@runtime_checkable
class Engine(Protocol):
    """What the harness, the bench and the grader call on an engine: a training step, and what
    this rank holds. zerolab's engines, torch's (zerolab.bench.baselines) and a learner's keep it.
    """

    module: nn.Module  # the wrapped model: forward runs it, state dicts name its parameters
    group: dist.ProcessGroup | None  # the ranks this engine averages and shards over
    job_group: dist.ProcessGroup | None  # every rank of the job (HSDP's spans several groups)

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...  # forward

    def step(self) -> None: ...  # finish the gradients' reduction, step, re-sync parameters

    def zero_grad(self) -> None: ...  # zerolab's: zero_grad(set_to_none=True), in place

    def wait_params(self) -> None: ...  # return once parameters hold their latest values

    def state_tensors(self) -> dict[str, list[torch.Tensor]]: ...  # held now, by category

    def model_state_bytes(self) -> dict[str, int]: ...  # params / grads / optimizer bytes

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...  # collective: full tensors


@runtime_checkable
class ShardedEngine(Engine, Protocol):
    """An Engine that says which part of every parameter this rank holds: what a checkpoint
    writes and loads (zerolab.checkpoint), at any world size. zerolab's engines keep it.

    Its sharded state dict, in torch.distributed.checkpoint's terms, is read from this layout
    (zerolab.parts.state_dicts): `engine_state_dict(engine)` gives this rank's part, keyed as
    the plain model's state_dict ("model") and FSDP2's get_optimizer_state_dict
    ("optimizer"), each tensor as the rectangles of it this rank holds; and
    `load_engine_state_dict(engine, full)` loads full tensors, each rank taking its part.
    engine.rank_state_dict() / load_state_dict() are the same part as plain data
    (rank_state.py)."""

    name: str  # first part of every comm tag: "zero2"
    rank: int  # this rank in `group`
    optimizer: torch.optim.Optimizer  # steps `masters`, in tiles
    slots: list[Slot]  # what this rank steps: a parameter whole, or its shard of a bucket
    masters: list[torch.Tensor]  # the fp32 tensor the optimizer steps for each slot
    tiles: OptimizerTiles  # how the optimizer sees the masters (its state, joined per master)

    def frozen_slots(self) -> list[Slot]: ...  # parameters never trained: held, not stepped

    def no_sync(self) -> contextlib.AbstractContextManager[None]: ...  # accumulate locally


# ---- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """One engine zerolab can build by name."""

    key: str  # how the CLI, the bench and the lessons name it: "zero2"
    label: str  # how the course prints it: "ZeRO-2", "torch FSDP2 (fully_shard)"
    short: str  # two short lines, for a crowded axis: "zerolab\nZeRO-2"
    target: str  # "module:Class", imported when first asked for (torch's engines cost imports)
    stage: str  # the stage whose formulas predict its model-state bytes (theory.STAGES)
    traffic: str  # the formula its bytes on the wire follow (theory.comm_volume's stage)
    counterpart: str | None = None  # the torch engine the bench times it against

    @property
    def is_torch(self) -> bool:
        """torch's own engine (DDP, ZeroRedundancyOptimizer, FSDP2) behind zerolab's contract."""
        return self.key.startswith("torch_")


def _info(key: str, label: str, short: str, target: str, stage: str, traffic: str | None = None,
          counterpart: str | None = None) -> EngineInfo:
    return EngineInfo(key, label, short, target, stage, traffic or stage, counterpart)


_ALL_REDUCE_ZERO1 = theory.ALL_REDUCE_ZERO1  # all-reduce, keep your shard, all-gather: 3Ψ
ENGINES: dict[str, EngineInfo] = {e.key: e for e in (
    _info("ddp", "DDP", "zerolab\nDDP", "zerolab.ddp:DDP", "DDP", counterpart="torch_ddp"),
    _info("ddp_after_backward", "DDP, reduced after backward", "DDP\nafter bwd",
          "zerolab.ddp:DDPAfterBackward", "DDP"),
    _info("zero1", "ZeRO-1", "zerolab\nZeRO-1", "zerolab.zero1:ZeRO1", "ZeRO-1",
          counterpart="torch_ddp_zero"),
    _info("zero1_after_backward", "ZeRO-1, reduced after backward", "ZeRO-1\nafter bwd",
          "zerolab.zero1:ZeRO1AfterBackward", "ZeRO-1"),
    _info("zero1_all_reduce", "ZeRO-1 by all-reduce", "ZeRO-1\nall-reduce",
          "zerolab.zero1:ZeRO1AllReduce", "ZeRO-1", _ALL_REDUCE_ZERO1),
    _info("zero2", "ZeRO-2", "zerolab\nZeRO-2", "zerolab.zero2:ZeRO2", "ZeRO-2",
          counterpart="torch_ddp"),
    _info("zero2_after_backward", "ZeRO-2, reduced after backward", "ZeRO-2\nafter bwd",
          "zerolab.zero2:ZeRO2AfterBackward", "ZeRO-2"),
    _info("zero3", "ZeRO-3", "zerolab\nZeRO-3", "zerolab.zero3:ZeRO3", "ZeRO-3",
          counterpart="torch_fsdp2"),
    _info("zeropp", "ZeRO++", "zerolab\nZeRO++", "zerolab.zeropp:ZeroPP", "ZeRO-3"),
    _info("hsdp", "HSDP", "zerolab\nHSDP", "zerolab.hsdp:HSDP", "ZeRO-3"),
    # torch's DDP + ZeroRedundancyOptimizer all-reduces the whole gradient, then broadcasts the
    # parameters: ZeRO-1's memory with the all-reduce ZeRO-1's traffic (3Ψ).
    _info("torch_ddp", "torch DDP", "torch\nDDP", "zerolab.bench.baselines:TorchDDP", "DDP"),
    _info("torch_ddp_zero", "torch DDP + ZeroRedundancyOptimizer", "torch\nDDP+ZeRO",
          "zerolab.bench.baselines:TorchZeRO", "ZeRO-1", _ALL_REDUCE_ZERO1),
    _info("torch_fsdp2", "torch FSDP2 (fully_shard)", "torch\nFSDP2",
          "zerolab.bench.baselines:TorchFSDP2", "ZeRO-3"),
)}
STAGE_ENGINES = ("ddp", "zero1", "zero2", "zero3")  # the four stages the course builds


def info(key: str) -> EngineInfo:
    """The registry's entry for `key`, or an error that lists the keys."""
    if key not in ENGINES:
        raise ValueError(f"unknown engine {key!r}; choose from {list(ENGINES)}")
    return ENGINES[key]


def label(key: str, beside_torch: bool = False) -> str:
    """How the course names an engine: "ZeRO-2", "torch FSDP2 (fully_shard)"; beside torch's
    engines (a table of both), zerolab's say so: "zerolab ZeRO-2"."""
    e = info(key)
    return f"zerolab {e.label}" if beside_torch and not e.is_torch else e.label


def engine_class(key: str) -> type:
    """The class registered as `key`, imported on first use."""
    module, _, attr = info(key).target.partition(":")
    return getattr(importlib.import_module(module), attr)


def make_engine(key: str, model: nn.Module,
                optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                **kwargs: Any) -> Engine:
    """Wrap `model` in the engine called `key`; kwargs go to the engine and the optimizer."""
    return engine_class(key)(model, optimizer_cls, **kwargs)
