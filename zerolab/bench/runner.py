"""Benchmark zerolab's engines against torch's own, on the same model and data.

    python -m zerolab.bench                       # world size 2, a ~14M-parameter GPT, all 7
    python -m zerolab.bench --quick               # seconds: a tiny GPT, 1 warm-up, 2 steps
    python -m zerolab.bench --gpt2                # GPT-2 small (124M), in pairs: minutes
    python -m zerolab.bench --json bench.json --plot bench.png
    python -m zerolab.bench --profile             # where a step's time goes (bench_profile.py)
    torchrun --nproc-per-node 8 -m zerolab.bench --gpt2   # 8 GPUs (NCCL), ranks from torchrun

Seven engines train the same GPT (same initial weights, same batches, AdamW with the same
settings):

    zerolab DDP, ZeRO-1, ZeRO-2, ZeRO-3        (this package)
    torch DDP                                  (DistributedDataParallel)
    torch DDP + ZeroRedundancyOptimizer        (torch's ZeRO-1)
    torch FSDP2                                (fully_shard on every block and on the root)

Side by side (the default), all seven live in the *same* spawned ranks. In pairs (--pairs, and
--gpt2, where seven models of 124M parameters at 16 bytes each would not fit in memory), each
zerolab stage runs with its torch counterpart (DDP and ZeRO-2 with torch DDP, ZeRO-1 with DDP +
ZeroRedundancyOptimizer, ZeRO-3 with FSDP2), one launch per pair.

Method, so that every figure can be checked:

- Time. The engines of a launch are built side by side, then trained in rounds: each round
  runs one training step (forward, backward, optimizer step, zero_grad) of every engine, in an
  order rotated every round, so that drift in the machine (another job, thermal throttling)
  hits all engines alike. Each step starts at a barrier; its time is the slowest rank's.
  Warm-up rounds are dropped. The targets are checked on the median of the per-round ratios of
  a stage to its counterpart (the two ran seconds apart in every round). No instrumentation is
  active while timing.
- The floor. In the same rotation, every round also times the same model's forward and backward
  alone, with no engine: no collective, no optimizer step. No engine can be faster; a time
  target that asks for less than it, as a share of the counterpart's step, is out of reach.
- Overhead. An engine's overhead in a round is its step's time minus the floor's in that
  round: what the engine adds to the compute (collectives, optimizer step, copies, hooks). The
  targets are on the median of the per-round ratios of a stage's overhead to its counterpart's.
- Memory and traffic. A separate pass runs rounds of three more steps of each engine: a plain
  one, one under the comm recorder only, one under `zerolab.track_memory` as well, with a
  `categorize` for every engine: the engines' `state_tensors()`, and for torch's the module's
  parameters, gradients and optimizer state. Peak = the largest total of live tensor bytes in
  the step, by category. Model-state bytes are read after the optimizer step, before
  zero_grad, from the live tensors, and set against the formulas of zerolab.theory. The
  measured steps' times against the plain one's of the same round are what measuring costs.
- Bytes sent per rank per step: zerolab's from `record_comm`. torch's collectives do not go
  through zerolab.comm, so a dispatch mode (`torch_comm.CollectiveCounter`) sees each c10d
  collective torch issues (DDP's bucket all-reduces, ZeroRedundancyOptimizer's broadcasts,
  FSDP2's all-gathers and reduce-scatters) and applies the same ring formula as `record_comm`.
  The counter also runs on zerolab's engines, as a cross-check of the two methods.
- Every step, timed or measured, is `zerolab.harness`'s: the same code the notebooks run.
- Correctness. After the last step every engine's full parameters are compared with the
  reference's (torch DDP side by side; the torch counterpart in pairs): the largest absolute
  difference must be at most `atol` (`tolerance` * lr: a small fraction of what one AdamW step
  moves a parameter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import zerolab
from zerolab import harness
from zerolab.bench.config import (
    BENCHED,
    GPT2,
    QUICK,
    BenchConfig,
    bench_batch,
    forward_backward,
    make_engine,
    synchronize,
)
from zerolab.bench.profile import format_profiles, run_profile
from zerolab.bench.report import format_table, plot, summarize
from zerolab.launcher.progress import Progress, ProgressBar, follow_progress
from zerolab.models import GPT, num_params
from zerolab.units import make_units
from zerolab.wire.torch_counter import CollectiveCounter

T = TypeVar("T")


def bench_worker(config: BenchConfig, keys: tuple[str, ...], reference: str,
                 progress: Progress | None = None) -> dict[str, Any]:
    """Build `keys` on this rank, time them in rotation, measure, compare with `reference`."""
    ctx = zerolab.init_from_env()
    engines = {k: make_engine(k, config, ctx.device) for k in keys}
    model = engines[reference].module
    rounds = config.warmup + config.steps
    measuring = 3 * config.measure_rounds if config.measure else 0  # steps per engine
    total = rounds * len(keys) + measuring * len(keys) + 1
    done = 0

    def report(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None and ctx.rank == 0:
            progress(done, total, label)

    def batch(round_index: int) -> tuple[torch.Tensor, ...]:
        return bench_batch(config, model, round_index, ctx.rank, ctx.device)

    # 1. Timing: one step of every engine per round, in rotation, nothing recorded. The
    # floor under all of them rotates with them: the same model's forward and backward alone.
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu_times: dict[str, list[float]] = {k: [] for k in keys}  # this process, all its threads
    page_faults: dict[str, list[int]] = {k: [] for k in keys}  # pages first touched (allocator.py)
    floor, floor_times, floor_cpu = GPT(config.gpt_config()).to(ctx.device), [], []
    order = (*keys, FLOOR)
    for r in range(rounds):
        x, y = batch(r)
        shift = r % len(order)
        for key in order[shift:] + order[:shift]:
            if key == FLOOR:
                wall, cpu, _ = timed(ctx.device, forward_backward, floor, x, y)
                floor_times.append(wall)
                floor_cpu.append(cpu)
                continue
            faults = minor_page_faults()
            wall, cpu, _ = timed(ctx.device, harness.train_step, engines[key], x, y)
            page_faults[key].append(minor_page_faults() - faults)
            times[key].append(wall)
            cpu_times[key].append(cpu)
            report(f"{'warm-up' if r < config.warmup else 'step'} {r + 1}/{rounds} {key}")

    # 2. Memory and traffic, and what measuring costs: rounds of three more steps of each, a
    # plain one, one under the comm recorder, one under the memory tracker as well; each
    # measured step's time against the plain one just before it (seconds apart: the same load).
    measured: dict[str, dict[str, Any]] = {}
    for key in keys if config.measure else ():
        costs: dict[str, list[float]] = {"plain_s": [], "recorded_s": [], "tracked_s": []}
        for i in range(rounds, rounds + 3 * config.measure_rounds, 3):
            costs["plain_s"].append(timed(ctx.device, harness.train_step, engines[key],
                                          *batch(i))[0])
            report(f"plain {key}")
            costs["recorded_s"].append(timed(ctx.device, harness.measured_step, engines[key],
                                             *batch(i + 1), memory=False)[0])
            report(f"traffic {key}")
            tracked_s, _, m = timed(ctx.device, measure_step, engines[key], *batch(i + 2))
            costs["tracked_s"].append(tracked_s)
            report(f"memory {key}")
        measured[key] = {**m, **costs}

    # 3. Correctness: full parameters against the reference's.
    expected = engines[reference].full_state_dict()
    diffs = {k: harness.max_diff(engines[k].full_state_dict(), expected) for k in keys}
    report("compare parameters")
    return {"rank": ctx.rank, "times": times, "floor_times": floor_times, "cpu_times": cpu_times,
            "floor_cpu_times": floor_cpu,
            "page_faults": page_faults, "measured": measured,
            "max_abs_diff": diffs, "reference": reference,
            "params": num_params(model) if ctx.rank == 0 else None,
            # ZeRO-3's and FSDP2's root unit, kept gathered from forward to backward
            "root_params": sum(p.numel() for p in make_units(floor)[-1].params),
            "backend": ctx.backend, "device": str(ctx.device),
            "threads": torch.get_num_threads()}


FLOOR = "floor"  # in the timing rotation: forward and backward alone


def minor_page_faults() -> int:
    """Page faults this process has taken that needed no disk: mostly a first touch of memory
    the allocator has just taken from the kernel (which zeroes every page). 0 where unknown."""
    try:
        import resource  # Unix only
    except ImportError:
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed(device: torch.device, fn: Callable[..., T], *args: Any,
          **kwargs: Any) -> tuple[float, float, T]:
    """(wall seconds, this process's CPU seconds, result) of fn(*args, **kwargs), started at a
    barrier so that the ranks start together: the slowest rank's wall time is the step's."""
    dist.barrier()
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = fn(*args, **kwargs)
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - cpu_start, result


def measure_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """harness.measured_step, with torch's collectives counted as well."""
    with CollectiveCounter() as counter:
        m = harness.measured_step(engine, x, y)
    tracker_rise, device_rise = m.memory.rises()
    return {"peak_bytes": m.memory.peak_bytes, "peak_by_category": m.memory.peak_by_category,
            "device_peak_bytes": m.memory.device_peak_bytes, "model_state_bytes": m.held,
            "tracker_rise_bytes": tracker_rise, "device_rise_bytes": device_rise,
            "record_comm_bytes": m.log.total_ring_bytes(),
            "record_comm_by_op": m.log.bytes_by_op(),
            "c10d_bytes": counter.sent_bytes, "c10d_by_op": counter.by_op,
            "c10d_calls": counter.calls, "c10d_unknown_ops": sorted(set(counter.unknown_ops))}


def run(config: BenchConfig, progress: bool = True, command: str = "") -> dict[str, Any]:
    """Run the benchmark on `config.world_size` ranks (once per group: all engines side by
    side, or one launch per pair); return the report (a dict), on every rank under torchrun.

    Started by `python -m zerolab.bench`, it spawns the ranks itself (zerolab.launch: gloo on
    CPU, NCCL with a GPU per rank). Under torchrun, this process is one of the ranks already.
    """
    config.check()
    load_start = list(os.getloadavg())
    groups = config.groups()
    results = []
    for i, (keys, reference) in enumerate(groups):
        title = "bench" if len(groups) == 1 else f"bench {i + 1}/{len(groups)} {'+'.join(keys)}"
        bar = ProgressBar(title) if progress else None
        if under_torchrun():
            results.append(run_in_this_job(config, keys, reference, bar))
            continue
        with follow_progress(bar) if bar else contextlib.nullcontext() as sink:
            results.append(zerolab.launch(bench_worker, config.world_size,
                                          args=(config, keys, reference, sink),
                                          timeout=config.timeout))
    return summarize(config, results, (load_start, list(os.getloadavg())), command)


def under_torchrun() -> bool:
    """Whether torchrun started this process as one rank of a job (it sets this variable)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def run_in_this_job(config: BenchConfig, keys: tuple[str, ...], reference: str,
                    bar: ProgressBar | None) -> list[dict[str, Any]]:
    """bench_worker on this rank of a torchrun job; every rank gets every rank's results."""
    ctx = zerolab.init_from_env()
    if ctx.world_size != config.world_size:
        raise ValueError(f"--world-size {config.world_size} but torchrun started "
                         f"{ctx.world_size} ranks: give the same number to both")
    mine = bench_worker(config, keys, reference, bar if ctx.rank == 0 else None)
    per_rank: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(per_rank, mine)
    return per_rank


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="python -m zerolab.bench", description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="CI mode: a tiny GPT, 1 warm-up and 2 timed rounds (seconds)")
    size.add_argument("--gpt2", action="store_true",
                      help="GPT-2 small's shape (124M parameters), 64-token sequences, in pairs "
                           "(minutes per pair)")
    p.add_argument("--world-size", type=int,  # under torchrun: the ranks it started
                   default=int(os.environ["WORLD_SIZE"]) if under_torchrun() else d.world_size)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--seq-len", type=int, help="tokens per training sequence (<= block size)")
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--global-batch", type=int, help="sequences per step over all ranks")
    p.add_argument("--warmup", type=int, help="untimed rounds first")
    p.add_argument("--steps", type=int, help="timed rounds")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--bucket-mb", type=float, help="gradient bucket size (MiB)")
    p.add_argument("--engines", default=",".join(BENCHED),
                   help=f"comma-separated subset of {','.join(BENCHED)}")
    p.add_argument("--pairs", action="store_true", default=None,
                   help="one launch per zerolab stage and its torch counterpart (less memory)")
    p.add_argument("--no-measure", action="store_true", help="skip the memory/traffic pass")
    p.add_argument("--tolerance", type=float, default=d.tolerance,
                   help="matches when max |param - torch DDP's param| <= TOLERANCE * lr")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the figures as one PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--profile", action="store_true",
                   help="instead: torch.profiler on rank 0, the operators that take each "
                        "engine's time (warm-up, then --steps steps each)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else GPT2 if args.gpt2 else {}
    config = replace(BenchConfig(), **preset)
    overrides = {name: getattr(args, name) for name in
                 ("vocab_size", "block_size", "seq_len", "n_layer", "n_head", "n_embd",
                  "global_batch", "warmup", "steps", "bucket_mb", "pairs")
                 if getattr(args, name) is not None}
    config = replace(config, **overrides, world_size=args.world_size, lr=args.lr,
                     tolerance=args.tolerance, seed=args.seed, measure=not args.no_measure,
                     engines=tuple(s.strip() for s in args.engines.split(",")))
    return config, args


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    if args.profile:
        if under_torchrun():
            raise SystemExit("--profile starts its own ranks: run it without torchrun")
        print(format_profiles(run_profile(config)))
        return 0
    command = "python -m zerolab.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = run(config, progress=not args.no_progress, command=command.strip())
    ok = all(r["matches_reference"] for r in report["engines"])
    if under_torchrun() and dist.get_rank() != 0:
        return 0 if ok else 1  # rank 0 prints and writes
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if ok else 1

