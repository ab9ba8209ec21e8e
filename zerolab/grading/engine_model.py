"""What the engine exercises train, and what each stage promises: the model, the cases, the
stages' reference engines and the allowances a learner's engine is held to.

The model is the course's GPT, small: the output head tied to the token embedding, a frozen
layer (blocks.1.fc: requires_grad=False, nonzero, so that a step taken on it shows; a whole
layer, so that holding it gathered at rest shows) and sizes whose buckets and units split
unevenly over 2 and 3 ranks (padding). Three cases, each STEPS steps on the same global batches
for the learner's engine and zerolab's of the same stage:

- SGD, one backward per step: an update is proportional to its gradient, so a gradient N times
  too large shows (Adam's update is invariant to the gradient's scale);
- SGD, two backward passes before each step (gradient accumulation): the same, unless the
  second backward's gradients replace the first's instead of adding to them;
- AdamW with weight decay, two backward passes per step: optimizer state to measure, a frozen
  parameter stepped by mistake moves. Its second step is measured: every live storage on the
  rank at the end of each forward and backward, after step() and at the step's peak, and every
  collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerolab.ddp import DDP
from zerolab.grading.engine_mistakes import known_mistakes
from zerolab.grading.exercise import Case, Exercise
from zerolab.models import GPT, GPTConfig
from zerolab.units import make_units
from zerolab.zero2 import ZeRO2
from zerolab.zero3 import ZeRO3

CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=4, n_head=2, n_embd=20, seed=0)
FROZEN = ("blocks.1.fc.weight", "blocks.1.fc.bias")  # requires_grad=False
GLOBAL_BATCH = 12  # rows per step, split over 1, 2 or 3 ranks, then into micro-batches
STEPS = 3
MEASURED = 1  # which step of the measured case is measured (the second: optimizer state exists)
BUCKET_BYTES = 8 << 10  # small, so that the model makes about ten buckets
PARAM_ATOL = 1e-5  # parameters agree with zerolab's engine's to this (as the tests' yardstick)
LOSS_RTOL = 1e-5


def make_model() -> GPT:
    """The model every engine exercise trains, the same on every rank."""
    model = GPT(CONFIG)
    gen = torch.Generator().manual_seed(1)
    for name in FROZEN:
        frozen = model.get_parameter(name)
        with torch.no_grad():  # not zero, so that weight decay would move it if it were stepped
            frozen.copy_(torch.randn(frozen.shape, generator=gen) * 0.1)
        frozen.requires_grad_(False)
    return model


@dataclass(frozen=True)
class Setting:
    """One case: the optimizer both engines get, backward passes per step, what is measured."""

    optimizer_cls: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    micro_batches: int  # backward passes before each step
    measured: bool  # step MEASURED is measured
    seed: int  # batches are drawn from seed + step


SGD = Setting(torch.optim.SGD, {"lr": 0.5}, 1, measured=False, seed=0)
ACCUMULATED = Setting(torch.optim.SGD, {"lr": 0.5}, 2, measured=False, seed=50)
# eps 1e-3: an update g / (|g| + eps) barely moves when rounding moves a tiny g (engines that
# bucket differently sum in another order). foreach: a few ops for the whole step.
ADAMW = Setting(torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1,
                                    "foreach": True}, 2, measured=True, seed=100)
CASES = [(f"SGD, {STEPS} steps", SGD),
         (f"SGD, two backward passes before each of {STEPS} steps", ACCUMULATED),
         (f"AdamW, two backward passes per step, step {MEASURED + 1} measured", ADAMW)]


def engine_cases(world_size: int) -> list[Case]:
    return [Case(label, lambda rank, s=s: (s,)) for label, s in CASES]


# ---- the stages -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """A stage the learner builds: zerolab's engine of it, and what it may hold besides."""

    name: str  # the first part of every comm tag: "ddp", "zero2", "zero3"
    label: str  # "DDP"
    engine: type  # zerolab's engine of the stage
    bytes_per_step: str  # the ring-model traffic, for messages: "2Ψ"
    unit_of_work: str  # what one collective moves: "bucket" or "unit"

    def reference(self, model: torch.nn.Module, optimizer_cls: type, **kwargs: Any) -> Any:
        """zerolab's engine as the exercise's contract describes it: no prefetch, whole
        tensors to the optimizer (the stub's engine does neither)."""
        if self.name != "ddp":
            kwargs["prefetch"] = False
        return self.engine(model, optimizer_cls, optimizer_tile_numel=None, **kwargs)


class ZeRO3AsTaught(ZeRO3):
    """zerolab's ZeRO-3 as exercise 5.3 asks for it: the root gathered again for backward.
    (zerolab's own keeps the root gathered from forward to backward, as FSDP2 does.)"""

    keeps_root = False


STAGES = {"ddp": Stage("ddp", "DDP", DDP, "2Ψ", "bucket"),
          "zero2": Stage("zero2", "ZeRO-2", ZeRO2, "2Ψ", "bucket"),
          "zero3": Stage("zero3", "ZeRO-3", ZeRO3AsTaught, "3Ψ", "unit")}


@dataclass(frozen=True)
class Sizes:
    """The model's sizes on N ranks, in bytes (fp32), for allowances and messages."""

    world_size: int
    psi: int  # Ψ: the parameters (frozen ones included)
    params: int  # 4Ψ
    trainable: int  # 4Ψ of the trainable parameters
    frozen: int  # bytes of the frozen parameters
    bucket: int  # the most a greedy bucket holds: bucket_bytes + the largest parameter
    unit: int  # ZeRO-3's largest unit, full
    tied: dict[str, int]  # a weight shared by several modules: its names -> bytes
    slack: int  # padding: up to N elements per parameter tensor

    @classmethod
    def of(cls, model: torch.nn.Module, world_size: int) -> Sizes:
        params = list(model.parameters())
        nbytes = [p.numel() * p.element_size() for p in params]
        unit_bytes = [sum(p.numel() * p.element_size() for p in u.params)
                      for u in make_units(model)]
        names: dict[torch.nn.Parameter, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(name)
        tied = {" = ".join(ns): p.numel() * p.element_size() for p, ns in names.items()
                if len(ns) > 1}
        return cls(world_size, sum(p.numel() for p in params), sum(nbytes),
                   sum(b for b, p in zip(nbytes, params) if p.requires_grad),
                   sum(b for b, p in zip(nbytes, params) if not p.requires_grad),
                   BUCKET_BYTES + max(nbytes), max(unit_bytes), tied,
                   4 * world_size * len(params))

    def allowance(self, stage: Stage) -> int:
        """What a learner's engine may hold above zerolab's during a step: one more bucket
        (or unit) than it, in flight or gathered ahead, and padding."""
        return (self.unit if stage.unit_of_work == "unit" else self.bucket) + self.slack

    def psi_of(self, nbytes: int) -> str:
        """Bytes as a multiple of Ψ (fp32 parameters are 4Ψ bytes): "4.0Ψ"."""
        return f"{nbytes / self.psi:.1f}Ψ"


def bucket_sizes(model: torch.nn.Module, forward_order: bool = False) -> list[int]:
    """The bytes of each bucket, in the order backward completes them, as the contract cuts
    them (trainable parameters in reverse order, closed at BUCKET_BYTES) or, forward_order,
    cut the other way round (the mistake)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    order = trainable if forward_order else list(reversed(trainable))
    sizes, size = [0], 0
    for p in order:
        if size >= BUCKET_BYTES:
            sizes.append(0)
            size = 0
        sizes[-1] += p.numel() * p.element_size()
        size += p.numel() * p.element_size()
    return list(reversed(sizes)) if forward_order else sizes


def engine_exercise(exercise_id: str, module: str, cls: str, stage: str, teaches: str,
                    hint: str, hints: tuple[str, ...] = ()) -> Exercise:
    """An engine exercise: the class `cls` in `module`, graded against zerolab's `stage`."""
    return Exercise(exercise_id, module, cls, teaches, hint, engine_cases, distributed=True,
                    kind="engine", stage=stage, hints=hints, mistakes=known_mistakes(stage))
