"""Notebook 01b (01b_memory): where the memory of data-parallel training goes, on every rank.

`ddp_memory` runs on each rank of `zerolab.launch(ddp_memory, world_size=N, args=(...))`.
It trains zerolab's tiny GPT with zerolab.DDP and AdamW and returns what the rank holds
(a `DDPMemory`), measured from the live tensors (zerolab.memory), never computed from a formula.
Each step is `harness.measured_step`: the same measured step as every other notebook's.
`ddp_memory_split` tracks the same steps with activations apart from temporaries;
`notebook_01b` runs both in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import zerolab
from zerolab import engines, harness, models
from zerolab.memory import MemoryTrace


@dataclass
class DDPMemory:
    """What one DDP rank holds, measured.

    Bytes come as dicts by category: {"params", "grads", "optimizer"} for model states, plus
    "other" in a trace or a peak: whatever is alive and not a model state (activations,
    temporaries).
    """

    psi: int  # Ψ, the number of parameters (a tied weight counted once)
    param_tensors: int  # how many parameter tensors (Adam keeps a 4-byte step counter for each)
    fp32: dict[str, int]  # model-state bytes after the first step(), before zero_grad()
    mixed: dict[str, int]  # the same for a bf16 model (fp32 master weights in the optimizer)
    trace: MemoryTrace  # live bytes by category over that first fp32 step
    peaks: dict[int, dict[str, int]]  # sequences per rank -> bytes at a later step's peak
    state: dict[str, torch.Tensor]  # full_state_dict() after the first step (CPU)
    grads: torch.Tensor  # (Ψ,) the averaged flat gradient after the first step (CPU)


def ddp_memory(batch_sizes: tuple[int, ...] = (4, 8, 16), lr: float = 1e-3) -> DDPMemory:
    """DDP's memory on this rank: model states in fp32 and in bf16 mixed precision, and
    activations at several batch sizes (sequences of 16 tokens per rank).

    Every rank trains the same GPT (zerolab.models.GPT(), Ψ = 28,032 parameters, tied
    embedding). Each step draws one global batch of batch_size x N sequences and gives each
    rank its own rows (harness.local_batch), so the ranks see different data, as in real data
    parallelism. The first step uses `batch_sizes[0]`.
    """
    ctx = zerolab.init_from_env()
    model = models.GPT().to(ctx.device)
    engine = engines.make_engine("ddp", model, lr=lr)  # zerolab.DDP with AdamW

    def batch(step: int, per_rank: int) -> tuple[torch.Tensor, ...]:
        # x, y: (per_rank, 16) token ids, this rank's rows of the step's global batch
        rows = harness.local_batch(model.make_batch, per_rank * ctx.world_size, seed=step,
                                   rank=ctx.rank, world_size=ctx.world_size)
        return tuple(t.to(ctx.device) for t in rows)

    x, y = batch(0, batch_sizes[0])
    # The first step: Adam creates its state here. Keep the gradients to read them after.
    first = harness.measured_step(engine, x, y, zero_grad=False)
    grads = torch.cat([b.flat_grad for b in engine.buckets]).cpu()
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    engine.zero_grad()

    peaks = {}
    for i, per_rank in enumerate(batch_sizes):  # later steps: the state exists before forward
        measured = harness.measured_step(engine, *batch(i + 1, per_rank))
        peaks[per_rank] = measured.memory.peak_by_category

    # Mixed precision: bf16 parameters and gradients; the optimizer steps fp32 master copies.
    model16 = models.GPT().to(ctx.device)
    engine16 = engines.make_engine("ddp", model16, param_dtype=torch.bfloat16, lr=lr)
    mixed = harness.measured_step(engine16, x, y, memory=False).held

    return DDPMemory(psi=models.num_params(model), param_tensors=len(list(model.parameters())),
                     fp32=first.held, mixed=mixed, trace=first.memory, peaks=peaks,
                     state=state, grads=grads)


def bytes_table(rows: list[tuple[str, dict[str, int]]]) -> str:
    """A text table of model-state bytes: one row per (name, {"params", "grads", "optimizer"}),
    with the total, thousands separated. For printing in the notebook."""
    columns = ("params", "grads", "optimizer")
    lines = [f"{'bytes':<9}" + "".join(f"{c:>12}" for c in (*columns, "total"))]
    for name, d in rows:
        lines.append(f"{name:<9}" + "".join(f"{d[c]:>12,}" for c in columns)
                     + f"{sum(d[c] for c in columns):>12,}")
    return "\n".join(lines)


@dataclass
class MemorySplit:
    """DDP's live bytes with activations apart: {"params", "grads", "optimizer",
    "activations" (what autograd saved for backward), "other" (temporaries)}."""

    trace: MemoryTrace  # over the first step (batch_sizes[0] sequences per rank)
    peaks: dict[int, dict[str, int]]  # sequences per rank -> bytes at a later step's peak


def ddp_memory_split(batch_sizes: tuple[int, ...] = (4, 8, 16)) -> MemorySplit:
    """ddp_memory's fp32 steps (same model, same batches), tracked with
    activations=True, so that "other" splits into activations and temporaries."""
    ctx = zerolab.init_from_env()
    model = models.GPT().to(ctx.device)
    engine = engines.make_engine("ddp", model)

    def tracked_step(step: int, per_rank: int) -> MemoryTrace:
        x, y = (t.to(ctx.device) for t in harness.local_batch(
            model.make_batch, per_rank * ctx.world_size, seed=step, rank=ctx.rank,
            world_size=ctx.world_size))
        with zerolab.track_memory(engine.state_tensors, activations=True) as trace:
            harness.train_step(engine, x, y)
        return trace

    first = tracked_step(0, batch_sizes[0])
    peaks = {b: tracked_step(i + 1, b).peak_by_category for i, b in enumerate(batch_sizes)}
    return MemorySplit(first, peaks)


def notebook_01b() -> tuple[DDPMemory, MemorySplit]:
    """Everything notebook 01b measures on ranks, in one launch: `ddp_memory()` and
    `ddp_memory_split()` with their default arguments."""
    return ddp_memory(), ddp_memory_split()
