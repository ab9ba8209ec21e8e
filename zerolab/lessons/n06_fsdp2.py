"""Notebook 06, FSDP2 and friends: torch's own sharding next to zerolab's, on one model.

`side_by_side` runs on every rank and trains the same GPT on the same batches with:

- zerolab: DDP, ZeRO1, ZeRO2, ZeRO3;
- torch: DistributedDataParallel; DistributedDataParallel + ZeroRedundancyOptimizer (optimizer
  state sharded by whole parameters); fully_shard (FSDP2) on every block and on the root.

torch's three are `zerolab.bench.baselines`' engines, built by `engines.make_engine` like zerolab's,
so every variant runs the same `harness.train_step` and its last step the same
`harness.measured_step`. For each it returns a `Variant`: the final full parameters (to
compare), the model-state bytes this rank holds after the last step (measured from the live
tensors: for FSDP2, the local shards of the DTensor parameters, gradients and optimizer state),
the collectives of the last step with their ring-model bytes, and the step times.

zerolab's collectives are recorded by `record_comm`. torch's do not go through zerolab.comm:
`torch_comm.CollectiveCounter` sees each c10d op torch issues and applies the same ring formula.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import engines, harness
from zerolab.models import GPT, GPTConfig, num_params
from zerolab.wire.torch_counter import CollectiveCounter

# 4 blocks of hidden size 64: 205,184 parameters, 0.82 MB in fp32.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)
BATCH_PER_RANK = 4
LR = 1e-3
STEPS = 9  # timed: all but the first WARMUP and the last
WARMUP = 2

# zerolab's four, then torch's three: the order of every table (labels, formula stages and
# counterparts: zerolab.engines.ENGINES)
VARIANTS = (*engines.STAGE_ENGINES, "torch_ddp", "torch_ddp_zero", "torch_fsdp2")
Shapes = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass
class Variant:
    """One way to train, on one rank: its result, memory, traffic and time."""

    full: dict[str, torch.Tensor]  # full parameters and buffers after the last step
    held: dict[str, int]  # model-state bytes after the last step(), before zero_grad()
    sent: dict[str, int]  # ring-model bytes this rank sent in the last step, by op
    calls: dict[str, int]  # collectives issued in the last step, by op
    times: list[float]  # seconds per step, every step (see median_ms for which to read)
    owned: dict[str, int] | None = None  # ZeroRedundancyOptimizer: tensors, numel this rank steps
    shapes: Shapes | None = None  # FSDP2: {name: (full shape, this rank's shard shape)}


@dataclass
class SideBySide:
    """Everything notebook 06 compares, on one rank."""

    num_params: int  # Ψ
    variants: dict[str, Variant]  # by harness engine name, in VARIANTS' order


def title(name: str) -> str:
    """How the notebook names a variant: "zerolab ZeRO-2", "torch FSDP2 (fully_shard)"."""
    return engines.label(name, beside_torch=True)


def run_variant(name: str, config: GPTConfig = MODEL, steps: int = STEPS) -> Variant:
    """Train with engine `name` for `steps` steps, timing each; measure the last one."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    engine = engines.make_engine(name, model, torch.optim.AdamW, lr=LR)

    def batch(step: int) -> tuple[torch.Tensor, ...]:  # the same global batch for every variant
        return harness.local_batch(model.make_batch, BATCH_PER_RANK * world_size, 100 + step,
                                   rank, world_size)

    times = []
    for step in range(steps - 1):
        x, y = batch(step)
        dist.barrier()  # the ranks start each step together
        start = time.perf_counter()
        harness.train_step(engine, x, y)
        times.append(time.perf_counter() - start)
    # The last step, measured (it starts at a barrier of its own): model-state bytes and the
    # collectives. zerolab's are in the step's log; torch's only the counter sees.
    x, y = batch(steps - 1)
    start = time.perf_counter()
    with CollectiveCounter() as counter:
        last = harness.measured_step(engine, x, y, memory=False)
    times.append(time.perf_counter() - start)
    if name.startswith("torch"):
        sent, calls = counter.by_op, counter.calls
    else:
        sent, calls = last.log.bytes_by_op(), dict(Counter(e.op for e in last.log.events))
    return Variant(engine.full_state_dict(), last.held, sent, calls, times,
                   owned=engine.owned() if name == "torch_ddp_zero" else None,
                   shapes=engine.shard_shapes() if name == "torch_fsdp2" else None)


def side_by_side(config: GPTConfig = MODEL, steps: int = STEPS) -> SideBySide:
    """Run on every rank: `run_variant` for each of VARIANTS, one after the other."""
    return SideBySide(num_params(GPT(config)),
                      {name: run_variant(name, config, steps) for name in VARIANTS})


def median_ms(times: list[float]) -> float:
    """Median step time in milliseconds, over the steps after the warm-up and before the last
    (the last one runs under the recorders and is measured, so it is not timed)."""
    return 1e3 * statistics.median(times[WARMUP:-1])
