"""Notebook 06, FSDP2 and friends: torch's own sharding next to zerolab's, on one model.

`side_by_side` runs on every rank and trains the same GPT on the same batches with:

- zerolab: DDP, ZeRO1, ZeRO2, ZeRO3;
- torch: DistributedDataParallel; DistributedDataParallel + ZeroRedundancyOptimizer (optimizer
  state sharded by whole parameters); fully_shard (FSDP2) on every block and on the root.

For each it returns the final full parameters (to compare), the model-state bytes this rank
holds after the last step (measured from the live tensors: for FSDP2, the local shards of the
DTensor parameters, gradients and optimizer state), the bytes zerolab recorded for one step,
the number of collectives torch issued in one step (counted by torch's CommDebugMode), and
the step times. Plain data; the notebook prints and draws it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import zerolab
from zerolab.memory import distinct_bytes
from zerolab.models import GPT, GPTConfig, num_params

# 4 blocks of hidden size 64: 205,184 parameters, 0.82 MB in fp32.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)
BATCH_PER_RANK = 4
LR = 1e-3
STEPS = 9  # timed: all but the first WARMUP and the last
WARMUP = 2

ZEROLAB = {"zerolab DDP": zerolab.DDP, "zerolab ZeRO-1": zerolab.ZeRO1,
           "zerolab ZeRO-2": zerolab.ZeRO2, "zerolab ZeRO-3": zerolab.ZeRO3}
TORCH = ("torch DDP", "torch DDP + ZeroRedundancyOptimizer", "torch FSDP2 (fully_shard)")


def local_batch(model: GPT, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows of the step's global batch: (BATCH_PER_RANK, seq) tokens each."""
    x, y = model.make_batch(BATCH_PER_RANK * world_size, seed=100 + step)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return x[rows], y[rows]


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def held_bytes(params: Iterable[nn.Parameter], optimizer_state: Iterable[dict]) -> dict[str, int]:
    """Model-state bytes held by this rank, from the live tensors (local shards of DTensors)."""
    params = list(params)
    seen: set = set()
    return {
        "params": distinct_bytes((local(p) for p in params), seen),
        "grads": distinct_bytes((local(p.grad) for p in params if p.grad is not None), seen),
        "optimizer": distinct_bytes((local(v) for s in optimizer_state for v in s.values()
                                     if torch.is_tensor(v)), seen),
    }


def full_params(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full parameter values (a DTensor is gathered: a collective with FSDP2)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in named}


def train(step_fn: Callable[[int], None], steps: int = STEPS) -> list[float]:
    """Run `steps` training steps; return the seconds each took (ranks start them together)."""
    times = []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step_fn(step)
        times.append(time.perf_counter() - start)
    return times


def run_zerolab(name: str, config: GPTConfig = MODEL, steps: int = STEPS) -> dict[str, Any]:
    """Train with one of zerolab's engines; measure the last step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    engine = ZEROLAB[name](model, torch.optim.AdamW, lr=LR)
    out: dict[str, Any] = {}

    def step(i: int) -> None:
        x, y = local_batch(model, i, rank, world_size)
        with zerolab.record_comm(align=False) as log:
            model.loss(engine(x), y).backward()
            engine.step()
        if i == steps - 1:
            out["comm"] = log.bytes_by_op()
            out["bytes"] = engine.model_state_bytes()  # after step, before zero_grad
        engine.zero_grad()

    out["times"] = train(step, steps)
    out["full"] = engine.full_state_dict()
    return out


def run_torch_ddp(zero_redundancy: bool, config: GPTConfig = MODEL,
                  steps: int = STEPS) -> dict[str, Any]:
    """torch's DDP, with AdamW or with AdamW sharded by ZeroRedundancyOptimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    # Gradients as views into DDP's all-reduce buckets, like zerolab's DDP: no second copy.
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    if zero_redundancy:
        opt: Any = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR)
        local_opt = opt.optim  # the AdamW over the parameters this rank owns
    else:
        opt = local_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {}

    def step(i: int) -> None:
        x, y = local_batch(model, i, rank, world_size)
        with counting(out, last=i == steps - 1):
            model.loss(ddp(x), y).backward()
            opt.step()  # ZeroRedundancyOptimizer: update own parameters, then broadcast them
        if i == steps - 1:
            out["bytes"] = held_bytes(model.parameters(), local_opt.state.values())
        opt.zero_grad(set_to_none=False)

    out["times"] = train(step, steps)
    out["full"] = full_params(model.named_parameters())
    owned = [p for g in local_opt.param_groups for p in g["params"]]
    out["owned"] = {"tensors": len(owned), "numel": sum(p.numel() for p in owned)}
    return out


def run_fsdp2(config: GPTConfig = MODEL, steps: int = STEPS) -> dict[str, Any]:
    """torch's FSDP2: fully_shard on every block, then on the root (the article's recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = GPT(config)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: embeddings, final LayerNorm (and the tied head)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict[str, Any] = {}

    def step(i: int) -> None:
        x, y = local_batch(model, i, rank, world_size)
        with counting(out, last=i == steps - 1):
            model.loss(model(x), y).backward()
            opt.step()
        if i == steps - 1:
            out["bytes"] = held_bytes(model.parameters(), opt.state.values())
            out["shapes"] = {n: (tuple(p.shape), tuple(local(p).shape))
                             for n, p in model.named_parameters()}
        opt.zero_grad()

    out["times"] = train(step, steps)
    out["full"] = full_params(model.named_parameters())
    return out


@contextlib.contextmanager
def counting(out: dict[str, Any], last: bool) -> Iterator[None]:
    """In the last step, count the collectives torch issues (torch's CommDebugMode) into
    out["collectives"]: {op name: calls}. Other steps run as they are."""
    if not last:
        yield
        return
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as mode:
        yield
    out["collectives"] = {str(op): n for op, n in mode.get_comm_counts().items()}


def side_by_side(config: GPTConfig = MODEL, steps: int = STEPS) -> dict[str, Any]:
    """Everything notebook 06 compares, on this rank: {variant: {...}, "num_params": Ψ}.

    Each variant: "full" (parameters after the last step), "bytes" (model state held after
    it), "times" (seconds per step); zerolab's also "comm" (bytes sent in the last step, by
    op); torch's also "collectives" (calls in the last step, by op) and, for DDP,
    "owned" (tensors and elements this rank's optimizer steps).
    """
    out: dict[str, Any] = {name: run_zerolab(name, config, steps) for name in ZEROLAB}
    out[TORCH[0]] = run_torch_ddp(False, config, steps)
    out[TORCH[1]] = run_torch_ddp(True, config, steps)
    out[TORCH[2]] = run_fsdp2(config, steps)
    out["num_params"] = num_params(GPT(config))
    return out


def median_ms(times: list[float]) -> float:
    """Median step time in milliseconds, over the steps after the warm-up and before the last
    (the last one runs under CommDebugMode and is measured, so it is not timed)."""
    return 1e3 * statistics.median(times[WARMUP:-1])
