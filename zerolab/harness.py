"""One training step, and one *measured* training step: what lessons, CLI, bench and tests run.

    engine = zerolab.engines.make_engine("zero2", model, lr=1e-3)
    x, y = harness.local_batch(model.make_batch, global_batch=8, seed=step, rank=r, world_size=n)
    m = harness.measured_step(engine, x, y)     # forward, backward, step: measured
    m.loss, m.held, m.memory.peak_bytes, m.log.events, m.log.total_wire_bytes()

A measured step is an ordinary step inside two recorders: `record_comm` (every collective,
with its bytes and times, and a span for forward, backward and step) and `track_memory`
(every live tensor by category, over time). Model-state bytes are read after `step()` and
before `zero_grad()`, when a rank holds the most state. Nothing else in zerolab writes a
training step: a figure in a notebook, in `python -m zerolab.bench` and in the tests comes
from this file.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerolab import comm
from zerolab.comm import CommLog, Span
from zerolab.engines import Engine
from zerolab.memory import MemoryTrace, track_memory


def local_batch(make_batch: Callable[..., tuple[torch.Tensor, ...]], global_batch: int, seed: int,
                rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows of one global batch, drawn the same on every rank from `seed`.

    make_batch(batch_size, seed=...) -> tensors with the batch first (a model's make_batch).
    """
    return local_rows(make_batch(global_batch, seed=seed), rank, world_size)


def local_rows(batch: Sequence[torch.Tensor], rank: int,
               world_size: int) -> tuple[torch.Tensor, ...]:
    """Rank r's rows [r * per_rank, (r + 1) * per_rank) of each tensor of a global batch.

    The ranks together see the whole global batch once, as one process training on it would.
    """
    global_batch = len(batch[0])
    if global_batch % world_size:
        raise ValueError(f"a global batch of {global_batch} does not split over {world_size} "
                         f"ranks: choose a multiple of the world size")
    per_rank = global_batch // world_size
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return tuple(t[rows] for t in batch)


def train_step(engine: Engine, x: torch.Tensor, y: torch.Tensor,
               loss_fn: Callable[..., torch.Tensor] | None = None, *,
               forward_span: bool = True, zero_grad: bool = True, micro_batches: int = 1,
               no_sync: bool = True) -> torch.Tensor:
    """Forward, backward, optimizer step (each marked as a span for the recorders), then
    zero_grad unless zero_grad=False (to read the gradients, or what a rank holds after step).

    loss_fn(output, y): default, the model's own `loss`. Returns the (detached) mean loss.
    micro_batches > 1: gradient accumulation. x and y are cut into that many micro-batches
    (dim 0), each runs forward and backward with its loss divided by micro_batches (so that
    the gradients add up to the mean), then one step. no_sync: every backward but the last
    communicates nothing (engine.no_sync()); otherwise each reduces its own gradients and the
    step takes their sum, on every engine (as torch's DDP). torch's baselines have no no_sync().
    """
    loss_fn = loss_fn or engine.module.loss
    if micro_batches < 1 or x.shape[0] % micro_batches:
        raise ValueError(f"micro_batches={micro_batches} must divide the batch's {x.shape[0]} "
                         f"rows: equal micro-batches, or the gradient is not the batch's mean")
    losses = []
    for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        quiet = no_sync and i < micro_batches - 1
        with engine.no_sync() if quiet else contextlib.nullcontext():
            with comm.span("forward") if forward_span else contextlib.nullcontext():
                loss = loss_fn(engine(xs), ys)
                # Not divided by 1: the plain step stays op for op what it was.
                loss = loss / micro_batches if micro_batches > 1 else loss
            with comm.span("backward"):
                loss.backward()
        losses.append(loss.detach())
    with comm.span("step"):
        engine.step()
    if zero_grad:
        engine.zero_grad()
    return torch.stack(losses).sum()


@dataclass
class MeasuredStep:
    """What one training step did on one rank, measured."""

    loss: float  # this rank's loss on its own rows
    log: CommLog  # every collective (bytes, times) and the forward / backward / step spans
    memory: MemoryTrace | None  # live bytes by category over the step (None: not tracked)
    held: dict[str, int]  # model-state bytes after step(), before zero_grad()

    def phases(self) -> list[Span]:
        """The log's spans on the memory trace's clock (seconds from its first sample)."""
        if self.memory is None:
            return list(self.log.spans)
        shift = self.log.t0 - self.memory.t0 - self.memory.samples[0][0]
        return [Span(s.name, s.start + shift, s.end + shift) for s in self.log.spans]


def measured_step(engine: Engine, x: torch.Tensor, y: torch.Tensor, *, memory: bool = True,
                  zero_grad: bool = True, forward_spans: Sequence[nn.Module] = (),
                  loss_fn: Callable[..., torch.Tensor] | None = None) -> MeasuredStep:
    """One training step under the comm recorder and (memory=True) the memory tracker.

    Every rank of the engine's group must call it (the recorder starts at a barrier, so that
    the ranks' clocks line up). forward_spans: modules whose forward each becomes a span of
    its own (the blocks, to see a gather wait for its block) instead of one "forward" span.
    The memory tracker inspects every op: keep it off where the timing matters.
    """
    # The recorder lines up the clocks of the engine's whole job (HSDP's spans several groups).
    group = engine.job_group
    tracker = track_memory(engine.state_tensors) if memory else contextlib.nullcontext()
    with comm.record_comm(group) as log, tracker as trace:
        hooks = _span_hooks(forward_spans, log)
        try:  # with per-module spans, those stand for the forward
            loss = train_step(engine, x, y, loss_fn, forward_span=not forward_spans,
                              zero_grad=False)
            # ZeRO-1/2 gather parameters asynchronously after step(): finish them here, so
            # that every byte this step sends is in its log.
            engine.wait_params()
        finally:
            for h in hooks:
                h.remove()
    held = engine.model_state_bytes()
    if zero_grad:
        engine.zero_grad()
    return MeasuredStep(loss.item(), log, trace, held)


def _span_hooks(modules: Sequence[nn.Module], log: CommLog) -> list[Any]:
    """Forward hooks that add a "forward" span to `log` for each module's own compute.

    Registered after the engine's hooks, so they run after ZeRO-3 has gathered the module
    (pre-hooks run in registration order) and after it has freed it (post-hooks too).
    """
    starts: dict[nn.Module, float] = {}

    def before(module: nn.Module, args: Any) -> None:
        starts[module] = log.now()

    def after(module: nn.Module, args: Any, output: Any) -> None:
        log.spans.append(Span("forward", starts.pop(module), log.now()))

    return [h for m in modules
            for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The distance every comparison uses: the largest |a - b| over two state dicts' tensors."""
    if sorted(a) != sorted(b):
        raise ValueError(f"the state dicts differ in keys: {sorted(set(a) ^ set(b))}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
