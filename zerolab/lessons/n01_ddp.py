"""Notebook 01 (01_ddp): how DDP works, from one gradient to buckets overlapping backward.

Two helpers run in the notebook's own kernel (no ranks needed):

- `hook_order`: register a post-accumulate-grad hook on every parameter and record the order
  in which their gradients are complete during one backward (the reverse of forward);
- `flat_grad_views`: one flat buffer, and every parameter's .grad a view into it: what DDP does
  so that a bucket can be all-reduced without a copy.

One worker runs on the ranks, `ddp_lesson` (`zerolab.launch(ddp_lesson, world_size=2)`): it
trains a larger GPT with zerolab.DDP at several bucket sizes (how many all-reduces, how long a
step), then compares zerolab.DDP with `DDPAfterBackward`, a DDP that reduces every bucket only
once backward is over (timelines, and how much communication is left after backward).
(`MemorySplit` and `ddp_memory_split`, notebook 01b's, live in n01_memory; imported here too.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

import zerolab
from zerolab import engines, harness, models
from zerolab.comm import CommLog
from zerolab.ddp import DDPAfterBackward
from zerolab.lessons.n01_memory import DDPMemory, MemorySplit, ddp_memory, ddp_memory_split

# Big enough that buckets matter: Ψ = 834,304 parameters in 52 tensors, 3.2 MiB of fp32 grads.
SWEEP_CONFIG = models.GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)
SWEEP_BUCKETS = (1, 1 << 20, 1 << 40)  # a bucket per parameter, ~1 MiB, everything in one


def hook_order(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """The names of model's parameters in the order their gradients become complete during
    one backward of model.loss(model(x), y). The hooks are removed afterwards."""
    order: list[str] = []
    handles = [p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
               for name, p in model.named_parameters()]
    model.loss(model(x), y).backward()
    for h in handles:
        h.remove()
    return order


def flat_grad_views(params: list[nn.Parameter]) -> torch.Tensor:
    """One zeroed flat buffer for the gradients of `params`; each p.grad becomes a view into
    it, so that backward, which adds into an existing .grad in place, fills the buffer."""
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


@dataclass
class BucketRun:
    """zerolab.DDP at one bucket size, on one rank."""

    bucket_bytes: int  # the engine's bucket_bytes
    bucket_numels: list[int]  # parameters (elements) per bucket, in the order backward fills them
    all_reduces: int  # all-reduces issued in one step
    step_seconds: list[float]  # forward + backward + step, each timed step (vary by machine)
    log: CommLog  # the last step's collectives and spans


@dataclass
class DDPLesson:
    """One rank's measurements of `ddp_lesson`."""

    psi: int  # parameters of the model (SWEEP_CONFIG)
    grad_bytes: int  # its fp32 gradient bytes, 4Ψ
    sweep: list[BucketRun]  # one per bucket size
    overlapped: list[CommLog]  # zerolab.DDP (1 MiB buckets): each timed step's log
    after: list[CommLog]  # DDPAfterBackward: the same steps
    params_equal: bool  # both engines' parameters bitwise equal after their step


def exposed_seconds(logs: list[CommLog]) -> float:
    """Communication left after backward, for the ranks' logs of one step (their clocks are
    lined up): from the end of the last rank's backward to the end of the last collective, 0
    if every collective was done by then. (Measured from the last rank: an earlier rank's wait
    for a slower one is a straggler's cost, not communication.)"""
    backward_end = max(s.end for log in logs for s in log.spans if s.name == "backward")
    last = max((e.end for log in logs for e in log.events if e.end is not None),
               default=backward_end)
    return max(0.0, last - backward_end)


def issued_during_backward(log: CommLog) -> int:
    """How many of this rank's collectives were issued before its backward ended."""
    backward_end = max(s.end for s in log.spans if s.name == "backward")
    return sum(e.start < backward_end for e in log.events)


def ddp_lesson(bucket_sizes: tuple[int, ...] = SWEEP_BUCKETS, steps: int = 2,
               per_rank: int = 2) -> DDPLesson:
    """On each rank: zerolab.DDP (AdamW) on a GPT(SWEEP_CONFIG), `steps` timed steps at each
    bucket size, then `steps` of zerolab.DDP against DDPAfterBackward on the same batches.
    Each rank trains on its own `per_rank` sequences of the step's global batch."""
    ctx = zerolab.init_from_env()

    def batch(seed: int) -> tuple[torch.Tensor, ...]:  # x, y: (per_rank, 64) token ids
        rows = harness.local_batch(models.GPT(SWEEP_CONFIG).make_batch, per_rank * ctx.world_size,
                                   seed=seed, rank=ctx.rank, world_size=ctx.world_size)
        return tuple(t.to(ctx.device) for t in rows)

    sweep = []
    for bucket_bytes in bucket_sizes:
        engine = engines.make_engine("ddp", models.GPT(SWEEP_CONFIG).to(ctx.device),
                                     bucket_bytes=bucket_bytes)
        seconds = []
        for step in range(steps + 1):  # the first step is a warm-up (Adam creates its state)
            t0 = time.perf_counter()
            measured = harness.measured_step(engine, *batch(step), memory=False)
            seconds.append(time.perf_counter() - t0)
        sweep.append(BucketRun(bucket_bytes, [b.layout.numel for b in engine.buckets],
                               len(measured.log.events), seconds[1:], measured.log))

    logs, states = [], []
    for name in ("ddp", "after"):
        model = models.GPT(SWEEP_CONFIG).to(ctx.device)
        engine = (DDPAfterBackward(model, torch.optim.AdamW) if name == "after"
                  else engines.make_engine("ddp", model))
        logs.append([harness.measured_step(engine, *batch(step), memory=False).log
                     for step in range(steps + 1)][1:])  # after a warm-up step
        states.append(engine.full_state_dict())
    model = models.GPT(SWEEP_CONFIG)
    return DDPLesson(psi=models.num_params(model), grad_bytes=4 * models.num_params(model),
                     sweep=sweep, overlapped=logs[0], after=logs[1],
                     params_equal=harness.max_diff(*states) == 0.0)


def notebook_01() -> tuple[DDPLesson, DDPMemory, MemorySplit]:
    """What notebooks 01 and 01b measure on ranks, in one launch: `ddp_lesson()`,
    `n01_memory.ddp_memory()` and `n01_memory.ddp_memory_split()` with their default
    arguments. (The notebooks launch `ddp_lesson` and `n01_memory.notebook_01b` apart.)"""
    return ddp_lesson(), ddp_memory(), ddp_memory_split()
