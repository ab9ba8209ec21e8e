"""Notebook 04, ZeRO-2: what the gradient hook buys, measured on every rank.

Three engines train the same small GPT on the same batches: ZeRO-1 (full gradients),
ZeRO2AfterBackward (reduce-scatter after backward) and ZeRO2 (reduce-scatter each bucket during
backward, then free it). For each, one launch measures on every rank, with
`harness.measured_step`:

- the model-state bytes held after `step()` (at rest),
- live bytes by category over one whole training step (forward, backward, step) and the peak,
- every collective, with the forward / backward / step spans, on a clock aligned across ranks,
  and the bytes each one measurably wrote (`wire_bytes`) beside the ring model's.

Two smaller measurements ride in the same launch: ZeRO-2 over two micro-batches against one
batch (`accumulation`), and two consecutive ZeRO-2 steps recorded in one log, with the
parameter all-gathers waited for in step() (prefetch=False) or in the next forward
(prefetch=True, opted into) (`two_steps`).

`zero2_lesson` returns a `Zero2Lesson` (the measured steps, `MemoryTrace`s and `CommLog`s
inside); the notebook draws it with `zerolab.plots`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerolab import comm, engines, harness
from zerolab.comm import CommLog
from zerolab.harness import MeasuredStep
from zerolab.models import GPT, GPTConfig, num_params

# 4 blocks of hidden size 64: 205,184 parameters (0.82 MB in fp32), one block ≈ 0.2 MB.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)
BATCH_PER_RANK = 2  # sequences of MODEL.block_size tokens per rank per step
LR = 1e-3
# Small buckets so that this small model has several (a real run uses ~25-500 MB).
BUCKET_BYTES = 100_000
COMPARED = ("zero1", "zero2_after_backward", "zero2")  # engine keys, in the notebook's order


@dataclass
class Zero2Run:
    """One engine's measured step on one rank, and the sizes its formulas need (fp32 bytes)."""

    step: MeasuredStep  # .held (at rest), .memory (live bytes over the step), .log, .phases()
    bucket_bytes: list[int]  # each bucket's full (padded) size, in order (≈ backward's)
    grad_shard_bytes: int  # this rank's gradient shards, all buckets together
    padded_numel: int  # elements in all buckets, padding included: the Ψ the formulas see
    loss_after: float  # a forward with the updated weights: the same for every engine
    param_bytes: list[list[int]]  # each bucket's parameters' fp32 sizes, in bucket order


@dataclass
class Accumulation:
    """ZeRO-2's gradient shards after one batch, and after its halves as two micro-batches."""

    reduce_scatters: list[int]  # issued in backward: [one batch, two micro-batches]
    max_diff: float  # largest |grad_shard (one batch) - grad_shard (two micro-batches)|


@dataclass
class Zero2Lesson:
    """Everything notebook 04 measures, on one rank."""

    num_params: int  # Ψ
    full_grad_bytes: int  # 4Ψ: one full fp32 gradient
    runs: dict[str, Zero2Run]  # by engine name: "zero1", "zero2_after_backward", "zero2"
    accumulation: Accumulation
    two_steps: dict[bool, CommLog]  # by prefetch: two consecutive ZeRO-2 steps in one log


def batch(model: GPT, step: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows of step `step`'s global batch: (BATCH_PER_RANK, seq) tokens, twice.

    The same global batch on every rank (seed 100 + step) and for every engine.
    """
    world_size = dist.get_world_size()
    return harness.local_batch(model.make_batch, BATCH_PER_RANK * world_size, 100 + step,
                               dist.get_rank(), world_size)


def warm_up(engine: Any, model: GPT) -> None:
    """One untracked step: it creates Adam's state, so that a measured step is steady-state."""
    harness.train_step(engine, *batch(model, 0))


def zero2_run(name: str, bucket_bytes: int = BUCKET_BYTES, config: GPTConfig = MODEL
              ) -> Zero2Run:
    """Run on every rank: engine `name` on a fresh GPT, a warm-up step, then one measured step."""
    model = GPT(config)
    engine = engines.make_engine(name, model, torch.optim.AdamW, lr=LR, bucket_bytes=bucket_bytes)
    warm_up(engine, model)
    measured = harness.measured_step(engine, *batch(model, 1))
    with torch.no_grad():
        x, y = batch(model, 2)
        loss_after = model.loss(engine(x), y).item()
    return Zero2Run(measured, bucket_bytes=[4 * b.layout.padded_numel for b in engine.buckets],
                    grad_shard_bytes=sum(4 * b.layout.shard_numel for b in engine.buckets),
                    padded_numel=sum(b.layout.padded_numel for b in engine.buckets),
                    loss_after=loss_after,
                    param_bytes=[[4 * p.numel() for p in b.params] for b in engine.buckets])


def accumulation(bucket_bytes: int = BUCKET_BYTES, config: GPTConfig = MODEL) -> Accumulation:
    """Run on every rank: ZeRO-2's grad_shard after a step over step 1's batch, and after a
    step over its two halves as micro-batches (each loss halved: the mean), each backward
    reducing its own gradients."""
    shards, counts = [], []
    for micro_batches in (1, 2):
        model = GPT(config)
        engine = engines.make_engine("zero2", model, torch.optim.AdamW, lr=LR,
                                     bucket_bytes=bucket_bytes)
        x, y = batch(model, 1)  # (BATCH_PER_RANK, seq) each
        with comm.record_comm(engine.group) as log:
            # Every backward reduces its own gradients (no no_sync); step() reads grad_shard
            # but does not change it.
            harness.train_step(engine, x, y, micro_batches=micro_batches, no_sync=False,
                               zero_grad=False)
            engine.wait_params()  # the step's all-gathers end inside the log
        shards.append(torch.cat([b.grad_shard for b in engine.buckets]))
        counts.append(sum(e.op == "reduce_scatter" for e in log.events))
    return Accumulation(counts, (shards[0] - shards[1]).abs().max().item())


def two_steps(prefetch: bool, bucket_bytes: int = BUCKET_BYTES, config: GPTConfig = MODEL
              ) -> CommLog:
    """Run on every rank: ZeRO-2 (after a warm-up), steps 1 and 2 recorded in one log, so that
    the all-gathers issued at the end of step 1 can finish inside step 2's forward."""
    model = GPT(config)
    engine = engines.make_engine("zero2", model, torch.optim.AdamW, lr=LR,
                                 bucket_bytes=bucket_bytes, prefetch=prefetch)
    warm_up(engine, model)
    engine.wait_params()
    with comm.record_comm(engine.group) as log:
        for step in (1, 2):
            harness.train_step(engine, *batch(model, step))
        engine.wait_params()
    return log


def zero2_lesson(engines: tuple[str, ...] = COMPARED, bucket_bytes: int = BUCKET_BYTES,
                 config: GPTConfig = MODEL) -> Zero2Lesson:
    """Run on every rank: `zero2_run` for each engine, one after the other."""
    psi = num_params(GPT(config))
    return Zero2Lesson(num_params=psi, full_grad_bytes=4 * psi,
                       runs={name: zero2_run(name, bucket_bytes, config) for name in engines},
                       accumulation=accumulation(bucket_bytes, config),
                       two_steps={p: two_steps(p, bucket_bytes, config) for p in (False, True)})


def ops_by_phase(log: CommLog) -> dict[str, dict[str, int]]:
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


def gathers_finished_in(log: CommLog, span_name: str) -> int:
    """The step-1 parameter all-gathers (the first half of the log's) that completed inside a
    `span_name` span of `log` ("step": waited for in step(); "forward": in the next forward)."""
    gathers = [e for e in log.events if e.op == "all_gather"]
    first_step = gathers[:len(gathers) // 2]
    return sum(1 for e in first_step if e.end is not None and any(
        s.name == span_name and s.start <= e.end <= s.end for s in log.spans))
