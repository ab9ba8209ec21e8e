"""Where a step's time goes: torch.profiler on rank 0, engine by engine.

    python -m zerolab.bench --profile                      # every engine, the course GPT
    python -m zerolab.bench --profile --engines ddp,torch_ddp --steps 5

Each engine is built on a fresh GPT (the bench's: same weights, batches and settings), runs
the warm-up steps, then `steps` steps under torch.profiler (CPU activity). The table lists, per
step, the operators that took the most *self* time on rank 0 (time inside the operator itself,
not in operators it called) and how often each ran. Two engines that run the same operators
as often, for the same time, do the same work; a time that differs with the same count moved
with the machine (the other rank's threads, gloo's), not with the code.

The floor (the same model's forward and backward alone, the bench's) is profiled in alternation
with each engine, a step of each in turn, so that the machine's load falls on both alike. The
operators the floor runs fewer times or not at all are then listed by their self time above
the floor's: the engine's overhead, op by op (its collectives, optimizer step, copies, hooks).
The operators both run as often (the matrix products) differ only by the machine's noise, or
by contention with the engine's communication threads: their difference is one figure.

On a GPU the times are the host's: launching kernels and waiting for the device where the code
waits (CUDA's runtime calls are listed by name), not the kernels' own.

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
from zerolab.bench.config import (
    BenchConfig,
    bench_batch,
    forward_backward,
    make_engine,
    synchronize,
)
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
    floor: StepProfile | None = None  # the floor's, profiled in alternation with this engine's


def profile_worker(config: BenchConfig, keys: tuple[str, ...]) -> list[StepProfile]:
    """On each rank: profile `config.steps` steps of every engine in `keys`, one engine at a
    time, each step followed by a step of the floor (forward and backward alone) on a model of
    its own: the two alternate, so that the machine's load falls on both alike."""
    ctx = zerolab.init_from_env()
    profiles = []
    for key in keys:
        engine = make_engine(key, config, ctx.device)
        floor = GPT(config.gpt_config()).to(ctx.device)
        steps = {key: functools.partial(harness.train_step, engine),
                 "floor": functools.partial(forward_backward, floor)}
        batches = [bench_batch(config, floor, i, ctx.rank, ctx.device)
                   for i in range(config.warmup + config.steps)]
        for x, y in batches[:config.warmup]:
            for step in steps.values():
                step(x, y)
        totals: dict[str, dict[str, list[float]]] = {name: {} for name in steps}
        # On a GPU, CUDA's runtime calls are listed too: a wait for the device
        # (cudaStreamSynchronize, cudaMemcpy to the host) shows by name, not inside an operator.
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if ctx.device.type == "cuda" else [])
        for x, y in batches[config.warmup:]:
            for name, step in steps.items():
                with profile(activities=activities) as prof:
                    step(x, y)
                    synchronize(ctx.device)  # the step's kernels end inside its profile
                for e in prof.key_averages():  # (calls, self microseconds), summed over steps
                    sums = totals[name].setdefault(e.key, [0, 0.0])
                    sums[0] += e.count
                    sums[1] += e.self_cpu_time_total
        engine_profile, floor_profile = (_per_step(name, totals[name], config.steps)
                                         for name in steps)
        profiles.append(StepProfile(key, engine_profile.self_ms, engine_profile.ops,
                                    floor_profile))
        del engine, floor, steps
    return profiles


def _per_step(key: str, totals: dict[str, list[float]], steps: int) -> StepProfile:
    ops = sorted((OpTime(name, calls / steps, self_us / steps / 1e3)
                  for name, (calls, self_us) in totals.items()), key=lambda op: -op.self_ms)
    return StepProfile(key, sum(op.self_ms for op in ops), ops)


def above_floor(p: StepProfile) -> tuple[list[OpTime], float]:
    """p's operators that the floor runs fewer times or not at all (its collectives, optimizer
    step, copies, hooks), by their self time above the floor's: (those ops, largest first;
    the difference in the operators both run as often: the machine's noise, or contention)."""
    base = {op.name: op for op in p.floor.ops}
    zero = OpTime("", 0.0, 0.0)
    more = [OpTime(op.name, op.calls - base.get(op.name, zero).calls,
                   op.self_ms - base.get(op.name, zero).self_ms) for op in p.ops]
    same = sum(op.self_ms for op in more if op.calls <= 0)
    return sorted((op for op in more if op.calls > 0), key=lambda op: -op.self_ms), same


def run_profile(config: BenchConfig) -> list[StepProfile]:
    """Rank 0's profiles of every engine of `config`, on `config.world_size` ranks."""
    config.check()
    keys = tuple(config.engines)
    return zerolab.launch(profile_worker, config.world_size, args=(config, keys),
                          timeout=config.timeout)[0]


def format_profiles(profiles: list[StepProfile], top: int = 12) -> str:
    """One block per engine: its `top` operators by self time per step, then those the floor
    runs fewer times or not at all, by their time above the floor's."""
    out = []
    for p in profiles:
        out.append(f"{p.key}: {p.self_ms:.1f} ms of operator self time per step on rank 0")
        out += [f"  {op.self_ms:8.1f} ms  {op.calls:6.1f}x  {op.name}" for op in p.ops[:top]]
        extra, same = above_floor(p)
        out.append(f"  above the floor (forward and backward alone, {p.floor.self_ms:.1f} ms, "
                   f"profiled in alternation): {sum(op.self_ms for op in extra):.1f} ms in "
                   f"operators it runs more often, largest first ({same:+.1f} ms in those it "
                   f"runs as often: the machine)")
        out += [f"  {op.self_ms:8.1f} ms  {op.calls:+6.1f}x  {op.name}" for op in extra[:top]]
    return "\n".join(out)
