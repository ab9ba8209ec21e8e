"""Notebook 12b: a rank's peak predicted without building the model, checked where both run.

`measured_peaks` runs on every rank of a launch: each stage trains the model for real, one
step to make the optimizer's state, then one under zerolab.ledger; `fsdp2_tracker_peak` does
the same step with torch's FSDP2 under torch's own FSDPMemTracker. `compare` sets them beside
zerolab.predict's figures for the same model, stage, world size and batch.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

import zerolab
from zerolab import engines, ledger, predict
from zerolab.models import GPT, GPTConfig

STAGES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
LR = 1e-3
WORLD_SIZE, BATCH_PER_RANK = 3, 4  # the notebook's launch: the course GPT, zerolab.models.GPT()


@dataclass(frozen=True)
class Measured:
    """One rank's measured peak of one stage (zerolab.ledger)."""

    peak_bytes: int
    rows: dict[str, int]
    phase: str
    unexplained: int


def measured_peaks(build: Callable[[], nn.Module], batch_size: int,
                   param_dtypes: tuple[torch.dtype | None, ...] = (None,),
                   stages: tuple[str, ...] = tuple(STAGES),
                   seq_len: int | None = None) -> dict[tuple[str, str], Measured]:
    """Run on every rank: for each stage and dtype, the model built for real, one training
    step, then one under the ledger, on this rank's own batch (predict.batch, seeded by rank).
    Keys: (stage key, "fp32" or the 16-bit dtype's name)."""
    rank = dist.get_rank()
    out = {}
    for dtype in param_dtypes:
        for key in stages:
            model = build()
            engine = engines.make_engine(key, model, torch.optim.AdamW, lr=LR, param_dtype=dtype)
            x, y = predict.batch(model, batch_size, seq_len, seed=rank)
            model.loss(engine(x), y).backward()  # the first step makes the optimizer's state
            engine.step()
            engine.wait_params()
            engine.zero_grad()
            led = ledger.measure(engine, x, y)
            out[key, dtype_name(dtype)] = Measured(led.peak_bytes, dict(led.rows), led.phase,
                                                   led.unexplained)
            del engine, model, led
            gc.collect()  # the engine's hooks hold it in cycles: free this stage's memory now
    return out


def dtype_name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else str(dtype).removeprefix("torch.")


def fsdp2_tracker_peak(config: GPTConfig, batch_size: int) -> int:
    """Run on every rank: the course GPT under torch's FSDP2 (each block, then the root), one
    AdamW step, then one under torch's FSDPMemTracker; its peak, bytes (CPU: it tracks every
    device)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh

    from zerolab.bench.baselines import fully_shard_blocks

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = fully_shard_blocks(GPT(config), init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    x, y = predict.batch(model, batch_size, None, seed=rank)
    for tracked in (False, True):
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((x, y))
        with tracker if tracked else contextlib.nullcontext():
            model.loss(model(x), y).backward()
            optimizer.step()
        optimizer.zero_grad()
    snapshot = tracker.get_tracker_snapshot("peak")
    return sum(by_kind["Total"] for by_kind in snapshot.values())


@dataclass(frozen=True)
class Row:
    """A prediction beside its measurement."""

    model: str
    stage: str
    world_size: int
    dtype: str
    predicted: int
    measured: int
    predicted_phase: str
    measured_phase: str
    predicted_rows: dict[str, int]
    measured_rows: dict[str, int]

    @property
    def error(self) -> float:
        """(predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured


def compare(name: str, build: Callable[[], nn.Module], batch_size: int, world_size: int,
            measured: dict[tuple[str, str], Measured], seq_len: int | None = None) -> list[Row]:
    """predict.peak for each (stage, dtype) that was measured at world_size (rank 0's)."""
    rows = []
    for (key, dtype), m in measured.items():
        param_dtype = None if dtype == "fp32" else getattr(torch, dtype)
        p = predict.peak(build, key, world_size, batch_size, param_dtype=param_dtype,
                         seq_len=seq_len)
        rows.append(Row(name, STAGES[key], world_size, dtype, p.peak_bytes, m.peak_bytes,
                        p.phase, m.phase, p.rows, m.rows))
    return rows


def table(rows: list[Row]) -> list[str]:
    """The rows as lines: model, stage, N, dtype, predicted, measured, error."""
    lines = [f"{'model':14}{'stage':>8}{'N':>3}{'dtype':>10}{'predicted':>14}{'measured':>14}"
             f"{'error':>9}"]
    lines += [f"{r.model:14}{r.stage:>8}{r.world_size:>3}{r.dtype:>10}{r.predicted:>14,}"
              f"{r.measured:>14,}{100 * r.error:>8.2f}%" for r in rows]
    return lines


def measured_for(id: str) -> float:
    """The measurement prediction 12b.p1 is scored against: the ledger's peak on rank 0 of an
    fp32 ZeRO-2 step of the course GPT at N = 3 (one launch)."""
    if id != "12b.p1":
        raise ValueError(f"notebook 12b has one prediction, 12b.p1; got {id!r}")
    measured = zerolab.launch(measured_peaks, WORLD_SIZE,
                              args=(GPT, BATCH_PER_RANK, (None,), ("zero2",)))
    return float(measured[0]["zero2", "fp32"].peak_bytes)


def notebook_12b() -> dict:
    """Run on every rank: the notebook's one launch. Each stage of the course GPT measured in
    fp32 and bf16 (`measured_peaks`), and torch's FSDP2 under FSDPMemTracker."""
    return {"measured": measured_peaks(GPT, BATCH_PER_RANK, (None, torch.bfloat16)),
            "fsdp2": fsdp2_tracker_peak(GPTConfig(), BATCH_PER_RANK)}
