"""Notebook 07, scaling: memory and traffic per rank against the world size, and torchrun.

`states_and_traffic` trains the same GPT for two steps with each stage (DDP, ZeRO-1, ZeRO-2,
ZeRO-3) on the N ranks of a process group. It returns, per stage, the model-state bytes this
rank holds after the second step (measured from the live tensors) and the bytes it sent
during that step (recorded by zerolab.comm): a `harness.measured_step`. Bytes sent come twice:
the ring model's figure and the wire bytes the kernel counted, per op, with what ran (on gloo
an all-gather runs as N broadcasts, a reduce-scatter as N-1 send/recv pairs). `scaling_runs` does
that for N = 1, 2 and 4 in one launch of 4 ranks; the notebook puts the measurements beside
`zerolab.theory`'s formulas.

`run_torchrun` runs `python -m zerolab.train` under torchrun in a subprocess and returns a
`TorchrunResult`: its exit code, its output and the losses it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from zerolab import engines, harness
from zerolab.models import GPT, GPTConfig, num_params

# 2 blocks of hidden size 64: 105,216 parameters, 0.42 MB in fp32.
MODEL = GPTConfig(n_layer=2, n_embd=64, n_head=4)
GLOBAL_BATCH = 8  # sequences per step, split over the ranks (N = 1, 2, 4 all divide it)
LR = 1e-3
# The four stages the course builds; their labels ("DDP", "ZeRO-1", ...) are theory's stages.
STAGES = tuple(engines.label(name) for name in engines.STAGE_ENGINES)


@dataclass
class StageMeasure:
    """One stage's second step on one rank."""

    held: dict[str, int]  # model-state bytes after step(), before zero_grad(), by category
    sent: int  # ring-model bytes this rank sent in the step
    # The same step's collectives, by op ("all_reduce", ...): ring-model bytes, measured wire
    # bytes (None where unmeasurable), and what ran (CommEvent.impl, e.g. "all_gather as 2
    # broadcasts (gloo)").
    ring_by_op: dict[str, int] = field(default_factory=dict)
    wire_by_op: dict[str, int | None] = field(default_factory=dict)
    impl_by_op: dict[str, str] = field(default_factory=dict)

    @property
    def wire(self) -> int | None:
        """Measured bytes this rank wrote in the step (None if any op was unmeasured)."""
        values = list(self.wire_by_op.values())
        return None if None in values else sum(values)


@dataclass
class ScalingRun:
    """Every stage trained by one process group of N ranks, seen from one of its ranks."""

    num_params: int  # Ψ
    world_size: int  # N: the ranks of the group that trained together
    stages: dict[str, StageMeasure]  # by stage label, in STAGES' order: "DDP", "ZeRO-1", ...


@dataclass
class TorchrunResult:
    """A `torchrun ... -m zerolab.train` run, in a subprocess."""

    command: str  # the command line as a learner would type it
    returncode: int  # the subprocess's exit status
    losses: list[float]  # one per step, from train's --json summary (empty if none was written)
    output: str  # stdout + stderr


def states_and_traffic(group: dist.ProcessGroup | None = None,
                       global_batch: int = GLOBAL_BATCH) -> ScalingRun:
    """Each stage, on this rank of `group` (None: the whole job): two steps, the second measured.

    The first step creates Adam's state. Every rank takes its rows of the same global batch of
    `global_batch` sequences (a multiple of N), so every N computes the same steps.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    stages = {}
    for name in engines.STAGE_ENGINES:
        model = GPT(MODEL)
        engine = engines.make_engine(name, model, torch.optim.AdamW, group=group, lr=LR)
        x, y = harness.local_batch(model.make_batch, global_batch, 100, rank, world_size)
        harness.train_step(engine, x, y)
        x, y = harness.local_batch(model.make_batch, global_batch, 101, rank, world_size)
        measured = harness.measured_step(engine, x, y, memory=False)
        log = measured.log
        impl = {e.op: e.impl for e in log.events}  # one impl per op in a step: the last says it
        stages[engines.label(name)] = StageMeasure(measured.held, log.total_ring_bytes(),
                                                   log.bytes_by_op(), log.wire_bytes_by_op(),
                                                   impl)
    return ScalingRun(num_params(GPT(MODEL)), world_size, stages)


def scaling_runs(sizes: tuple[int, ...] = (1, 2, 4),
                 global_batch: int = GLOBAL_BATCH) -> dict[int, ScalingRun | None]:
    """`states_and_traffic` at several world sizes, in one launch of max(sizes) ranks.

    For each N, ranks 0..N-1 form a process group of their own (`dist.new_group`) and train
    in it, as a job of N ranks would; the other ranks wait. This is how a data-parallel group
    is carved out of a larger job, and it saves starting a launch per world size.
    Returns {N: this rank's results at N, or None where this rank was not in the group}.
    """
    rank = dist.get_rank()
    out: dict[int, ScalingRun | None] = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))  # every rank of the job must call new_group
        out[n] = states_and_traffic(group, global_batch) if rank < n else None
        dist.barrier()  # the whole job moves on to the next N together
    return out


def run_torchrun(nproc: int = 2, engine_key: str = "zero3", steps: int = 5,
                 timeout: float = 300.0) -> TorchrunResult:
    """`torchrun --standalone --nproc-per-node nproc -m zerolab.train ...`, in a subprocess.

    Uses `python -m torch.distributed.run` (what the `torchrun` command runs) with this
    interpreter, so it works without the venv's bin/ on PATH.
    """
    args = ["--standalone", "--nproc-per-node", str(nproc), "-m", "zerolab.train",
            "--engine", engine_key, "--steps", str(steps), "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "run.json"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *args, "--json", str(summary)],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        losses = json.loads(summary.read_text())["losses"] if summary.exists() else []
    return TorchrunResult(" ".join(["torchrun", *args]), proc.returncode, losses,
                          proc.stdout + proc.stderr)
