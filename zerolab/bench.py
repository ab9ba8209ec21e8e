"""Benchmark zerolab's engines against torch's own, side by side, on the same model and data.

    python -m zerolab.bench                       # world size 2, a ~14M-parameter GPT
    python -m zerolab.bench --quick               # seconds: a tiny GPT, 1 warm-up, 2 steps
    python -m zerolab.bench --json bench.json --plot bench.png

Seven strategies train the same GPT (same initial weights, same batches, AdamW with the same
settings) inside the *same* spawned ranks:

    zerolab DDP, ZeRO-1, ZeRO-2, ZeRO-3        (this package)
    torch DDP                                  (DistributedDataParallel)
    torch DDP + ZeroRedundancyOptimizer        (torch's ZeRO-1)
    torch FSDP2                                (fully_shard on every block and on the root)

Method, so that every figure can be checked:

- Time. All strategies are built side by side, then trained in rounds: each round runs one
  training step (forward, backward, optimizer step, zero_grad) of every strategy, in an order
  rotated every round, so that drift in the machine (another job, thermal throttling) hits all
  strategies alike. Each step starts at a barrier; its time is the slowest rank's. Warm-up
  rounds are dropped; the table shows the median of the measured rounds. No instrumentation is
  active while timing.
- Memory and traffic. A separate pass (the trackers add per-op overhead) runs one more step of
  each strategy under `zerolab.track_memory`, with a `categorize` for every strategy: the
  engines' `state_tensors()`, and for torch's the module's parameters, gradients and optimizer
  state. Peak = the largest total of live tensor bytes in the step, by category. Model-state
  bytes are read after the optimizer step, before zero_grad, from the live tensors.
- Bytes sent per rank per step: zerolab's from `record_comm`. torch's collectives do not go
  through zerolab.comm, so a dispatch mode (`CollectiveCounter`) sees each c10d collective torch
  issues (DDP's bucket all-reduces, ZeroRedundancyOptimizer's broadcasts, FSDP2's all-gathers
  and reduce-scatters) and applies the same ring formula as `record_comm`. The counter also
  runs on zerolab's engines, as a cross-check of the two methods.
- Correctness. After the last step every strategy's full parameters are compared with torch
  DDP's (the reference): the largest absolute difference must be at most `atol`
  (`tolerance` * lr: a small fraction of what one AdamW step moves a parameter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import zerolab
from zerolab.comm import ring_sent_bytes
from zerolab.memory import StateTensors, model_state_bytes, optimizer_tensors
from zerolab.models import GPT, GPTConfig, num_params

# ---- the strategies --------------------------------------------------------------------------

ZEROLAB_ENGINES = {"ddp": zerolab.DDP, "zero1": zerolab.ZeRO1, "zero2": zerolab.ZeRO2,
                   "zero3": zerolab.ZeRO3}
LABELS = {
    "ddp": "zerolab DDP",
    "zero1": "zerolab ZeRO-1",
    "zero2": "zerolab ZeRO-2",
    "zero3": "zerolab ZeRO-3",
    "torch_ddp": "torch DDP",
    "torch_ddp_zero": "torch DDP+ZeroRedundancyOpt",
    "torch_fsdp2": "torch FSDP2 fully_shard",
}
SHORT_LABELS = {"ddp": "zerolab\nDDP", "zero1": "zerolab\nZeRO-1", "zero2": "zerolab\nZeRO-2",
                "zero3": "zerolab\nZeRO-3", "torch_ddp": "torch\nDDP",
                "torch_ddp_zero": "torch\nDDP+ZeRO", "torch_fsdp2": "torch\nFSDP2"}  # plots
STRATEGIES = tuple(LABELS)
REFERENCE = "torch_ddp"  # whose final parameters every strategy is compared with
# Each zerolab engine against the torch strategy that does the same job, and the target
# (largest acceptable ratio of median step times) this benchmark checks.
COUNTERPARTS = {"ddp": "torch_ddp", "zero1": "torch_ddp_zero", "zero2": "torch_ddp",
                "zero3": "torch_fsdp2"}
TIME_TARGETS = {"ddp": 1.1, "zero1": 1.1, "zero2": 1.1, "zero3": 1.0}
MEMORY_TARGETS = {"zero3": 1.0}  # peak bytes per rank vs the counterpart's


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark. The defaults are the full run (>= 10M parameters, world size 2)."""

    world_size: int = 2  # ranks (spawned processes)
    vocab_size: int = 8192  # GPT vocabulary (with tied embeddings: vocab * n_embd parameters)
    block_size: int = 64  # tokens per sequence
    n_layer: int = 6  # transformer blocks (ZeRO-3 / FSDP2 units)
    n_head: int = 6  # attention heads
    n_embd: int = 384  # hidden size
    global_batch: int = 8  # sequences per step over all ranks (must divide by world_size)
    warmup: int = 2  # rounds run first and not timed (allocations, DDP's bucket rebuild)
    steps: int = 10  # timed rounds: one step of every strategy each
    lr: float = 1e-3  # AdamW learning rate, the same for every strategy
    weight_decay: float = 0.01  # AdamW weight decay
    bucket_mb: float = 25.0  # gradient bucket size for zerolab DDP/ZeRO-1/2 and torch DDP (MiB)
    strategies: tuple[str, ...] = STRATEGIES  # which to run (torch_ddp always: the reference)
    measure: bool = True  # run the memory/traffic pass
    tolerance: float = 0.05  # "matches": max |param - reference| <= tolerance * lr
    seed: int = 0  # initial weights and batches
    timeout: float = 1800.0  # seconds before the launch gives up on a stuck rank

    @property
    def atol(self) -> float:
        """Largest |param - reference param| that still matches: a fraction of one step.

        An AdamW step moves an element by about lr at most, so 0.05 * lr means no element is
        off by more than 5% of one step. At world size 2 every strategy here is bitwise equal
        to torch DDP (a sum of two numbers is exact in any order); at 3 or more ranks the
        reduction order differs and Adam turns rounding into differences around 1e-3 * lr.
        """
        return self.tolerance * self.lr

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         seed=self.seed)

    def check(self) -> None:
        unknown = set(self.strategies) - set(STRATEGIES)
        if unknown:
            raise ValueError(f"unknown strategies {sorted(unknown)}; choose from {STRATEGIES}")
        if self.global_batch % self.world_size:
            raise ValueError(f"global_batch={self.global_batch} must divide by "
                             f"world_size={self.world_size}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("need steps >= 1 and warmup >= 0")


QUICK = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
         "global_batch": 4, "warmup": 1, "steps": 2, "bucket_mb": 0.002}  # --quick: CI


# ---- progress on stderr ----------------------------------------------------------------------


class ProgressBar:
    """A one-line text progress bar: `bench [#########.........] 12/40 zero3`.

    On a terminal it redraws in place; elsewhere (CI logs) it prints a line every 10%.
    Called as `bar(done, total, label)`; `bar.message(text)` prints a line above it.
    """

    def __init__(self, title: str, stream: TextIO | None = None, width: int = 30):
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_tenth = -1  # non-terminal: last 10% mark printed
        self._line = ""  # what is on the terminal's current line now

    def __call__(self, done: int, total: int, label: str = "") -> None:
        frac = done / total if total else 1.0
        filled = int(round(self.width * frac))
        line = (f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{total} {label}").rstrip()
        if self.tty:
            self._draw(line)
            if done >= total:
                self._newline()
        elif int(frac * 10) > self._last_tenth or done >= total:
            self._last_tenth = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.tty and self._line:
            self.stream.write("\r" + " " * len(self._line) + "\r")
        self.stream.write(text + "\n")
        if self.tty and self._line:
            self.stream.write(self._line)
        self.stream.flush()

    def _draw(self, line: str) -> None:
        self.stream.write("\r" + line.ljust(len(self._line)))
        self.stream.flush()
        self._line = line

    def _newline(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self._line = ""


@dataclass(frozen=True)
class ProgressFile:
    """Rank 0's end of a progress bar drawn by another process: appends JSON lines to a file.

    Spawned ranks write their output to log files, so the launching process draws the bar
    (`follow_progress`). Same call signature as ProgressBar.
    """

    path: str  # the file the launcher follows

    def __call__(self, done: int, total: int, label: str = "") -> None:
        self._write({"done": done, "total": total, "label": label})

    def message(self, text: str) -> None:
        self._write({"message": text})

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


Progress = ProgressBar | ProgressFile


@contextlib.contextmanager
def follow_progress(bar: ProgressBar, poll_s: float = 0.1) -> Iterator[ProgressFile]:
    """Yield a ProgressFile for rank 0; a thread replays what it writes on `bar` meanwhile."""
    fd, path = tempfile.mkstemp(prefix="zerolab-progress-", suffix=".jsonl")
    os.close(fd)
    stop = threading.Event()

    def replay(f: TextIO) -> None:
        for line in f.readlines():
            if not line.endswith("\n"):  # a record still being written: read it next time
                f.seek(f.tell() - len(line.encode()))
                break
            record = json.loads(line)
            if "message" in record:
                bar.message(record["message"])
            else:
                bar(record["done"], record["total"], record["label"])

    def follow() -> None:
        with open(path) as f:
            while not stop.wait(poll_s):
                replay(f)
            replay(f)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield ProgressFile(path)
    finally:
        stop.set()
        thread.join(timeout=5)
        os.remove(path)


# ---- counting torch's collectives --------------------------------------------------------------


def _bytes(tensors: Any) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_bytes(t) for t in tensors)


# c10d op name -> (zerolab's op name, which argument holds the full tensor(s) S).
# S follows zerolab.comm: the all-reduced tensor, the all-gather's output, the reduce-scatter's
# input. Argument 0 is the output (or the in-place tensors), argument 1 the input.
C10D_OPS = {
    "allreduce_": ("all_reduce", 0),
    "allreduce_coalesced_": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),  # output: [[N tensors]]
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),  # input: [[N tensors]]
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "barrier": ("barrier", None),
}


class CollectiveCounter(TorchDispatchMode):
    """Sees every c10d collective issued on this rank (from Python or from C++, e.g. DDP's
    reducer) and adds up the ring-algorithm bytes this rank sends, like `record_comm` does.

        with CollectiveCounter() as counter:
            ...
        counter.sent_bytes, counter.by_op, counter.unknown_ops
    """

    def __init__(self) -> None:
        super().__init__()
        self.sent_bytes = 0  # ring-algorithm bytes this rank sent
        self.by_op: dict[str, int] = {}  # the same, per zerolab op name
        self.calls: dict[str, int] = {}  # number of calls per zerolab op name
        self.unknown_ops: list[str] = []  # c10d ops seen but not counted (none expected)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._count(func._opname, args)
        return func(*args, **(kwargs or {}))

    def _count(self, name: str, args: tuple) -> None:
        if name not in C10D_OPS:
            self.unknown_ops.append(name)
            return
        op, arg = C10D_OPS[name]
        if arg is None:
            return
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        tensors = args[arg]
        if name in ("allgather_", "reduce_scatter_"):  # lists of N chunks: S is their sum
            tensors = tensors[0]
        src = args[2] if op == "broadcast" else 0  # broadcast_(tensors, group, root_rank, ...)
        sent = ring_sent_bytes(op, _bytes(tensors), world_size, rank, src)
        self.sent_bytes += sent
        self.by_op[op] = self.by_op.get(op, 0) + sent
        self.calls[op] = self.calls.get(op, 0) + 1


# ---- one strategy under test ---------------------------------------------------------------------


class Contestant:
    """A model wrapped by one strategy, with one interface for training and for measuring."""

    def __init__(self, key: str, model: GPT):
        self.key = key
        self.model = model

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.model.loss(self(x), y)
        loss.backward()
        return loss.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def state_tensors(self) -> StateTensors:
        """{"params", "grads", "optimizer"}: what this rank holds now (for the trackers)."""
        raise NotImplementedError

    def full_params(self) -> dict[str, torch.Tensor]:
        """Full parameters, on every rank (a collective for the sharded strategies)."""
        raise NotImplementedError


class ZerolabContestant(Contestant):
    def __init__(self, key: str, model: GPT, config: BenchConfig):
        super().__init__(key, model)
        kwargs: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
        if key != "zero3":  # ZeRO-3 reduces per unit (one per block), not per bucket
            kwargs["bucket_bytes"] = int(config.bucket_mb * 2**20)
        self.engine = ZEROLAB_ENGINES[key](model, torch.optim.AdamW, **kwargs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.engine(x)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state_tensors(self) -> StateTensors:
        return self.engine.state_tensors()

    def full_params(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()


class TorchDDPContestant(Contestant):
    """torch's DistributedDataParallel with AdamW, or with ZeroRedundancyOptimizer(AdamW).

    gradient_as_bucket_view=True: the gradients are views into DDP's reduction buckets, as in
    zerolab's DDP (and faster than torch's default copy). zero_grad keeps the buffers
    (set_to_none=False), as zerolab's engines do, so the trackers see them at all times.
    """

    def __init__(self, key: str, model: GPT, config: BenchConfig, device: torch.device):
        super().__init__(key, model)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids,
                                           bucket_cap_mb=config.bucket_mb,
                                           gradient_as_bucket_view=True)
        kwargs = {"lr": config.lr, "weight_decay": config.weight_decay}
        self.optimizer: torch.optim.Optimizer
        self.inner_optimizer: torch.optim.Optimizer  # the one holding state on this rank
        if key == "torch_ddp_zero":
            zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW,
                                           parameters_as_bucket_view=True, **kwargs)
            self.optimizer, self.inner_optimizer = zero, zero.optim
        else:
            self.optimizer = self.inner_optimizer = torch.optim.AdamW(model.parameters(),
                                                                      **kwargs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ddp(x)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)

    def state_tensors(self) -> StateTensors:
        params = list(self.model.parameters())
        return {"params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.inner_optimizer)}

    def full_params(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


class TorchFSDP2Contestant(Contestant):
    """torch's FSDP2: fully_shard on every block, then on the root (zerolab ZeRO-3's units).

    At rest a parameter is a DTensor holding this rank's shard; while a unit runs, FSDP2
    registers plain, unsharded parameters in its place. `state_tensors` counts both as params.
    """

    def __init__(self, key: str, model: GPT, config: BenchConfig, device: torch.device):
        super().__init__(key, model)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.sharded = list(model.parameters())  # DTensors: the optimizer's parameters
        self.optimizer = torch.optim.AdamW(self.sharded, lr=config.lr,
                                           weight_decay=config.weight_decay)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def state_tensors(self) -> StateTensors:
        gathered = [p for p in self.model.parameters() if not _is_dtensor(p)]  # in flight
        return {"params": [_local(p) for p in self.sharded] + gathered,
                "grads": [_local(p.grad) for p in self.sharded if p.grad is not None],
                "optimizer": [_local(t) for t in optimizer_tensors(self.optimizer)]}

    def full_params(self) -> dict[str, torch.Tensor]:
        return {k: (v.full_tensor() if _is_dtensor(v) else v).detach().clone()
                for k, v in self.model.state_dict().items()}


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def make_contestant(key: str, config: BenchConfig, device: torch.device) -> Contestant:
    model = GPT(config.gpt_config()).to(device)  # same seed on every rank: same weights
    if key in ZEROLAB_ENGINES:
        return ZerolabContestant(key, model, config)
    if key == "torch_fsdp2":
        return TorchFSDP2Contestant(key, model, config, device)
    return TorchDDPContestant(key, model, config, device)


# ---- the worker: runs on every rank ------------------------------------------------------------


def local_batch(config: BenchConfig, model: GPT, round_index: int, rank: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of round `round_index`'s global batch (the same for every strategy)."""
    x, y = model.make_batch(config.global_batch, seed=config.seed * 100_003 + round_index)
    per_rank = config.global_batch // config.world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[rows].to(device), y[rows].to(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_worker(config: BenchConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Build every strategy on this rank, time them in rotation, measure, compare. Per rank."""
    ctx = zerolab.init_from_env()
    keys = [k for k in STRATEGIES if k in config.strategies or k == REFERENCE]
    contestants = {k: make_contestant(k, config, ctx.device) for k in keys}
    model = contestants[REFERENCE].model
    rounds = config.warmup + config.steps
    total = rounds * len(keys) + (len(keys) if config.measure else 0) + 1
    done = 0

    def report(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None and ctx.rank == 0:
            progress(done, total, label)

    # 1. Timing: one step of every strategy per round, in rotation, nothing instrumented.
    times: dict[str, list[float]] = {k: [] for k in keys}
    cpu_times: dict[str, list[float]] = {k: [] for k in keys}  # this process, all its threads
    for r in range(rounds):
        x, y = local_batch(config, model, r, ctx.rank, ctx.device)
        shift = r % len(keys)
        for key in keys[shift:] + keys[:shift]:
            c = contestants[key]
            dist.barrier()
            synchronize(ctx.device)
            start, cpu_start = time.perf_counter(), time.process_time()
            c.forward_backward(x, y)
            c.step()
            c.zero_grad()
            synchronize(ctx.device)
            times[key].append(time.perf_counter() - start)
            cpu_times[key].append(time.process_time() - cpu_start)
            report(f"{'warm-up' if r < config.warmup else 'step'} {r + 1}/{rounds} {key}")

    # 2. Memory and traffic: one more step of each, under the trackers.
    measured: dict[str, dict[str, Any]] = {}
    if config.measure:
        x, y = local_batch(config, model, rounds, ctx.rank, ctx.device)
        for key in keys:
            measured[key] = measure_step(contestants[key], x, y)
            report(f"memory and traffic {key}")

    # 3. Correctness: full parameters against the reference's.
    reference = contestants[REFERENCE].full_params()
    diffs = {k: max_abs_diff(contestants[k].full_params(), reference) for k in keys}
    report("compare parameters")
    return {"rank": ctx.rank, "times": times, "cpu_times": cpu_times, "measured": measured,
            "max_abs_diff": diffs,
            "params": num_params(model) if ctx.rank == 0 else None,
            "backend": ctx.backend, "device": str(ctx.device),
            "threads": torch.get_num_threads()}


def measure_step(c: Contestant, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One training step under the memory tracker and both traffic counters."""
    dist.barrier()
    with zerolab.record_comm() as log, CollectiveCounter() as counter, \
            zerolab.track_memory(c.state_tensors) as memory:
        c.forward_backward(x, y)
        c.step()
    state = model_state_bytes(c.state_tensors())  # after step, before zero_grad
    c.zero_grad()
    return {"peak_bytes": memory.peak_bytes, "peak_by_category": memory.peak_by_category,
            "device_peak_bytes": memory.device_peak_bytes, "model_state_bytes": state,
            "record_comm_bytes": log.total_bytes(),
            "record_comm_by_op": log.bytes_by_op(),
            "c10d_bytes": counter.sent_bytes, "c10d_by_op": counter.by_op,
            "c10d_calls": counter.calls, "c10d_unknown_ops": sorted(set(counter.unknown_ops))}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if sorted(a) != sorted(b):
        return math.inf
    return max(((a[k].float() - b[k].float()).abs().max().item() for k in a), default=0.0)


# ---- from per-rank results to one report ---------------------------------------------------------


def summarize(config: BenchConfig, per_rank: list[dict[str, Any]],
              load: tuple[list[float], list[float]], command: str) -> dict[str, Any]:
    """Combine the ranks' results: step time = the slowest rank's, per round; medians; targets."""
    keys = list(per_rank[0]["times"])
    rows: dict[str, dict[str, Any]] = {}
    for key in keys:
        timed = range(config.warmup, config.warmup + config.steps)
        step_times = [max(res["times"][key][i] for res in per_rank) for i in timed]
        diff = max(res["max_abs_diff"][key] for res in per_rank)
        row: dict[str, Any] = {
            "key": key, "label": LABELS[key], "counterpart": COUNTERPARTS.get(key),
            "step_times_s": step_times, "median_step_s": statistics.median(step_times),
            # CPU seconds per step of each rank's process (compute and gloo's threads): less
            # sensitive than wall time to other jobs on the machine.
            "median_cpu_s_per_rank": [statistics.median(res["cpu_times"][key][i] for i in timed)
                                      for res in per_rank],
            "max_abs_diff": diff, "matches_reference": diff <= config.atol,
        }
        if config.measure:
            m = [res["measured"][key] for res in per_rank]
            zl = key in ZEROLAB_ENGINES  # issues its collectives through zerolab.comm
            row.update({
                "peak_bytes_per_rank": [r["peak_bytes"] for r in m],
                "peak_by_category_per_rank": [r["peak_by_category"] for r in m],
                "device_peak_bytes_per_rank": [r["device_peak_bytes"] for r in m],
                "model_state_bytes_per_rank": [r["model_state_bytes"] for r in m],
                "sent_bytes_per_rank": [r["record_comm_bytes"] if zl else r["c10d_bytes"]
                                        for r in m],
                "sent_bytes_source": "zerolab.record_comm" if zl else
                "c10d collectives counted by CollectiveCounter, ring formula",
                "sent_by_op_per_rank": [r["record_comm_by_op"] if zl else r["c10d_by_op"]
                                        for r in m],
                "c10d_bytes_per_rank": [r["c10d_bytes"] for r in m],
                "c10d_calls_per_rank": [r["c10d_calls"] for r in m],
                "c10d_unknown_ops": sorted({op for r in m for op in r["c10d_unknown_ops"]}),
            })
        rows[key] = row
    targets = []
    for key, limit in TIME_TARGETS.items():
        other = COUNTERPARTS[key]
        if key in rows and other in rows:
            ratio = rows[key]["median_step_s"] / rows[other]["median_step_s"]
            # A check on noise: both ran in every round, seconds apart, so a machine that slows
            # down for a while slows both; the median of their per-round ratios cancels that.
            paired = statistics.median(a / b for a, b in zip(rows[key]["step_times_s"],
                                                             rows[other]["step_times_s"]))
            rows[key]["ratio_to_counterpart"] = ratio
            rows[key]["paired_ratio_to_counterpart"] = paired
            targets.append({"what": f"{LABELS[key]} step time / {LABELS[other]}",
                            "ratio": ratio, "paired_ratio": paired, "limit": limit,
                            "met": ratio <= limit})
    for key, limit in MEMORY_TARGETS.items():
        other = COUNTERPARTS[key]
        if config.measure and key in rows and other in rows:
            ratio = max(rows[key]["peak_bytes_per_rank"]) / max(rows[other]["peak_bytes_per_rank"])
            rows[key]["peak_ratio_to_counterpart"] = ratio
            targets.append({"what": f"{LABELS[key]} peak memory per rank / {LABELS[other]}",
                            "ratio": ratio, "limit": limit, "met": ratio <= limit})
    first = per_rank[0]
    return {
        "command": command,
        "config": {**asdict(config), "atol": config.atol},
        "model": {"params": first["params"], "gpt_config": asdict(config.gpt_config())},
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cores": os.cpu_count(),
            "backend": first["backend"], "device": first["device"],
            "threads_per_rank": first["threads"],
            "load_average_start": load[0], "load_average_end": load[1],
        },
        "method": {
            "step_time": "per round, the slowest rank's time from a barrier to the end of "
                         "zero_grad; median over the timed rounds; strategies rotated per round",
            "ratio": "median step time / the torch counterpart's; paired_ratio: median over "
                     "rounds of the two strategies' times in the same round",
            "torch_settings": "DistributedDataParallel(gradient_as_bucket_view=True, "
                              f"bucket_cap_mb={config.bucket_mb:g}); ZeroRedundancyOptimizer("
                              "parameters_as_bucket_view=True); fully_shard on each block, then "
                              "on the root (defaults); AdamW(lr, weight_decay) for all; "
                              "zero_grad(set_to_none=False) for DDP, as zerolab's engines keep "
                              "their gradient buffers",
            "memory": "zerolab.track_memory over one step (forward, backward, optimizer step), "
                      "separate from timing; peak = largest total of live tensor bytes",
            "model_state": "distinct storages of params, grads, optimizer state after step()",
            "sent_bytes": "ring-algorithm bytes this rank sends in one step: zerolab's from "
                          "record_comm, torch's from the c10d collectives it issues",
            "matches_reference": f"max |param - torch DDP's param| <= atol={config.atol:g} "
                                 "after the last step, same initial weights and batches",
        },
        "strategies": [rows[k] for k in keys],
        "targets": targets,
    }


def _in(n: float, scale: float) -> str:
    return f"{n / scale:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table, one strategy per row, then the targets."""
    rows = report["strategies"]
    cfg = report["config"]
    measured = "peak_bytes_per_rank" in rows[0]
    largest = max((max(r["peak_bytes_per_rank"]) for r in rows), default=0) if measured else 0
    unit, scale = ("KiB", 2**10) if 0 < largest < 2**20 else ("MiB", 2**20)
    header = ["strategy", "step ms", "vs torch", f"peak {unit}/rank",
              "  params/grads/optim/other", f"state {unit}/rank", f"sent {unit}/rank/step",
              "matches ref (max |diff|)"]
    lines = []
    for r in rows:
        ratio = r.get("ratio_to_counterpart")
        vs = f"{ratio:.2f}x {_short_key(r['counterpart'])}" if ratio is not None else "-"
        cells = [r["label"], f"{r['median_step_s'] * 1e3:.0f}", vs]
        if measured:
            k = max(range(len(r["peak_bytes_per_rank"])), key=r["peak_bytes_per_rank"].__getitem__)
            cat = r["peak_by_category_per_rank"][k]
            state = max(sum(s.values()) for s in r["model_state_bytes_per_rank"])
            cells += [_in(r["peak_bytes_per_rank"][k], scale),
                      "/".join(_in(cat.get(c, 0), scale)
                               for c in ("params", "grads", "optimizer", "other")),
                      _in(state, scale), _in(max(r["sent_bytes_per_rank"]), scale)]
        else:
            cells += ["-", "-", "-", "-"]
        cells.append(f"{'yes' if r['matches_reference'] else 'NO'} ({r['max_abs_diff']:.1e})")
        lines.append(cells)
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    out = [f"{report['model']['params']:,}-parameter GPT (n_layer={cfg['n_layer']}, "
           f"n_embd={cfg['n_embd']}, vocab={cfg['vocab_size']}, block={cfg['block_size']}), "
           f"world size {cfg['world_size']} ({report['environment']['backend']}, "
           f"{report['environment']['threads_per_rank']} thread/rank), global batch "
           f"{cfg['global_batch']}, {cfg['warmup']} warm-up + {cfg['steps']} timed rounds"]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    out.append(fmt.format(*header))
    out.append("  ".join("-" * w for w in widths))
    out += [fmt.format(*cells) for cells in lines]
    out.append("peak: the rank with the larger peak; sent: zerolab from record_comm, torch from "
               "its c10d collectives (ring formula)")
    if report["environment"]["backend"] == "gloo":
        out.append("gloo has no reduce-scatter: it runs an all-reduce (2(N-1)/N*S, not (N-1)/N*S) "
                   "where the table counts a reduce-scatter")
    if cfg["steps"] < 5:
        out.append(f"note: {cfg['steps']} timed round(s): the timings are indicative only")
    for t in report["targets"]:
        paired = (f" (median of per-round ratios {t['paired_ratio']:.2f})"
                  if "paired_ratio" in t else "")
        out.append(f"target {t['what']}: {t['ratio']:.2f}{paired} <= {t['limit']:.2f}: "
                   f"{'met' if t['met'] else 'MISSED'}")
    return "\n".join(out)


def _short_key(key: str | None) -> str:
    return {"torch_ddp": "DDP", "torch_ddp_zero": "DDP+ZeRO", "torch_fsdp2": "FSDP2"}.get(
        key or "", key or "")


def plot(report: dict[str, Any], path: str) -> None:
    """Step time, peak memory by category and bytes sent, stacked into one PNG at `path`."""
    import io

    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.image import imread, imsave

    from zerolab import plots

    rows = report["strategies"]
    labels = [SHORT_LABELS[r["key"]] for r in rows]
    fig = Figure(figsize=plots.FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(len(rows)), [r["median_step_s"] * 1e3 for r in rows],
           color=["#4c72b0" if r["key"] in ZEROLAB_ENGINES else "#999999" for r in rows])
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("Step time (slowest rank)")
    figures = [fig]
    if "peak_bytes_per_rank" in rows[0]:
        figures.append(plots.memory_bars(
            [r["peak_by_category_per_rank"][0] for r in rows], labels=labels,
            xlabel="strategy", title="Peak memory in one step, rank 0"))
        figures.append(plots.bytes_per_rank(
            {lab: r["sent_bytes_per_rank"] for lab, r in zip(labels, rows)},
            title="Bytes sent per rank in one step"))
    images = []
    for f in figures:
        png = io.BytesIO()
        f.savefig(png, format="png", dpi=100)
        png.seek(0)
        images.append(imread(png))  # (height, width, 4) floats in [0, 1]
    width = max(im.shape[1] for im in images)
    padded = [np.pad(im, ((0, 0), (0, width - im.shape[1]), (0, 0)), constant_values=1.0)
              for im in images]
    imsave(path, np.concatenate(padded, axis=0))


# ---- running it ----------------------------------------------------------------------------------


def run(config: BenchConfig, progress: bool = True, command: str = "") -> dict[str, Any]:
    """Launch the benchmark on `config.world_size` ranks; return the report (a dict)."""
    config.check()
    load_start = list(os.getloadavg())
    bar = ProgressBar("bench") if progress else None
    with follow_progress(bar) if bar else contextlib.nullcontext() as sink:
        per_rank = zerolab.launch(bench_worker, config.world_size, args=(config, sink),
                                  timeout=config.timeout)
    return summarize(config, per_rank, (load_start, list(os.getloadavg())), command)


def parse_args(argv: list[str] | None = None) -> tuple[BenchConfig, argparse.Namespace]:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="python -m zerolab.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="CI mode: a tiny GPT, 1 warm-up and 2 timed rounds (seconds)")
    p.add_argument("--world-size", type=int, default=d.world_size)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--global-batch", type=int, help="sequences per step over all ranks")
    p.add_argument("--warmup", type=int, help="untimed rounds first")
    p.add_argument("--steps", type=int, help="timed rounds")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--bucket-mb", type=float, help="gradient bucket size (MiB)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--no-measure", action="store_true", help="skip the memory/traffic pass")
    p.add_argument("--tolerance", type=float, default=d.tolerance,
                   help="matches when max |param - torch DDP's param| <= TOLERANCE * lr")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="write the figures as one PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    config = replace(BenchConfig(), **(QUICK if args.quick else {}))
    overrides = {name: getattr(args, name) for name in
                 ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "global_batch",
                  "warmup", "steps", "bucket_mb") if getattr(args, name) is not None}
    config = replace(config, **overrides, world_size=args.world_size, lr=args.lr,
                     tolerance=args.tolerance, seed=args.seed, measure=not args.no_measure,
                     strategies=tuple(s.strip() for s in args.strategies.split(",")))
    return config, args


def main(argv: list[str] | None = None) -> int:
    config, args = parse_args(argv)
    command = "python -m zerolab.bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = run(config, progress=not args.no_progress, command=command.strip())
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0 if all(r["matches_reference"] for r in report["strategies"]) else 1


if __name__ == "__main__":
    # Run the copy of this module imported as `zerolab.bench` (not `__main__`), so that the
    # spawned ranks find `bench_worker` and `BenchConfig` by their importable names.
    from zerolab.bench import main as _main

    sys.exit(_main())
