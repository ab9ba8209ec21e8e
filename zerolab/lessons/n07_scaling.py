"""Notebook 07, scaling: memory and traffic per rank against the world size, and torchrun.

`states_and_traffic` trains the same GPT for two steps with each stage (DDP, ZeRO-1, ZeRO-2,
ZeRO-3) on the N ranks of a process group. It returns, per stage, the model-state bytes this
rank holds after the second step (measured from the live tensors) and the bytes it sent
during that step (recorded by zerolab.comm). `scaling_runs` does that for N = 1, 2 and 4 in
one launch of 4 ranks; the notebook puts the measurements beside `zerolab.theory`'s formulas.

`run_torchrun` runs `python -m zerolab.train` under torchrun in a subprocess and returns its
exit code, its output and the losses it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import zerolab
from zerolab.models import GPT, GPTConfig, num_params

# 2 blocks of hidden size 64: 105,088 parameters, 0.42 MB in fp32.
MODEL = GPTConfig(n_layer=2, n_embd=64, n_head=4)
GLOBAL_BATCH = 8  # sequences per step, split over the ranks (N = 1, 2, 4 all divide it)
LR = 1e-3

STAGES: dict[str, type[zerolab.DDP]] = {
    "DDP": zerolab.DDP, "ZeRO-1": zerolab.ZeRO1, "ZeRO-2": zerolab.ZeRO2, "ZeRO-3": zerolab.ZeRO3,
}


def local_batch(model: GPT, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows of the step's global batch of GLOBAL_BATCH sequences."""
    x, y = model.make_batch(GLOBAL_BATCH, seed=100 + step)
    per_rank = GLOBAL_BATCH // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows], y[rows]


def states_and_traffic(group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Per stage, on this rank: {"bytes": {params, grads, optimizer}, "sent": bytes per step}.

    Also "num_params" (Ψ) and "world_size" (of `group`: the ranks that train together; None,
    the whole job). The first step creates Adam's state; the second is measured.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    out: dict[str, Any] = {"num_params": num_params(GPT(MODEL)), "world_size": world_size}
    for name, engine_cls in STAGES.items():
        model = GPT(MODEL)
        engine = engine_cls(model, torch.optim.AdamW, group=group, lr=LR)
        for step in range(2):
            x, y = local_batch(model, step, rank, world_size)
            with zerolab.record_comm(group) as log:
                model.loss(engine(x), y).backward()
                engine.step()
            held = engine.model_state_bytes()  # after step, before zero_grad
            engine.zero_grad()
        out[name] = {"bytes": held, "sent": log.total_bytes()}
    return out


def scaling_runs(sizes: tuple[int, ...] = (1, 2, 4)) -> dict[int, dict[str, Any] | None]:
    """`states_and_traffic` at several world sizes, in one launch of max(sizes) ranks.

    For each N, ranks 0..N-1 form a process group of their own (`dist.new_group`) and train
    in it, as a job of N ranks would; the other ranks wait. This is how a data-parallel group
    is carved out of a larger job, and it saves starting a launch per world size.
    Returns {N: this rank's results at N, or None where this rank was not in the group}.
    """
    rank = dist.get_rank()
    out: dict[int, dict[str, Any] | None] = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))  # every rank of the job must call new_group
        out[n] = states_and_traffic(group) if rank < n else None
        dist.barrier()  # the whole job moves on to the next N together
    return out


def run_torchrun(nproc: int = 2, strategy: str = "zero3", steps: int = 5,
                 timeout: float = 300.0) -> dict[str, Any]:
    """`torchrun --standalone --nproc-per-node nproc -m zerolab.train ...`, in a subprocess.

    Uses `python -m torch.distributed.run` (what the `torchrun` command runs) with this
    interpreter, so it works without the venv's bin/ on PATH. Returns {"command": the command
    line as a learner would type it, "returncode": int, "losses": [float] (from --json),
    "output": stdout + stderr}.
    """
    args = ["--standalone", "--nproc-per-node", str(nproc), "-m", "zerolab.train",
            "--strategy", strategy, "--steps", str(steps), "--no-progress"]
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "run.json"
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *args, "--json", str(summary)],
            capture_output=True, text=True, timeout=timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        losses = json.loads(summary.read_text())["losses"] if summary.exists() else []
    return {"command": " ".join(["torchrun", *args]), "returncode": proc.returncode,
            "losses": losses, "output": proc.stdout + proc.stderr}
