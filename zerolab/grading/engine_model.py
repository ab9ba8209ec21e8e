"""What the engine exercises train, and what each stage promises: the model, the cases, the
stages' reference engines and the bounds a learner's engine is held to.

The model is the course's GPT, small: the output head tied to the token embedding, one frozen
parameter (a LayerNorm bias, given nonzero values so that a step taken on it shows) and sizes
whose buckets and units split unevenly over 2 and 3 ranks (padding). Two cases, each STEPS
steps on the same global batches for the learner's engine and zerolab's of the same stage:

- SGD: an update is proportional to its gradient, so a gradient N times too large shows
  (Adam's update is invariant to the gradient's scale: "sum instead of average" hides there);
- AdamW, with weight decay: optimizer state to measure, and a frozen parameter stepped by
  mistake moves. Its second step is measured: memory and collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from zerolab.ddp import DDP
from zerolab.grading.exercise import Case
from zerolab.grading.mistakes import Mistake
from zerolab.models import GPT, GPTConfig
from zerolab.units import make_units
from zerolab.zero2 import ZeRO2
from zerolab.zero3 import ZeRO3

CONFIG = GPTConfig(vocab_size=61, block_size=8, n_layer=4, n_head=2, n_embd=20, seed=0)
FROZEN = "blocks.0.ln1.bias"  # requires_grad=False
GLOBAL_BATCH = 6  # rows per step, split over 1, 2 or 3 ranks
STEPS = 3
MEASURED = 1  # which step of the AdamW case is measured (the second: optimizer state exists)
BUCKET_BYTES = 8 << 10  # small, so that the model makes about ten buckets
PARAM_ATOL = 1e-5  # parameters agree with zerolab's engine's to this (as the tests' yardstick)
LOSS_RTOL = 1e-5


def make_model() -> GPT:
    """The model every engine exercise trains, the same on every rank."""
    model = GPT(CONFIG)
    frozen = model.get_parameter(FROZEN)
    with torch.no_grad():  # not zero, so that weight decay would move it if it were stepped
        frozen.copy_(torch.randn(frozen.shape, generator=torch.Generator().manual_seed(1)))
    frozen.requires_grad_(False)
    return model


@dataclass(frozen=True)
class Setting:
    """One case: the optimizer both engines get, and whether a step is measured."""

    optimizer_cls: type[torch.optim.Optimizer]
    optimizer_kwargs: dict[str, Any]
    measured: bool
    seed: int  # batches are drawn from seed + step


def engine_cases(world_size: int) -> list[Case]:
    sgd = Setting(torch.optim.SGD, {"lr": 0.5}, measured=False, seed=0)
    # eps 1e-3: an update g / (|g| + eps) barely moves when rounding moves a tiny g (engines
    # that bucket differently sum in another order). foreach: a few ops for the whole step,
    # rather than ten per parameter, for the memory tracker to follow.
    adamw = Setting(torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-3, "weight_decay": 0.1,
                                        "foreach": True}, measured=True, seed=100)
    return [Case(f"SGD, {STEPS} steps", lambda rank: (sgd,)),
            Case(f"AdamW, {STEPS} steps, step {MEASURED + 1} measured", lambda rank: (adamw,))]


# ---- the stages -------------------------------------------------------------------------------


class ZeRO3AsTaught(ZeRO3):
    """zerolab's ZeRO-3 as exercise 5.3 asks for it: the root gathered again for backward.
    (zerolab's own keeps the root gathered from forward to backward, as FSDP2 does.)"""

    keeps_root = False


@dataclass(frozen=True)
class Stage:
    """A stage the learner builds: zerolab's engine of it, and how its step goes."""

    name: str  # the first part of every comm tag: "ddp", "zero2", "zero3"
    label: str  # "DDP"
    reference: type  # zerolab's engine, the answer
    sharded: tuple[str, ...]  # the model-state categories divided by N
    bytes_per_step: str  # the ring-model traffic, for messages: "2Ψ"
    peak_bounds: Callable[[Sizes], dict[str, tuple[int, str]]]  # category -> (bytes, why)
    mistakes: dict[str, Mistake] = field(default_factory=dict)  # the stage's own, by finding


@dataclass(frozen=True)
class Sizes:
    """The model's sizes on N ranks, in bytes (fp32), for formulas and bounds."""

    world_size: int
    params: int  # 4Ψ: every distinct parameter, frozen ones included
    trainable: int  # 4Ψ of the trainable parameters
    bucket: int  # the most a greedy bucket holds: bucket_bytes + the largest parameter
    root: int  # ZeRO-3's root unit, full
    unit: int  # ZeRO-3's largest other unit, full
    tied: dict[str, int]  # a weight shared by several modules: its names -> bytes
    slack: int  # padding: up to N elements per parameter tensor, per buffer

    @classmethod
    def of(cls, model: torch.nn.Module, world_size: int) -> Sizes:
        params = list(model.parameters())
        nbytes = [p.numel() * p.element_size() for p in params]
        units = make_units(model)
        unit_bytes = [sum(p.numel() * p.element_size() for p in u.params) for u in units]
        names: dict[torch.nn.Parameter, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(name)
        tied = {" = ".join(ns): p.numel() * p.element_size() for p, ns in names.items()
                if len(ns) > 1}
        return cls(world_size, sum(nbytes),
                   sum(b for b, p in zip(nbytes, params) if p.requires_grad),
                   BUCKET_BYTES + max(nbytes), unit_bytes[-1], max(unit_bytes[:-1]), tied,
                   4 * world_size * len(params))

    def per_rank(self, nbytes: int) -> int:
        return -(-nbytes // self.world_size)


def _ddp_bounds(s: Sizes) -> dict[str, tuple[int, str]]:
    return {"grads": (s.trainable + 2 * s.bucket,
                      f"4Ψ of gradients ({s.trainable:,}) + 2 buckets of at most {s.bucket:,}")}


def _zero2_bounds(s: Sizes) -> dict[str, tuple[int, str]]:
    shards = s.per_rank(s.trainable)
    return {"grads": (shards + 2 * s.bucket, f"4Ψ/N of gradient shards ({shards:,}) "
                                             f"+ 2 buckets of at most {s.bucket:,}")}


def _zero3_bounds(s: Sizes) -> dict[str, tuple[int, str]]:
    def bound(shards: int, what: str) -> tuple[int, str]:
        return (shards + s.root + 2 * s.unit,
                f"4Ψ/N of {what} ({shards:,}) + the root ({s.root:,}) "
                f"+ 2 units of at most {s.unit:,}")
    return {"params": bound(s.per_rank(s.params), "parameter shards"),
            "grads": bound(s.per_rank(s.trainable), "gradient shards")}


STAGES = {
    "ddp": Stage("ddp", "DDP", DDP, (), "2Ψ", _ddp_bounds, {
        "spread": Mistake(
            "gradients not averaged over the ranks",
            "Each rank must step with the average of every rank's gradients: all-reduce each "
            "bucket (op=\"avg\") and wait for it before the optimizer steps."),
        "peak grads": Mistake(
            "gradients copied out of the buckets",
            "DDP holds 4Ψ of gradients: let autograd accumulate into .grad views of the flat "
            "bucket buffers, rather than copying the gradients."),
        "late": Mistake(
            "no overlap: all-reduce after backward",
            "Start each bucket's all-reduce during backward, from the post-accumulate-grad "
            "hook of its last parameter (async_op=True); step() only waits for them."),
        "blocking": Mistake(
            "no overlap: backward waits for each all-reduce",
            "Issue each bucket's all-reduce with async_op=True, keep its handle, and wait for "
            "the handles in step(): backward computes the next gradients meanwhile."),
        "loss": Mistake(
            "forward changed",
            "The loss differs with the same parameters: __call__ must run the model's forward "
            "on the input as it is."),
    }),
    "zero2": Stage("zero2", "ZeRO-2", ZeRO2, ("grads", "optimizer"), "2Ψ", _zero2_bounds, {
        "spread": Mistake(
            "a rank stepped another rank's shard",
            "Rank r owns shard r of each flat buffer, flat[r*shard_numel:(r+1)*shard_numel] "
            "(zerolab.sharding.shard(flat, layout, r)): its optimizer steps that shard with "
            "the gradient shard reduce_scatter gives rank r, and all_gather puts it back at "
            "the same place."),
        "peak grads": Mistake(
            "full gradients not freed during backward",
            "More than about two buckets of full gradients were alive at once: reduce-scatter "
            "each bucket during backward as soon as it is complete, and free its full "
            "gradients (p.grad = None) right away."),
        "held grads": Mistake(
            "full gradients kept after step()",
            "Set p.grad = None for the bucket's parameters once their gradients are "
            "flattened: only the gradient shards stay."),
        "late": Mistake(
            "reduce-scatter after backward",
            "Reduce-scatter each bucket during backward, from the post-accumulate-grad hook "
            "of its last parameter: waiting for step() keeps every full gradient alive at "
            "the peak (ZeRO-2 naive)."),
        "blocking": Mistake(
            "no overlap: backward waits for each reduce-scatter",
            "Issue each bucket's reduce-scatter with async_op=True and wait for it later (before "
            "the next bucket's, and in step()): backward computes the next gradients "
            "meanwhile."),
        "all_reduce": Mistake(
            "all-reduce instead of reduce-scatter",
            "ZeRO-2 reduce-scatters each bucket (each rank receives only its own shard, "
            "averaged) and all-gathers the parameters after the step: all-reducing the "
            "gradients sends 3Ψ, not 2Ψ."),
        "loss": Mistake(
            "parameters not gathered after the step",
            "The loss differs with the same parameters: after the step, all-gather every "
            "bucket's shards into its flat buffer before the next forward."),
    }),
    "zero3": Stage("zero3", "ZeRO-3", ZeRO3AsTaught, ("params", "grads", "optimizer"), "3Ψ",
                   _zero3_bounds, {
        "spread": Mistake(
            "a rank stepped another rank's shard",
            "Rank r owns shard r of each unit's flat buffer, flat[r*shard_numel:(r+1)*"
            "shard_numel] (zerolab.sharding.shard(flat, layout, r)): it steps that shard "
            "with the gradient shard reduce_scatter gives rank r, and all_gather puts rank "
            "r's shard at that place."),
        "peak params": Mistake(
            "units not freed after forward",
            "More than the root and two units were gathered at once: reshard each unit right "
            "after its forward (a forward hook), and again after its backward; gather it "
            "again before its backward."),
        "peak grads": Mistake(
            "full gradients not freed after each unit's backward",
            "After a unit's reduce-scatter, free its full gradients (p.grad = None): only "
            "the gradient shards stay."),
        "held params": Mistake(
            "units left gathered after step()",
            "At rest a rank holds only its shards: reshard every unit after its backward "
            "(flat.untyped_storage().resize_(0), p.data = torch.empty(0)), and gather nothing "
            "in step(): the next forward gathers each unit when it needs it."),
        "held grads": Mistake(
            "full gradients kept after step()",
            "Set p.grad = None once a unit's gradients are flattened: only the gradient "
            "shards stay."),
        "late": Mistake(
            "collectives in the wrong phase",
            "ZeRO-3 gathers each unit before its forward and again before its backward, and "
            "reduce-scatters its gradients right after its backward; nothing is gathered "
            "after step(): the next forward gathers what it needs."),
        "loss": Mistake(
            "forward on parameters not gathered",
            "The loss differs with the same parameters: every unit must be gathered before "
            "its forward runs (a forward pre-hook on its modules), the root for the whole "
            "forward."),
    }),
}
