"""Notebook 05, ZeRO-3: parameters gathered one unit at a time, measured on every rank.

`zero3_lesson` runs on every rank and, in one launch:

- trains a small GPT with ZeRO-3, prefetch on and then off; for each, one step under the memory
  tracker (live bytes by category: the parameter sawtooth) and one step with the comm recorder
  only (a timeline not slowed down by the tracker);
- trains the same model with ZeRO-2 for one step, to compare the bytes sent: 3Ψ against 2Ψ.

It returns plain data (dicts, `MemoryTrace`s, `CommLog`s); the notebook draws it with
`zerolab.plots`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

import zerolab
from zerolab.comm import Span, span
from zerolab.lessons.n04_zero2 import local_batch, measured_step
from zerolab.models import GPT, GPTConfig, num_params

# 8 blocks of hidden size 64: 405,120 parameters (1.62 MB in fp32). One block is 199,936 bytes,
# an eighth of the model: at 2 ranks the shards (half the model) plus a block or two in flight
# stay well below the full model.
MODEL = GPTConfig(n_layer=8, n_embd=64, n_head=4)
LR = 1e-3
TIMELINE_BATCH_PER_RANK = 32  # sequences per rank in the step drawn on the timeline


def unit_facts(engine: zerolab.ZeRO3) -> dict[str, Any]:
    """Each unit's gathered size and this rank's shards, in bytes (fp32)."""
    units = {u.name: sum(4 * b.layout.padded_numel for b in u.buckets) for u in engine.units}
    return {
        "unit_bytes": units,  # {"blocks.0": .., ..., "root": ..}, in the order they are listed
        "shard_bytes": sum(b.local_shard.numel() * 4 for u in engine.units for b in u.buckets),
        "padded_numel": sum(b.layout.padded_numel for u in engine.units for b in u.buckets),
    }


def timed_step(engine: Any, model: GPT, x: torch.Tensor, y: torch.Tensor,
               per_block: bool = False) -> zerolab.CommLog:
    """One step with the comm recorder and compute spans, no memory tracker.

    per_block=False: one span each for forward, backward and step. per_block=True: the forward
    is shown block by block instead (a "forward" span per block, from the block's first op to
    its last, after ZeRO-3's pre-forward hook has gathered it), so that the timeline shows
    where compute waits for an all-gather.
    """
    with zerolab.record_comm() as log:
        handles = watch_blocks(model.blocks, log) if per_block else []
        with contextlib.ExitStack() as stack:
            if not per_block:
                stack.enter_context(span("forward"))
            loss = model.loss(engine(x), y)
        for h in handles:
            h.remove()
        with span("backward"):
            loss.backward()
        with span("step"):
            engine.step()
    engine.zero_grad()
    return log


def watch_blocks(blocks: torch.nn.ModuleList, log: zerolab.CommLog) -> list[Any]:
    """Forward hooks that add a "forward" span to `log` for each block's own compute.

    Registered after the engine's hooks, so they run after ZeRO-3 has gathered the block
    (pre-hooks run in registration order) and after it has freed it (post-hooks too).
    """
    starts: dict[torch.nn.Module, float] = {}

    def before(module: torch.nn.Module, args: Any) -> None:
        starts[module] = log.now()

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        log.spans.append(Span("forward", starts.pop(module), log.now()))

    return [h for b in blocks
            for h in (b.register_forward_pre_hook(before), b.register_forward_hook(after))]


def zero3_run(prefetch: bool, config: GPTConfig = MODEL) -> dict[str, Any]:
    """ZeRO-3 on this rank: warm-up step, a tracked step, then a recorded step (see module)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    full_param_bytes = 4 * num_params(model)  # before sharding: afterwards .data are empty
    engine = zerolab.ZeRO3(model, torch.optim.AdamW, prefetch=prefetch, lr=LR)
    x, y = local_batch(model, 0, rank, world_size)
    model.loss(engine(x), y).backward()
    engine.step()
    engine.zero_grad()
    tracked = measured_step(engine, model, *local_batch(model, 1, rank, world_size))
    # A bigger batch for the timeline, so that a block computes about as long as it gathers.
    x, y = local_batch(model, 2, rank, world_size, per_rank=TIMELINE_BATCH_PER_RANK)
    log = timed_step(engine, model, x, y, per_block=True)
    trace = tracked["trace"]
    return {**tracked, **unit_facts(engine), "timeline_log": log,
            "max_by_category": trace.max_by_category, "peak": trace.peak_bytes,
            "full_param_bytes": full_param_bytes,
            "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}


def zero2_comm(config: GPTConfig = MODEL) -> zerolab.CommLog:
    """ZeRO-2 on the same model and batches: the log of one recorded step (after a warm-up)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    engine = zerolab.ZeRO2(model, torch.optim.AdamW, lr=LR)
    x, y = local_batch(model, 0, rank, world_size)
    model.loss(engine(x), y).backward()
    engine.step()
    engine.zero_grad()
    return timed_step(engine, model, *local_batch(model, 1, rank, world_size))


def zero3_lesson(config: GPTConfig = MODEL) -> dict[str, Any]:
    """Everything notebook 05 measures, on this rank.

    Returns {"num_params": Ψ, "prefetch": zero3_run(True), "no_prefetch": zero3_run(False),
    "zero2_log": CommLog, "same_weights": bool (prefetch on and off end with equal weights)}.
    """
    with_prefetch = zero3_run(True, config)
    without = zero3_run(False, config)
    same = all(torch.equal(v, without["state"][k]) for k, v in with_prefetch["state"].items())
    for run in (with_prefetch, without):
        del run["state"]  # compared here; no need to send it back
    return {"num_params": num_params(GPT(config)), "prefetch": with_prefetch,
            "no_prefetch": without, "zero2_log": zero2_comm(config), "same_weights": same}


def gathers_by_phase(log: zerolab.CommLog) -> dict[str, list[str]]:
    """The units all-gathered in each phase, in issue order: {"fwd": [...], "bwd": [...]}."""
    out: dict[str, list[str]] = {}
    for e in log.events:
        if e.op == "all_gather":
            _, phase, unit = e.tag.split("/", 2)  # "zero3/fwd/blocks.2"
            out.setdefault(phase, []).append(unit)
    return out


def issued_ahead(log: zerolab.CommLog) -> int:
    """All-gathers issued asynchronously, one unit ahead of the unit that needs them.

    Without prefetch every gather is issued when its unit starts and waited for at once: 0.
    With prefetch, the next unit's gather is issued when the current unit starts, and runs
    while the current unit computes.
    """
    return sum(1 for e in log.events if e.op == "all_gather" and e.async_op)


def forward_window(log: zerolab.CommLog) -> zerolab.CommLog:
    """A copy of `log` with the forward only: its all-gathers and its "forward" spans."""
    return dataclasses.replace(
        log, events=[e for e in log.events if "/fwd/" in e.tag],
        spans=[s for s in log.spans if s.name == "forward"])


def bytes_by_phase(log: zerolab.CommLog) -> dict[str, int]:
    """Bytes this rank sent, by phase and op: {"fwd all_gather": .., "bwd reduce_scatter": ..}.

    The phase is the middle part of the tag ("zero3/bwd/blocks.2" -> "bwd"): zerolab tags every
    collective with the stage, the phase and the unit or bucket.
    """
    out: dict[str, int] = {}
    for e in log.events:
        key = f"{e.tag.split('/')[1]} {e.op}"
        out[key] = out.get(key, 0) + e.sent_bytes
    return out


def overlapped_gathers(log: zerolab.CommLog) -> int:
    """Forward all-gathers of blocks.k that were in flight while blocks.k-1 computed.

    Needs a log from `timed_step(..., per_block=True)`: its "forward" spans are the blocks'
    compute, in order. Counts k >= 1 where the gather of blocks.k was issued before block k-1
    began computing and completed after it ended. With prefetch: every block but the first;
    without: none (each gather is issued only when its own block is about to run).
    """
    gathers = {e.tag.rsplit("/", 1)[-1]: e for e in log.events
               if e.op == "all_gather" and "/fwd/blocks." in e.tag}
    blocks = [s for s in log.spans if s.name == "forward"]
    return sum(1 for k in range(1, len(blocks))
               if (g := gathers.get(f"blocks.{k}")) is not None and g.end is not None
               and g.start <= blocks[k - 1].start and g.end >= blocks[k - 1].end)
