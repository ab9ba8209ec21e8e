"""Notebook 03: ZeRO-1 against DDP, ZeRO-1 by all-reduce (ZeRO1AllReduce), ZeRO-1's schedule and
ZeRO-1 against ZeRO-2 under gradient accumulation.

`zero1_lesson` runs on each rank of `zerolab.launch(zero1_lesson, world_size=4)`: it runs
`compare_stages`, `overlap` and `accumulation`, sharing one launch. To measure at world sizes
1, 2 and 4, `compare_stages` splits the 4 ranks into process groups of k consecutive ranks
(notebook 00): for k = 2 that is two independent 2-rank jobs, {0, 1} and {2, 3}, training side
by side. Each job sees the same global batch, cut into k slices, so every job at every k should
end with the same model. `overlap` (ZeRO1AfterBackward, collectives after backward, against
ZeRO1's overlapped ones) and `accumulation` (ZeRO-1 against ZeRO-2 over 4 micro-batches) run
on all 4 ranks.

Engines are named as in `zerolab.engines.ENGINES` ("ddp", "zero1", "zero1_all_reduce"; engines.label
gives "DDP", "ZeRO-1", "ZeRO-1 by all-reduce"), and each step is the harness's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerolab
from zerolab import engines, harness, models
from zerolab.comm import CommLog

COMPARED = ("ddp", "zero1", "zero1_all_reduce")  # the engines compared, by their harness names
GLOBAL_BATCH = 8  # sequences per step over the whole job; divides by 1, 2 and 4
STEPS = 2  # one plain step (Adam state is born), then the measured one
LR = 1e-3
SMALL_BUCKETS = 32 * 1024  # bucket_bytes for `overlap` and `accumulation`: 4 buckets, not 1
SCHEDULES = ("zero1_after_backward", "zero1")  # collectives after backward, then overlapped
MICRO_BATCHES = 4
ACCUMULATION = (("zero1", True), ("zero2", True), ("zero2", False))  # (engine, use no_sync)


@dataclass
class StageRun:
    """One engine's run on one rank of a job: what `train` returns."""

    group: list[int]  # the global ranks of the job it ran in: k consecutive ranks
    held: dict[str, int]  # {"params", "grads", "optimizer"} bytes after the last step()
    log: CommLog  # the last step's collectives and its forward / backward / step spans
    state: dict[str, torch.Tensor]  # full_state_dict() at the end (CPU)
    layouts: list[tuple[int, int]]  # (numel, padded_numel) per bucket


def train(engine_name: str, group: dist.ProcessGroup, device: torch.device, steps: int = STEPS
          ) -> StageRun:
    """Train the tiny GPT (Ψ = 28,032) for `steps` steps with one engine, in `group`.

    The ranks of a group start from different seeds, their rank in the group (the engine
    broadcasts group rank 0's weights, seed 0, so that every job starts from the same model).
    Each rank of the group takes its slice of the same global batch (harness.local_batch). The
    last step is measured (harness.measured_step): its comm log and the model-state bytes
    after step().
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    model = models.GPT(models.GPTConfig(seed=rank)).to(device)
    engine = engines.make_engine(engine_name, model, group=group, lr=LR)

    def batch(step: int) -> list[torch.Tensor]:
        # x, y: (GLOBAL_BATCH / n, 16) tokens, this rank's rows of the step's global batch
        rows = harness.local_batch(model.make_batch, GLOBAL_BATCH, seed=step, rank=rank,
                                   world_size=n)
        return [t.to(device) for t in rows]

    for step in range(steps - 1):
        harness.train_step(engine, *batch(step))
    last = harness.measured_step(engine, *batch(steps - 1), memory=False)
    return StageRun(group=dist.get_process_group_ranks(group), held=last.held, log=last.log,
                    state={k: v.cpu() for k, v in engine.full_state_dict().items()},
                    layouts=[(b.layout.numel, b.layout.padded_numel) for b in engine.buckets])


def compare_stages(sizes: tuple[int, ...] = (1, 2, 4)) -> dict[int, dict[str, StageRun]]:
    """DDP, ZeRO-1 and ZeRO-1 by all-reduce at each group size k in `sizes` (k divides the world
    size).

    Returns {k: {engine name: this rank's `train` run in its job of k ranks}}.
    """
    ctx = zerolab.init_from_env()
    out = {}
    for k in sizes:
        # Group creation is collective: every rank creates every group of size k, in order.
        groups = [dist.new_group(list(range(s, s + k))) for s in range(0, ctx.world_size, k)]
        mine = groups[ctx.rank // k]
        out[k] = {name: train(name, mine, ctx.device) for name in COMPARED}
    return out


def _model_and_batches(group: dist.ProcessGroup | None, device: torch.device, seeds: range
                       ) -> tuple[models.GPT, list[list[torch.Tensor]]]:
    """The tiny GPT and this rank's rows of one global batch per seed."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    model = models.GPT(models.GPTConfig(seed=rank)).to(device)
    batches = [[t.to(device) for t in harness.local_batch(model.make_batch, GLOBAL_BATCH,
                                                          seed=s, rank=rank, world_size=n)]
               for s in seeds]
    return model, batches


@dataclass
class ScheduleRun:
    """Two consecutive steps of one ZeRO-1 schedule, recorded in one log (after a warm-up)."""

    engine: str  # "zero1_after_backward" or "zero1" (gather overlapping the next forward)
    log: CommLog  # both steps: spans forward, backward, step, twice; every collective
    buckets: int  # buckets (4 with SMALL_BUCKETS): one reduce-scatter and one gather each


def overlap(engine_name: str, group: dist.ProcessGroup | None, device: torch.device
            ) -> ScheduleRun:
    """One warm-up step, then two steps in one log: with "zero1", the gathers issued at the end
    of the first step() are waited for inside the second forward, so both steps are needed."""
    model, batches = _model_and_batches(group, device, range(3))
    overlapped = {"prefetch": True} if engine_name == "zero1" else {}  # opted into
    engine = engines.make_engine(engine_name, model, group=group, lr=LR,
                                 bucket_bytes=SMALL_BUCKETS, **overlapped)
    harness.train_step(engine, *batches[0])
    engine.wait_params()
    with zerolab.record_comm(group) as log:
        for x, y in batches[1:]:
            harness.train_step(engine, x, y)
        engine.wait_params()  # the last step's gathers: every byte of both steps in the log
    return ScheduleRun(engine_name, log, len(engine.buckets))


@dataclass
class AccumulationRun:
    """One optimizer step over MICRO_BATCHES micro-batches, measured on one rank."""

    engine: str  # "zero1" or "zero2"
    no_sync: bool  # True: reduce once, after the last micro-batch; False: after every one
    log: CommLog  # every collective of the step (4 forwards and backwards, then step())
    peak_grads: int  # the most bytes of gradients alive at once (track_memory's "grads")
    held: dict[str, int]  # model-state bytes after step()
    state: dict[str, torch.Tensor]  # full_state_dict() after the step (CPU)


def accumulation(engine_name: str, no_sync: bool, group: dist.ProcessGroup | None,
                 device: torch.device) -> AccumulationRun:
    """MICRO_BATCHES micro-batches (each a global batch of GLOBAL_BATCH) and one step, under
    the comm recorder and the memory tracker."""
    model, micro = _model_and_batches(group, device, range(100, 100 + MICRO_BATCHES))
    engine = engines.make_engine(engine_name, model, group=group, lr=LR,
                                 bucket_bytes=SMALL_BUCKETS)
    x, y = (torch.cat(parts) for parts in zip(*micro))  # harness.train_step cuts them again
    with zerolab.record_comm(group) as log, zerolab.track_memory(engine.state_tensors) as mem:
        harness.train_step(engine, x, y, micro_batches=len(micro), no_sync=no_sync,
                           zero_grad=False)
        engine.wait_params()
    held = engine.model_state_bytes()
    return AccumulationRun(engine_name, no_sync, log, mem.max_by_category.get("grads", 0), held,
                           {k: v.cpu() for k, v in engine.full_state_dict().items()})


@dataclass
class Zero1Lesson:
    """Everything notebook 03 measures, on one rank of a 4-rank launch."""

    stages: dict[int, dict[str, StageRun]]  # compare_stages()
    schedules: dict[str, ScheduleRun]  # {engine name: overlap(...)} on all 4 ranks
    accumulation: list[AccumulationRun]  # one per ACCUMULATION entry, on all 4 ranks


def zero1_lesson() -> Zero1Lesson:
    """compare_stages, then both ZeRO-1 schedules and the accumulation runs on every rank."""
    stages = compare_stages()
    device = zerolab.init_from_env().device
    return Zero1Lesson(stages, {name: overlap(name, None, device) for name in SCHEDULES},
                       [accumulation(name, quiet, None, device) for name, quiet in ACCUMULATION])
