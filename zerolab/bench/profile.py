"""Where a step's time goes: torch.profiler on rank 0, engine by engine.

    python -m zerolab.bench --profile                      # every engine, the course GPT
    python -m zerolab.bench --profile --engines ddp,torch_ddp --steps 5

Each engine is built on a fresh GPT (the bench's: same weights, batches and settings), runs
the warm-up steps, then `steps` steps under torch.profiler (CPU activity). The table lists, per
step, the operators that took the most *self* time on rank 0 (time inside the operator itself,
not in operators it called) and how often each ran. Two engines that run the same operators
as often, for the same time, do the same work; a time that differs with the same count moved
with the machine (the other rank's threads, gloo's), not with the code.

The floor (the same model's forward and backward alone, the bench's) is profiled the same way,
and each engine's operators are also listed by their time *above* it: an operator's self time
in the engine's step minus its self time in the floor's. That is the engine's overhead, op by
op: what its collectives, optimizer step, copies and hooks cost.

The profiler times operators, not the wait for a collective that another thread runs: on a
machine whose cores are all busy (the bench's "cores busy" line), the operators' times grow
with the communication that overlaps them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile

import zerolab
from zerolab import harness
from zerolab.bench.config import BenchConfig, bench_batch, forward_backward, make_engine
from zerolab.models import GPT


@dataclass(frozen=True)
class OpTime:
    name: str  # the operator, e.g. "aten::mm"
    calls: float  # how often it ran per step
    self_ms: float  # its own time per step, in milliseconds


@dataclass(frozen=True)
class StepProfile:
    key: str  # the engine, e.g. "zero3"
    self_ms: float  # every operator's self time per step, summed (ms)
    ops: list[OpTime]  # largest self time first


FLOOR = "floor"  # the profile of forward and backward alone (config.forward_backward)


def profile_worker(config: BenchConfig, keys: tuple[str, ...]) -> list[StepProfile]:
    """On each rank: profile `config.steps` steps of every engine in `keys`, one at a time,
    and of the floor (forward and backward alone), last."""
    ctx = zerolab.init_from_env()
    profiles = []
    for key in (*keys, FLOOR):
        if key == FLOOR:
            model = GPT(config.gpt_config()).to(ctx.device)
            step = functools.partial(forward_backward, model)
        else:
            engine = make_engine(key, config, ctx.device)
            model, step = engine.module, functools.partial(harness.train_step, engine)
        batches = [bench_batch(config, model, i, ctx.rank, ctx.device)
                   for i in range(config.warmup + config.steps)]
        for x, y in batches[:config.warmup]:
            step(x, y)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for x, y in batches[config.warmup:]:
                step(x, y)
        events = prof.key_averages()
        ops = sorted((OpTime(e.key, e.count / config.steps,
                             e.self_cpu_time_total / config.steps / 1e3) for e in events),
                     key=lambda op: -op.self_ms)
        profiles.append(StepProfile(key, sum(op.self_ms for op in ops), ops))
        del model, step
    return profiles


def above_floor(p: StepProfile, floor: StepProfile) -> list[OpTime]:
    """p's operators by their time above the floor's (the same operator's in forward and
    backward alone): calls and self ms per step more than the floor's, largest first."""
    base = {op.name: op for op in floor.ops}
    zero = OpTime("", 0.0, 0.0)
    ops = [OpTime(op.name, op.calls - base.get(op.name, zero).calls,
                  op.self_ms - base.get(op.name, zero).self_ms) for op in p.ops]
    return sorted(ops, key=lambda op: -op.self_ms)


def run_profile(config: BenchConfig) -> list[StepProfile]:
    """Rank 0's profiles of every engine of `config`, on `config.world_size` ranks."""
    config.check()
    keys = tuple(config.engines)
    return zerolab.launch(profile_worker, config.world_size, args=(config, keys),
                          timeout=config.timeout)[0]


def format_profiles(profiles: list[StepProfile], top: int = 12) -> str:
    """One block per engine: its `top` operators by self time per step, then by their time
    above the floor's (the last profile)."""
    out, floor = [], profiles[-1]
    for p in profiles:
        out.append(f"{p.key}: {p.self_ms:.1f} ms of operator self time per step on rank 0")
        out += [f"  {op.self_ms:8.1f} ms  {op.calls:6.1f}x  {op.name}" for op in p.ops[:top]]
        if p is not floor:
            out.append(f"  above the floor: {p.self_ms - floor.self_ms:.1f} ms per step, "
                       f"largest first")
            out += [f"  {op.self_ms:8.1f} ms  {op.calls:+6.1f}x  {op.name}"
                    for op in above_floor(p, floor)[:top]]
    return "\n".join(out)
