"""Notebook 01: where the memory of data-parallel training goes, measured on every rank.

`ddp_memory` runs on each rank of `zerolab.launch(ddp_memory, world_size=N, args=(...))`.
It trains zerolab's tiny GPT with zerolab.DDP and AdamW and returns what the rank holds,
measured from the live tensors (zerolab.memory), never computed from a formula.
"""

from __future__ import annotations

import torch

import zerolab
from zerolab import models


def _traced_step(engine: zerolab.DDP, model: models.GPT, x: torch.Tensor, y: torch.Tensor
                 ) -> zerolab.MemoryTrace:
    """One forward + backward + step, with every live tensor followed by category.

    x, y: (batch, 16) token ids. The trace's samples are (seconds, {"params", "grads",
    "optimizer", "other"} bytes); "other" is whatever is alive and not a model state.
    """
    with zerolab.track_memory(engine.state_tensors) as trace:
        loss = model.loss(engine(x), y)
        loss.backward()
        engine.step()
    return trace


def ddp_memory(batch_sizes: tuple[int, ...] = (4, 8, 16), lr: float = 1e-3) -> dict:
    """DDP's memory on this rank: model states in fp32 and in bf16 mixed precision, and
    activations at several batch sizes.

    Every rank trains the same GPT (zerolab.models.GPT(), Ψ = 28,032 parameters, tied
    embedding) on its own batch of `batch_sizes[0]` sequences of 16 tokens. Each rank draws a
    different batch (seed = rank), as in real data parallelism.

    Returns, for this rank:
      psi            Ψ, the number of parameters (a tied weight counted once)
      param_tensors  how many parameter tensors (Adam keeps a 4-byte step counter for each)
      fp32           model_state_bytes() after the first step: {"params", "grads", "optimizer"}
      mixed          the same for a bf16 model (fp32 master weights inside the optimizer)
      trace          MemoryTrace of that first fp32 step (samples by category, over time)
      peaks          {batch size: the trace's breakdown at the peak of a later step}; "other"
                     is everything that is not a model state: activations and temporaries
      state          full_state_dict() after the step (CPU tensors), to compare across ranks
      grads          the averaged flat gradient after the step (CPU), to compare across ranks
    """
    ctx = zerolab.init_from_env()
    model = models.GPT().to(ctx.device)
    engine = zerolab.DDP(model, torch.optim.AdamW, lr=lr)
    x, y = (t.to(ctx.device) for t in model.make_batch(batch_sizes[0], seed=ctx.rank))
    trace = _traced_step(engine, model, x, y)  # the first step: Adam creates its state here
    fp32 = engine.model_state_bytes()  # after step(), before zero_grad(): grads still held
    grads = torch.cat([b.flat_grad for b in engine.buckets]).cpu()
    state = {k: v.cpu() for k, v in engine.full_state_dict().items()}
    engine.zero_grad()

    peaks = {}
    for i, batch in enumerate(batch_sizes):  # later steps: the state exists before forward
        xb, yb = (t.to(ctx.device) for t in model.make_batch(batch, seed=100 * (i + 1) + ctx.rank))
        peaks[batch] = _traced_step(engine, model, xb, yb).peak_by_category
        engine.zero_grad()

    # Mixed precision: bf16 parameters and gradients; the optimizer steps fp32 master copies.
    model16 = models.GPT().to(ctx.device)
    engine16 = zerolab.DDP(model16, torch.optim.AdamW, param_dtype=torch.bfloat16, lr=lr)
    model16.loss(engine16(x), y).backward()
    engine16.step()
    mixed = engine16.model_state_bytes()

    return {
        "psi": models.num_params(model),
        "param_tensors": len(list(model.parameters())),
        "fp32": fp32,
        "mixed": mixed,
        "trace": trace,
        "peaks": peaks,
        "state": state,
        "grads": grads,
    }


def bytes_table(rows: list[tuple[str, dict[str, int]]]) -> str:
    """A text table of model-state bytes: one row per (name, {"params", "grads", "optimizer"}),
    with the total, thousands separated. For printing in the notebook."""
    columns = ("params", "grads", "optimizer")
    lines = [f"{'bytes':<9}" + "".join(f"{c:>12}" for c in (*columns, "total"))]
    for name, d in rows:
        lines.append(f"{name:<9}" + "".join(f"{d[c]:>12,}" for c in columns)
                     + f"{sum(d[c] for c in columns):>12,}")
    return "\n".join(lines)
