"""Notebook 05, ZeRO-3: parameters gathered one unit at a time, measured on every rank.

`zero3_lesson` runs on every rank and, in one launch:

- trains a small GPT with ZeRO-3, prefetch on and then off; for each, one step under the memory
  tracker (live bytes by category: the parameter sawtooth) and one step with the comm recorder
  only (a timeline not slowed down by the tracker, with a "forward" span per block);
- trains the same model with ZeRO-2 for one step, to compare the bytes sent: 3Ψ against 2Ψ;
- trains the same GPT at other depths (DEPTHS blocks) with ZeRO-3 and prefetch, one tracked
  step each: the parameter peak against the model's size, as the model gets deeper;
- notes how many CPU cores and compute threads each rank had, for the timings.

`compute_beside_gathers` turns the two timelines' per-block compute times into the verdict they
support (slower, faster, or within noise), rather than a comparison of two medians.

Every step is `harness.measured_step`. It returns a `Zero3Lesson` (`MemoryTrace`s and
`CommLog`s inside); the notebook draws it with `zerolab.plots`.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerolab import engines, harness
from zerolab.comm import CommLog
from zerolab.harness import MeasuredStep
from zerolab.models import GPT, GPTConfig, num_params

# 8 blocks of hidden size 64: 405,120 parameters (1.62 MB in fp32). One block is 199,936 bytes,
# an eighth of the model: at 2 ranks the shards (half the model) plus the root and two blocks in
# flight (prefetch) peak at 76% of the full model; with fewer blocks it would be more.
MODEL = GPTConfig(n_layer=8, n_embd=64, n_head=4)
LR = 1e-3
BATCH_PER_RANK = 2  # sequences per rank in the tracked step
TIMELINE_BATCH_PER_RANK = 32  # sequences per rank in the step drawn on the timeline
DEPTHS = (2, 4)  # other numbers of blocks whose parameter peak is measured (8: MODEL's)


@dataclass
class DepthPeak:
    """ZeRO-3 with prefetch on a GPT of `n_layer` blocks: its parameter bytes, one rank."""

    n_layer: int
    full_param_bytes: int  # 4Ψ: the whole model
    shard_bytes: int  # 4Ψ/N (+ padding): this rank's shards, held at rest
    peak_param_bytes: int  # the largest parameter bytes alive during one tracked step


@dataclass
class Zero3Run:
    """ZeRO-3 (prefetch on or off) on one rank: two measured steps and the units' sizes."""

    step: MeasuredStep  # under the memory tracker: .held (at rest), .memory, .log, .phases()
    timeline: CommLog  # a step with no tracker, a bigger batch and a "forward" span per block
    unit_bytes: dict[str, int]  # each unit's gathered size: {"blocks.0": .., ..., "root": ..}
    shard_bytes: int  # this rank's parameter shards, all units together
    padded_numel: int  # elements in all units, padding included: the Ψ the formulas see
    full_param_bytes: int  # 4Ψ: the whole model, as it was before sharding


@dataclass
class Zero3Lesson:
    """Everything notebook 05 measures, on one rank."""

    num_params: int  # Ψ
    prefetch: Zero3Run  # ZeRO-3 with prefetch (the default)
    no_prefetch: Zero3Run  # the same, each unit gathered only when it is needed
    zero2_log: CommLog  # ZeRO-2's comm log for one step of the same model: its 2Ψ
    same_weights: bool  # prefetch on and off ended with bitwise equal weights
    depths: list[DepthPeak]  # MODEL's depth and DEPTHS, by number of blocks
    cpu_cores: int  # cores this machine has (os.cpu_count()): the ranks share them
    compute_threads: int  # threads each rank's torch uses for compute (torch.get_num_threads())


def batch(model: GPT, step: int, per_rank: int = BATCH_PER_RANK) -> tuple[torch.Tensor, ...]:
    """This rank's rows of step `step`'s global batch (per_rank * N sequences, seed 100 + step)."""
    n = dist.get_world_size()
    return harness.local_batch(model.make_batch, per_rank * n, 100 + step, dist.get_rank(), n)


def trained_one_step(name: str, model: GPT, **kwargs: Any) -> Any:
    """Engine `name` on `model`, after one unmeasured step (which creates Adam's state)."""
    engine = engines.make_engine(name, model, torch.optim.AdamW, lr=LR, **kwargs)
    harness.train_step(engine, *batch(model, 0))
    return engine


def depth_peak(run: Zero3Run, n_layer: int) -> DepthPeak:
    """The parameter sizes and peak of a Zero3Run of a GPT with n_layer blocks."""
    return DepthPeak(n_layer, run.full_param_bytes, run.shard_bytes,
                     run.step.memory.max_by_category["params"])


def zero3_run(prefetch: bool, config: GPTConfig = MODEL, timeline: bool = True
              ) -> tuple[Zero3Run, dict[str, torch.Tensor]]:
    """ZeRO-3 on this rank: warm-up, a tracked step, a timeline step (timeline=False: none,
    the tracked step's log stands in). Also the final weights."""
    model = GPT(config)
    full_param_bytes = 4 * num_params(model)  # before sharding: afterwards .data are empty
    engine = trained_one_step("zero3", model, prefetch=prefetch)
    tracked = harness.measured_step(engine, *batch(model, 1))
    # A bigger batch for the timeline, so that a block computes about as long as it gathers.
    # Spans per block, not one for the forward: they show where compute waits for a gather.
    x, y = batch(model, 2, per_rank=TIMELINE_BATCH_PER_RANK)
    timed = harness.measured_step(engine, x, y, memory=False, forward_spans=model.blocks
                                  ).log if timeline else tracked.log
    buckets = [b for u in engine.units for b in u.buckets]  # a flat bucket per unit, root last
    run = Zero3Run(tracked, timed,
                   unit_bytes={u.name: sum(4 * b.layout.padded_numel for b in u.buckets)
                               for u in engine.units},
                   shard_bytes=sum(4 * b.local_shard.numel() for b in buckets),
                   padded_numel=sum(b.layout.padded_numel for b in buckets),
                   full_param_bytes=full_param_bytes)
    return run, engine.full_state_dict()


def zero2_log(config: GPTConfig = MODEL) -> CommLog:
    """ZeRO-2 on the same model and batches: the log of one recorded step (after a warm-up)."""
    model = GPT(config)
    engine = trained_one_step("zero2", model)
    return harness.measured_step(engine, *batch(model, 1), memory=False).log


def zero3_lesson(config: GPTConfig = MODEL) -> Zero3Lesson:
    """Everything notebook 05 measures, on this rank (see the module docstring)."""
    with_prefetch, weights_on = zero3_run(True, config)
    without, weights_off = zero3_run(False, config)
    depths = [depth_peak(zero3_run(True, dataclasses.replace(config, n_layer=n), False)[0], n)
              for n in DEPTHS] + [depth_peak(with_prefetch, config.n_layer)]
    return Zero3Lesson(num_params=num_params(GPT(config)), prefetch=with_prefetch,
                       no_prefetch=without, zero2_log=zero2_log(config),
                       same_weights=harness.max_diff(weights_on, weights_off) == 0.0,
                       depths=sorted(depths, key=lambda d: d.n_layer),
                       cpu_cores=os.cpu_count() or 1, compute_threads=torch.get_num_threads())


def gathers_by_phase(log: CommLog) -> dict[str, list[str]]:
    """The units all-gathered in each phase, in issue order: {"fwd": [...], "bwd": [...]}."""
    out: dict[str, list[str]] = {}
    for e in log.events:
        if e.op == "all_gather":
            _, phase, unit = e.tag.split("/", 2)  # "zero3/fwd/blocks.2"
            out.setdefault(phase, []).append(unit)
    return out


def issued_ahead(log: CommLog) -> int:
    """All-gathers issued asynchronously, one unit ahead of the unit that needs them.

    Without prefetch every gather is issued when its unit starts and waited for at once: 0.
    With prefetch, the next unit's gather is issued when the current unit starts, and runs
    while the current unit computes.
    """
    return sum(1 for e in log.events if e.op == "all_gather" and e.async_op)


def forward_window(log: CommLog) -> CommLog:
    """A copy of `log` with the forward only: its all-gathers and its "forward" spans."""
    return dataclasses.replace(
        log, events=[e for e in log.events if "/fwd/" in e.tag],
        spans=[s for s in log.spans if s.name == "forward"])


def bytes_by_phase(log: CommLog) -> dict[str, int]:
    """Bytes this rank sent, by phase and op: {"fwd all_gather": .., "bwd reduce_scatter": ..}.

    The phase is the middle part of the tag ("zero3/bwd/blocks.2" -> "bwd"): zerolab tags every
    collective with the stage, the phase and the unit or bucket.
    """
    out: dict[str, int] = {}
    for e in log.events:
        key = f"{e.tag.split('/')[1]} {e.op}"
        out[key] = out.get(key, 0) + e.ring_bytes
    return out


def overlapped_gathers(log: CommLog) -> int:
    """Forward all-gathers of blocks.k that were in flight while blocks.k-1 computed.

    Needs a log from `measured_step(..., forward_spans=model.blocks)`: its "forward" spans are
    the blocks' compute, in order. Counts k >= 1 where the gather of blocks.k was issued before
    block k-1 began computing and completed after it ended. With prefetch: every block but the
    first; without: none (each gather is issued only when its own block is about to run).
    """
    gathers = {e.tag.rsplit("/", 1)[-1]: e for e in log.events
               if e.op == "all_gather" and "/fwd/blocks." in e.tag}
    blocks = [s for s in log.spans if s.name == "forward"]
    return sum(1 for k in range(1, len(blocks))
               if (g := gathers.get(f"blocks.{k}")) is not None and g.end is not None
               and g.start <= blocks[k - 1].start and g.end >= blocks[k - 1].end)


def block_compute_ms(log: CommLog) -> float:
    """The median time one block took to compute in forward, in ms (from the per-block
    "forward" spans of `measured_step(..., forward_spans=model.blocks)`)."""
    return 1e3 * statistics.median(s.end - s.start for s in log.spans if s.name == "forward")


@dataclass
class ComputeBeside:
    """How long a block took to compute in forward, alone (prefetch off) and with the next
    block's gather in flight beside it (prefetch on), over every rank's blocks."""

    alone_ms: list[float]  # per block and rank, prefetch off
    beside_ms: list[float]  # per block and rank, prefetch on
    slower_share: float  # of all (beside, alone) pairs, the share where beside took longer
    verdict: str  # "slower beside a gather", "faster beside a gather" or "within noise"


def compute_beside_gathers(off: Sequence[CommLog], on: Sequence[CommLog],
                           decisive: float = 0.9) -> ComputeBeside:
    """Compare the per-block forward times of two timeline runs (`measured_step(...,
    forward_spans=model.blocks)` logs, one per rank) pair by pair, instead of two medians.

    A verdict needs `decisive` of all pairs on one side (a probability of superiority of 0.9:
    a large effect); anything less is "within noise", as two shared CPU cores often are.
    """
    def times(logs: Sequence[CommLog]) -> list[float]:
        return [1e3 * (s.end - s.start) for log in logs for s in log.spans if s.name == "forward"]

    alone, beside = times(off), times(on)
    pairs = [(b > a) + 0.5 * (b == a) for b in beside for a in alone]
    share = sum(pairs) / len(pairs)
    verdict = ("slower beside a gather" if share >= decisive else
               "faster beside a gather" if share <= 1 - decisive else "within noise")
    return ComputeBeside(alone, beside, share, verdict)
