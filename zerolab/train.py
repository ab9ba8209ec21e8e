"""Train a tiny GPT on the built-in corpus with one of zerolab's engines, on real processes.

    python -m zerolab.train --engine zero3 --world-size 2 --steps 50
    torchrun --nproc-per-node 2 -m zerolab.train --engine zero3 --steps 20
    python -m zerolab.train --engine zero2 --trace trace.json     # open in ui.perfetto.dev

Without torchrun, the command spawns `--world-size` ranks itself (`zerolab.launch`: gloo on CPU,
NCCL with one GPU per rank). Under torchrun (which sets RANK and WORLD_SIZE) every process joins
the job with `zerolab.init_from_env()` and trains: the same code on one laptop or many nodes.

Each step draws one global batch of `world_size * batch_size` windows of the corpus (the same
on every rank, from the step's seed) and every rank trains on its own rows, so the losses do not
depend on the engine or on how the ranks were started. At the end it prints, per rank, the
model-state bytes held after the last optimizer step, the peak memory of the last step (tracked
with `zerolab.track_memory`, on that step only: the tracker slows every op) and the bytes each
rank sent per step (`zerolab.record_comm`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import zerolab
from zerolab import engines, harness
from zerolab.data import Corpus
from zerolab.launcher import choose_backend, finish_torchrun_job
from zerolab.launcher.progress import ProgressBar, ProgressFile, follow_progress
from zerolab.models import GPT, GPTConfig, num_params
from zerolab.wire.trace import save_chrome_trace

ENGINES = engines.STAGE_ENGINES  # the engines the command line offers


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Model sizes default to a GPT that learns the corpus in seconds."""

    engine: str = "zero3"  # ddp | zero1 | zero2 | zero3
    steps: int = 50  # optimizer steps
    world_size: int = 2  # ranks to spawn (ignored under torchrun, which decides)
    batch_size: int = 8  # sequences per rank per step
    block_size: int = 64  # characters per sequence
    n_layer: int = 2  # transformer blocks (ZeRO-3 units)
    n_head: int = 4  # attention heads
    n_embd: int = 64  # hidden size
    lr: float = 3e-3  # AdamW learning rate
    weight_decay: float = 0.01  # AdamW weight decay
    log_every: int = 10  # print the loss every this many steps (and at the first and last)
    seed: int = 0  # initial weights and the batches
    trace: str | None = None  # write a Chrome/Perfetto trace of every step here
    json: str | None = None  # write losses and the per-rank summary here
    backend: str | None = None  # spawn only: None picks nccl with a GPU per rank, else gloo
    progress: bool = True  # a progress bar on stderr

    def problems(self) -> list[str]:
        """What is wrong with this configuration, said per option (empty: nothing)."""
        found = []
        if self.engine not in ENGINES:
            found.append(f"unknown engine {self.engine!r}; choose from {list(ENGINES)}")
        for name in ("steps", "world_size", "batch_size", "block_size", "n_layer", "n_head",
                     "n_embd", "log_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                found.append(f"{name} must be a positive integer, got {value!r}")
        sizes = (self.n_head, self.n_embd)
        if all(isinstance(v, int) and v >= 1 for v in sizes) and self.n_embd % self.n_head:
            found.append(f"n_head={self.n_head} must divide n_embd={self.n_embd} (each head "
                         f"gets n_embd / n_head dimensions)")
        if not (math.isfinite(self.lr) and self.lr > 0):
            found.append(f"lr must be a positive number, got {self.lr!r}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            found.append(f"weight_decay must be a number >= 0, got {self.weight_decay!r}")
        tokens = len(Corpus.builtin().tokens)
        if isinstance(self.block_size, int) and self.block_size >= tokens:
            found.append(f"block_size={self.block_size} needs a text longer than the built-in "
                         f"corpus's {tokens} characters")
        if self.trace and self.trace == self.json:
            found.append(f"--trace and --json both write {self.trace}")
        if not under_torchrun() or os.environ.get("RANK") == "0":  # rank 0 writes them
            for path in (self.trace, self.json):
                problem = unwritable(path) if path else None
                if problem:
                    found.append(problem)
        return found

    def check(self) -> None:
        """Raise ValueError naming every problem (before any rank starts)."""
        found = self.problems()
        if found:
            raise ValueError("; ".join(found))


def unwritable(path: str) -> str | None:
    """Why `path` cannot be written (a missing folder, no permission, a directory), or None.
    Tried for real: opened for appending, and removed again if it did not exist."""
    if os.path.isdir(path):
        return f"{path} is a directory, not a file to write"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot write {path}: {e.strerror}"
    if not existed:
        os.remove(path)
    return None


def train_worker(config: TrainConfig,
                 progress: ProgressBar | ProgressFile | None = None) -> dict[str, Any] | None:
    """Train on this rank. Rank 0 returns the losses and every rank's summary; others None."""
    ctx = zerolab.init_from_env()
    corpus = Corpus.builtin()
    model_config = GPTConfig(vocab_size=corpus.tokenizer.vocab_size,
                             block_size=config.block_size, n_layer=config.n_layer,
                             n_head=config.n_head, n_embd=config.n_embd, seed=config.seed)
    model = GPT(model_config).to(ctx.device)
    params = num_params(model)  # before the engine shards it: Ψ, every parameter once
    engine = engines.make_engine(config.engine, model, torch.optim.AdamW, lr=config.lr,
                                 weight_decay=config.weight_decay)
    show = progress if ctx.rank == 0 else None

    def log(text: str) -> None:
        if show is not None:
            show.message(text)
        elif ctx.rank == 0:
            print(text, flush=True)

    log(f"{config.engine} on {ctx.world_size} rank(s) ({ctx.backend}), "
        f"{params:,} parameters, vocabulary of {corpus.tokenizer.vocab_size} chars")
    losses: list[float] = []
    start = time.perf_counter()
    with zerolab.record_comm() as comm_log:
        for step in range(config.steps):
            x, y = global_batch_rows(corpus, config, step, ctx.rank, ctx.world_size)
            x, y = x.to(ctx.device), y.to(ctx.device)
            last = step == config.steps - 1
            if last:  # the memory tracker slows every op: only the last step pays for it
                # (comm_log records this step too: every active recorder sees each collective)
                measured = harness.measured_step(engine, x, y)
                loss, memory, state_bytes = measured.loss, measured.memory, measured.held
            else:
                loss = harness.train_step(engine, x, y).item()
            mean_loss = torch.tensor(loss, device=ctx.device)
            dist.all_reduce(mean_loss)  # not zerolab.comm: logging, not training traffic
            losses.append(mean_loss.item() / ctx.world_size)
            if show is not None:
                show(step + 1, config.steps, f"loss {losses[-1]:.3f}")
            if step % config.log_every == 0 or last:
                log(f"step {step + 1:>4}/{config.steps}  loss {losses[-1]:.4f}")
    seconds = time.perf_counter() - start

    summary = {"rank": ctx.rank, "model_state_bytes": state_bytes,
               "peak_bytes": memory.peak_bytes, "peak_by_category": memory.peak_by_category,
               "device_peak_bytes": memory.device_peak_bytes,
               "sent_bytes_per_step": comm_log.total_ring_bytes() / config.steps,
               "sent_by_op_per_step": {op: b / config.steps
                                       for op, b in comm_log.bytes_by_op().items()},
               "collectives_per_step": len(comm_log.events) / config.steps}
    summaries = gather_to_rank0(summary, ctx.rank, ctx.world_size)
    logs = gather_to_rank0(comm_log, ctx.rank, ctx.world_size) if config.trace else None
    if ctx.rank != 0:
        return None
    if logs is not None:
        save_chrome_trace(config.trace, logs)
    return {"config": asdict(config), "params": params, "world_size": ctx.world_size,
            "backend": ctx.backend, "seconds": seconds, "losses": losses,
            "ranks": summaries}


def global_batch_rows(corpus: Corpus, config: TrainConfig, step: int, rank: int,
                      world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's global batch (identical on every rank before slicing)."""
    def make_batch(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return corpus.batch(batch_size, config.block_size, seed)

    x, y = harness.local_batch(make_batch, world_size * config.batch_size,
                               config.seed * 1_000_003 + step, rank, world_size)
    return x, y


def gather_to_rank0(obj: Any, rank: int, world_size: int) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
    if world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def format_summary(result: dict[str, Any]) -> str:
    """Loss at the start and end, then per rank: memory held, peak, and traffic."""
    losses = result["losses"]
    mib = 2**20
    lines = [f"trained {result['config']['engine']} on {result['world_size']} rank(s) "
             f"({result['backend']}): {len(losses)} steps in {result['seconds']:.1f} s, "
             f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
             "rank  state MiB (params/grads/optim)  peak MiB last step (params/grads/optim/"
             "other)  sent MiB/step (by op)"]
    for s in result["ranks"]:
        st, pk = s["model_state_bytes"], s["peak_by_category"]
        state = "/".join(f"{st[c] / mib:.2f}" for c in ("params", "grads", "optimizer"))
        peak = "/".join(f"{pk.get(c, 0) / mib:.2f}"
                        for c in ("params", "grads", "optimizer", "other"))
        ops = ", ".join(f"{op} {b / mib:.2f}" for op, b in s["sent_by_op_per_step"].items())
        lines.append(f"{s['rank']:>4}  {sum(st.values()) / mib:6.2f} ({state})  "
                     f"{s['peak_bytes'] / mib:6.2f} ({peak})  "
                     f"{s['sent_bytes_per_step'] / mib:.2f} ({ops})")
    return "\n".join(lines)


def under_torchrun() -> bool:
    """torchrun (and other launchers) describe the job in RANK and WORLD_SIZE."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run(config: TrainConfig) -> dict[str, Any] | None:
    """Train; return rank 0's result (None on the other ranks under torchrun)."""
    config.check()
    if under_torchrun():
        bar = ProgressBar(f"train {config.engine}") if config.progress else None
        result = train_worker(config, bar)
        # Every rank finishes its collectives before any tears the group down (a rank that
        # destroys it while a peer's last collective is in flight can abort at exit).
        finish_torchrun_job()
        return result
    bar = ProgressBar(f"train {config.engine}") if config.progress else None
    with follow_progress(bar) if bar else contextlib.nullcontext() as sink:
        # The launch's timeout is an idle one: hung ranks are stopped, long training is not.
        results = zerolab.launch(train_worker, config.world_size, args=(config, sink),
                                 backend=config.backend)
    if not config.progress:  # the ranks' loss log went to their own logs: print it here
        for i, loss in enumerate(results[0]["losses"]):
            if i % config.log_every == 0 or i == len(results[0]["losses"]) - 1:
                print(f"step {i + 1:>4}/{config.steps}  loss {loss:.4f}")
    return results[0]


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The command line as a TrainConfig; a usage error (exit status 2) for any bad value, an
    unwritable --json or --trace included, before anything is trained."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m zerolab.train",
                                description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=list(ENGINES), help=f"default: {d.engine}")
    # --strategy: --engine's old name, kept for one release (not in --help).
    p.add_argument("--strategy", choices=list(ENGINES), help=argparse.SUPPRESS)
    p.add_argument("--steps", type=positive_int, default=d.steps)
    p.add_argument("--world-size", type=positive_int, default=d.world_size,
                   help="ranks to spawn (ignored under torchrun)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="sequences per rank per step")
    p.add_argument("--block-size", type=positive_int, default=d.block_size)
    p.add_argument("--n-layer", type=positive_int, default=d.n_layer)
    p.add_argument("--n-head", type=positive_int, default=d.n_head,
                   help="attention heads (must divide --n-embd)")
    p.add_argument("--n-embd", type=positive_int, default=d.n_embd)
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--log-every", type=positive_int, default=d.log_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace")
    p.add_argument("--json", metavar="PATH", help="write losses and the summary as JSON")
    p.add_argument("--backend", choices=["gloo", "nccl"], help="spawn only (default: auto)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    a = p.parse_args(argv)
    engine = a.engine or d.engine
    if a.strategy is not None:
        # FutureWarning, not DeprecationWarning: Python shows it to whoever runs the command.
        warnings.warn("--strategy is deprecated and will be removed in the next release: use "
                      f"--engine {a.strategy}", FutureWarning, stacklevel=2)
        if a.engine not in (None, a.strategy):
            p.error(f"--strategy {a.strategy} and --engine {a.engine} disagree: give --engine "
                    f"alone (--strategy is its old name)")
        engine = a.strategy
    config = TrainConfig(engine=engine, steps=a.steps, world_size=a.world_size,
                         batch_size=a.batch_size, block_size=a.block_size, n_layer=a.n_layer,
                         n_head=a.n_head, n_embd=a.n_embd, lr=a.lr, log_every=a.log_every,
                         seed=a.seed, trace=a.trace, json=a.json, backend=a.backend,
                         progress=not a.no_progress)
    problems = config.problems()
    if not under_torchrun():
        try:  # NCCL without a GPU per rank, refused now rather than by the launch
            choose_backend(config.world_size, config.backend)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        p.error("; ".join(problems))
    return config


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    result = run(config)
    if result is None:  # not rank 0 under torchrun: rank 0 reports
        return 0
    print(format_summary(result))
    if config.trace:
        print(f"wrote {config.trace}")
    if config.json:
        with open(config.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {config.json}")
    return 0


if __name__ == "__main__":
    # Run the copy of this module imported as `zerolab.train` (not `__main__`), so that the
    # spawned ranks find `train_worker` and `TrainConfig` by their importable names.
    from zerolab.train import main as _main

    sys.exit(_main())
