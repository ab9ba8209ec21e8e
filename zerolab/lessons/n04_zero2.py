"""Notebook 04, ZeRO-2: what the gradient hook buys, measured on every rank.

Three engines train the same small GPT on the same batches: ZeRO-1 (full gradients),
ZeRO2Naive (reduce-scatter after backward) and ZeRO2 (reduce-scatter each bucket during
backward, then free it). For each, one launch measures on every rank:

- the model-state bytes held after `step()` (at rest),
- live bytes by category over one whole training step (forward, backward, step) and the peak,
- every collective, with the forward / backward / step spans, on a clock aligned across ranks.

`zero2_lesson` returns plain data (dicts, `MemoryTrace`s, `CommLog`s); the notebook draws it
with `zerolab.plots`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import zerolab
from zerolab.comm import span
from zerolab.models import GPT, GPTConfig, num_params

# 4 blocks of hidden size 64: 205,184 parameters (0.82 MB in fp32), one block ≈ 0.2 MB.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)
BATCH_PER_RANK = 2  # sequences of MODEL.block_size tokens per rank per step
LR = 1e-3
# Small buckets so that this small model has several (a real run uses ~25-500 MB).
BUCKET_BYTES = 100_000

ENGINES: dict[str, type[zerolab.DDP]] = {
    "zero1": zerolab.ZeRO1,
    "zero2naive": zerolab.ZeRO2Naive,
    "zero2": zerolab.ZeRO2,
}


def local_batch(model: GPT, step: int, rank: int, world_size: int,
                per_rank: int = BATCH_PER_RANK) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch: ((per_rank, seq), (per_rank, seq)) tokens."""
    x, y = model.make_batch(per_rank * world_size, seed=100 + step)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def measured_step(engine: Any, model: GPT, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One training step under the memory tracker and the comm recorder.

    Returns {"trace": MemoryTrace, "log": CommLog, "phases": [(name, start_s, end_s)],
    "at_rest": model-state bytes after step()}. `phases` are on the trace's clock, seconds
    from its first sample, so that they can be drawn over `plots.memory_timeline`.
    """
    t_enter = time.perf_counter()
    with zerolab.track_memory(engine.state_tensors) as trace, zerolab.record_comm() as log:
        with span("forward"):
            loss = model.loss(engine(x), y)
        with span("backward"):
            loss.backward()
        with span("step"):
            engine.step()
    at_rest = engine.model_state_bytes()  # after step, before zero_grad: the design's rule
    engine.zero_grad()
    # The log's times are relative to log.t0 (a perf_counter value); the trace's to the moment
    # the tracker started (t_enter, to within microseconds). Put the spans on the trace's clock.
    first = trace.samples[0][0]
    shift = log.t0 - t_enter - first
    phases = [(s.name, s.start + shift, s.end + shift) for s in log.spans]
    return {"trace": trace, "log": log, "phases": phases, "at_rest": at_rest}


def engine_facts(engine: Any) -> dict[str, Any]:
    """Sizes the formulas need, read from the engine's layouts (bytes, fp32)."""
    return {
        "bucket_bytes": [4 * b.layout.padded_numel for b in engine.buckets],
        "bucket_names": [b.name for b in engine.buckets],
        "grad_shard_bytes": sum(4 * b.layout.shard_numel for b in engine.buckets),
        "padded_numel": sum(b.layout.padded_numel for b in engine.buckets),
    }


def zero2_lesson(strategies: tuple[str, ...] = ("zero1", "zero2naive", "zero2"),
                 bucket_bytes: int = BUCKET_BYTES, config: GPTConfig = MODEL) -> dict[str, Any]:
    """Run on every rank: for each strategy, a warm-up step then one measured step.

    The warm-up step creates Adam's state, so the measured step shows steady-state memory.
    Returns {"num_params": Ψ, "full_grad_bytes": 4Ψ, strategy: {"trace", "log", "phases",
    "at_rest", "peak", "peak_by_category", "max_by_category", "bucket_bytes", "bucket_names",
    "grad_shard_bytes", "padded_numel", "loss_after"}} where "loss_after" is the loss of a
    forward with the updated weights (the same for every strategy).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for name in strategies:
        model = GPT(config)
        engine = ENGINES[name](model, torch.optim.AdamW, lr=LR, bucket_bytes=bucket_bytes)
        x, y = local_batch(model, 0, rank, world_size)
        model.loss(engine(x), y).backward()
        engine.step()
        engine.zero_grad()
        x, y = local_batch(model, 1, rank, world_size)
        result = measured_step(engine, model, x, y)
        trace = result["trace"]
        with torch.no_grad():
            x, y = local_batch(model, 2, rank, world_size)
            loss_after = model.loss(engine(x), y).item()
        out[name] = {**result, **engine_facts(engine), "peak": trace.peak_bytes,
                     "peak_by_category": trace.peak_by_category,
                     "max_by_category": trace.max_by_category, "loss_after": loss_after}
        out["num_params"] = num_params(model)
    out["full_grad_bytes"] = 4 * out["num_params"]
    return out


def ops_by_phase(log: zerolab.CommLog) -> dict[str, dict[str, int]]:
    """How many collectives of each op were issued during each span of `log`.

    Returns {span name: {op: count}}, e.g. {"backward": {"reduce_scatter": 7}, "step": {...}}.
    """
    out: dict[str, dict[str, int]] = {s.name: {} for s in log.spans}
    for e in log.events:
        for s in log.spans:
            if s.start <= e.start <= s.end:
                out[s.name][e.op] = out[s.name].get(e.op, 0) + 1
                break
    return out
