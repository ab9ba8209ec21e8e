"""Notebook 03: ZeRO-1 against DDP, and the naive ZeRO-1 that all-reduces.

`compare_stages` runs on each rank of `zerolab.launch(compare_stages, world_size=4)`. To measure
at world sizes 1, 2 and 4 in one launch, it splits the 4 ranks into process groups of k
consecutive ranks (notebook 00): for k = 2 that is two independent 2-rank jobs, {0, 1} and
{2, 3}, training side by side. Each job sees the same global batch, cut into k slices, so every
job at every k should end with the same model.

Engines are named as in `zerolab.harness.ENGINES` ("ddp", "zero1", "zero1naive"; harness.label
gives "DDP", "ZeRO-1", "ZeRO-1 naive"), and each step is the harness's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerolab
from zerolab import harness, models
from zerolab.comm import CommLog

COMPARED = ("ddp", "zero1", "zero1naive")  # the engines compared, by their harness names
GLOBAL_BATCH = 8  # sequences per step over the whole job; divides by 1, 2 and 4
STEPS = 3
LR = 1e-3


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
    engine = harness.make_engine(engine_name, model, group=group, lr=LR)

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
    """DDP, ZeRO-1 and naive ZeRO-1 at each group size k in `sizes` (k divides the world size).

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
