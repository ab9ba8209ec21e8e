"""Notebook 03: ZeRO-1 against DDP, and the naive ZeRO-1 that all-reduces.

`compare_stages` runs on each rank of `zerolab.launch(compare_stages, world_size=4)`. To measure
at world sizes 1, 2 and 4 in one launch, it splits the 4 ranks into process groups of k
consecutive ranks (notebook 00): for k = 2 that is two independent 2-rank jobs, {0, 1} and
{2, 3}, training side by side. Each job sees the same global batch, cut into k slices, so every
job at every k should end with the same model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import models
from zerolab.comm import span

STAGES = {"DDP": zerolab.DDP, "ZeRO-1": zerolab.ZeRO1, "ZeRO-1 naive": zerolab.ZeRO1Naive}
GLOBAL_BATCH = 8  # sequences per step over the whole job; divides by 1, 2 and 4
STEPS = 3
LR = 1e-3


def train(stage: str, group: dist.ProcessGroup, device: torch.device, steps: int = STEPS
          ) -> dict:
    """Train the tiny GPT (Ψ = 28,032) for `steps` steps with one stage, in `group`.

    The ranks of a group start from different seeds, their rank in the group (the engine
    broadcasts group rank 0's weights, seed 0, so that every job starts from the same model).
    Each rank of the group takes its slice of the same global batch. The last step is
    recorded: its comm log (collectives and forward/backward/step spans) and the model-state
    bytes after step().

    Returns: "bytes" ({"params", "grads", "optimizer"} after the last step, before zero_grad),
    "log" (CommLog of the last step), "state" (full_state_dict() at the end, CPU),
    "layouts" ([(numel, padded_numel)] per bucket).
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    model = models.GPT(models.GPTConfig(seed=rank)).to(device)
    engine = STAGES[stage](model, torch.optim.AdamW, group=group, lr=LR)
    per_rank = GLOBAL_BATCH // n

    def one_step(step: int) -> None:
        x, y = model.make_batch(GLOBAL_BATCH, seed=step)  # (GLOBAL_BATCH, 16) tokens
        x, y = (t[rank * per_rank:(rank + 1) * per_rank].to(device) for t in (x, y))
        with span("forward"):
            loss = model.loss(engine(x), y)
        with span("backward"):
            loss.backward()
        with span("step"):
            engine.step()

    for step in range(steps - 1):
        one_step(step)
        engine.zero_grad()
    with zerolab.record_comm(group) as log:  # the last step, recorded
        one_step(steps - 1)
    state_bytes = engine.model_state_bytes()  # after step(), before zero_grad()
    engine.zero_grad()
    return {
        "bytes": state_bytes,
        "log": log,
        "state": {k: v.cpu() for k, v in engine.full_state_dict().items()},
        "layouts": [(b.layout.numel, b.layout.padded_numel) for b in engine.buckets],
    }


def compare_stages(sizes: tuple[int, ...] = (1, 2, 4)) -> dict:
    """DDP, ZeRO-1 and naive ZeRO-1 at each group size k in `sizes` (k divides the world size).

    Returns {k: {"group": the global ranks of this rank's group, "rank_in_group": .., stage:
    `train(stage, ...)`'s dict for each stage}} for this rank.
    """
    ctx = zerolab.init_from_env()
    out: dict = {}
    for k in sizes:
        # Group creation is collective: every rank creates every group of size k, in order.
        groups = [dist.new_group(list(range(s, s + k))) for s in range(0, ctx.world_size, k)]
        mine = groups[ctx.rank // k]
        out[k] = {"group": dist.get_process_group_ranks(mine),
                  "rank_in_group": dist.get_rank(mine)}
        for stage in STAGES:
            out[k][stage] = train(stage, mine, ctx.device)
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    return max((a[k] - b[k]).abs().max().item() for k in a)
