"""Notebook 08, activations: what ZeRO does not shard, measured, and what checkpointing buys.

In this process (no ranks needed: activations are each rank's own):
- `saved_one_step`: what one forward of the course GPT saves for backward, storage by storage
  (zerolab.activations);
- `sweep`: bytes per block against batch and sequence length, fused (SDPA) and explicit
  attention, next to theory's formula (`SweepPoint`s);
- `kept_with_checkpoints`: what the model keeps when a chosen set of blocks is checkpointed.

On ranks (`checkpointing_lesson`, launched by the notebook on 2 ranks): ZeRO-3 trains the same
GPT with each checkpointing, and
- measures each step's memory by category, "activations" included, and the recompute (block
  forward calls, attention-core calls, matmul FLOPs): `CheckpointRun`s;
- records the collectives of a step with and without checkpointing, prefetch on and off, with
  a "forward" span per block, inside backward too: `GatherRun`s;
- springs the trap: `Unguarded`, a ZeRO-3 whose forward hooks forget that a unit is in
  backward (`TrapRun`s);
- checks that every variant trains to the same weights.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from zerolab import activations, comm, engines, harness, theory
from zerolab.comm import CommLog, Span
from zerolab.memory import MemoryTrace, track_memory
from zerolab.models import GPT, GPTConfig
from zerolab.units import Unit
from zerolab.zero3 import ZeRO3

# 4 blocks of hidden size 64 and 4 heads (head_dim 16); block_size is set per run: it is the
# sequence length make_batch draws.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4, block_size=128)
SEQ_LENS = (32, 64, 128, 256, 512)  # tokens per sequence in the sweep
BATCHES = (1, 2, 4)  # sequences per rank in the sweep
RUN_SEQ, RUN_BATCH = 256, 2  # the checkpointing runs: long enough for the s² term to show
LR = 1e-3
ATTENTIONS, CHECKPOINTS = theory.ATTENTIONS, theory.CHECKPOINTS


def config(seq_len: int, attention: str = "sdpa", checkpoint: str = "none",
           base: GPTConfig = MODEL) -> GPTConfig:
    """The course GPT for sequences of `seq_len` tokens, with this attention and checkpointing."""
    return dataclasses.replace(base, block_size=seq_len, attention=attention,
                               checkpoint=checkpoint)


def block_formula(cfg: GPTConfig, batch: int, **kwargs) -> float:
    """theory.activation_bytes for one block of `cfg` (its attention and checkpointing)."""
    kwargs = {"attention": cfg.attention, "checkpoint": cfg.checkpoint, **kwargs}
    return theory.activation_bytes(cfg.block_size, batch, cfg.n_embd, cfg.n_head, **kwargs)


def model_formula(cfg: GPTConfig, batch: int) -> float:
    """Every block and the head, kept at the end of forward (fp32)."""
    return (cfg.n_layer * block_formula(cfg, batch)
            + theory.head_activation_bytes(cfg.block_size, batch, cfg.n_embd, cfg.vocab_size))


# ---- in this process: what autograd saves ----------------------------------------------------


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread inside the block. These models are tiny: on a busy machine,
    threads mostly wait for each other (the ranks of a launch get one core each already)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def saved_one_step(cfg: GPTConfig, batch: int,
                   name_savers: bool = False) -> activations.SavedActivations:
    """What one forward of GPT(cfg) on `batch` sequences saves for backward (then backward)."""
    model = GPT(cfg)
    x, y = model.make_batch(batch)
    with one_thread():
        return activations.measure(model, x, y, name_savers=name_savers)


@dataclass
class SweepPoint:
    """One (attention, batch, sequence length): measured bytes per block against the formula."""

    attention: str
    batch: int
    seq_len: int
    block: int  # bytes block 0 saved
    blocks_equal: bool  # every block saved as much as block 0
    formula: float  # theory.activation_bytes for one block
    total: int  # the whole model: blocks, embeddings and head
    total_formula: float  # model_formula


def sweep(attentions: Sequence[str] = ATTENTIONS, batches: Sequence[int] = BATCHES,
          seq_lens: Sequence[int] = SEQ_LENS, base: GPTConfig = MODEL) -> list[SweepPoint]:
    """Measure every combination (no checkpointing)."""
    points = []
    for attention in attentions:
        for b in batches:
            for s in seq_lens:
                cfg = config(s, attention, base=base)
                saved = saved_one_step(cfg, b)
                blocks = saved.blocks()
                points.append(SweepPoint(attention, b, s, blocks[0], len(set(blocks)) == 1,
                                         block_formula(cfg, b), saved.total,
                                         model_formula(cfg, b)))
    return points


class Checkpointed(nn.Module):
    """A block whose forward is recomputed in backward: it keeps only its input."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False)


def kept_with_checkpoints(cfg: GPTConfig, batch: int, blocks: Sequence[int]) -> int:
    """Bytes GPT(cfg) keeps for backward at the end of forward with `blocks` checkpointed."""
    model = GPT(cfg)
    for i in blocks:
        model.blocks[i] = Checkpointed(model.blocks[i])
    x, y = model.make_batch(batch)
    with one_thread():
        return activations.measure(model, x, y).total


def against_measured(fn: Callable[..., int], points: Sequence[SweepPoint]) -> list[str]:
    """Rows comparing a learner's bytes_saved(batch, seq_len, hidden, heads, attention) with the
    measured points (for exercise 8.1)."""
    rows = []
    for p in points:
        try:
            yours = f"{fn(p.batch, p.seq_len, MODEL.n_embd, MODEL.n_head, p.attention):>10,}"
            verdict = "equal" if int(yours.replace(",", "")) == p.block else "DIFFERENT"
        except NotImplementedError:
            yours, verdict = "not written yet", ""
        rows.append(f"{p.attention:8} b={p.batch} s={p.seq_len:<4} measured {p.block:>10,}"
                    f"  yours {yours}  {verdict}")
    return rows


# ---- on ranks: ZeRO-3 with and without checkpointing ---------------------------------------


@dataclass
class CheckpointRun:
    """One (attention, checkpointing) under ZeRO-3 on one rank: a tracked step and a counted one."""

    attention: str
    checkpoint: str
    memory: MemoryTrace  # live bytes by category over the tracked step, "activations" included
    kept: int  # the most bytes autograd held for backward (the end of forward)
    flops: int  # matmul FLOPs of a step, counted by FlopCounterMode (SDPA's CPU kernel is not)
    block_calls: int  # forward calls of the blocks in a step: 2 per block when each is recomputed
    attention_calls: int  # calls of the attention core (Block.attend), recomputes included
    losses: list[float]  # this rank's loss at each step
    weights: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # after the steps


@dataclass
class GatherRun:
    """One ZeRO-3 step (prefetch on or off, checkpointing or not) on one rank: its collectives."""

    prefetch: bool
    checkpoint: str
    early_stop: bool  # torch's default: a recompute stops once backward has what it needs
    log: CommLog  # every collective; a "forward" span for each whole block forward
    gathers: dict[str, int]  # all-gathers per phase and unit: {"fwd/blocks.0": 1, ...}
    ring_bytes: int  # log.total_ring_bytes(): the ring formula's bytes
    wire_bytes: int | None  # log.total_wire_bytes(): measured on the wire (None: not on Linux)
    weights: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)


@dataclass
class TrapRun:
    """`Unguarded` ZeRO-3 (prefetch on), every block checkpointed, one recorded step."""

    early_stop: bool  # torch's default recompute (True), or whole block forwards (False)
    gathers: dict[str, int]  # all-gathers per phase and unit, as far as the step got
    error: str | None  # what the step raised, if it did
    max_diff: float | None  # against ZeRO-3 without checkpointing, if the step finished


@dataclass
class CheckpointingLesson:
    """Everything notebook 08 measures on one rank."""

    runs: dict[tuple[str, str], CheckpointRun]  # (attention, checkpoint) -> run
    gathers: dict[tuple[bool, str], GatherRun]  # (prefetch, checkpoint) -> run
    timeline: GatherRun  # prefetch off, every block checkpointed, whole recomputes
    traps: list[TrapRun]  # the unguarded engine, early stop on and off
    max_diff: dict[str, float]  # variant -> largest |weight - weight without checkpointing|


def batch(model: GPT, step: int, per_rank: int = RUN_BATCH) -> tuple[torch.Tensor, ...]:
    """This rank's rows of step `step`'s global batch (per_rank * N sequences)."""
    n = dist.get_world_size()
    return harness.local_batch(model.make_batch, per_rank * n, 100 + step, dist.get_rank(), n)


@contextmanager
def count_calls(model: GPT) -> Iterator[Counter]:
    """Count block forward calls ("blocks") and attention-core calls ("attend") inside the block.

    The attention core is a method, not a module, so it gets no hooks: each block's `attend` is
    shadowed by a counting wrapper for the duration (forward and checkpoint both call
    self.attend, so recomputes are counted too)."""
    calls: Counter = Counter()

    def counted(attend: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def attend_and_count(*qkv: torch.Tensor) -> torch.Tensor:
            calls["attend"] += 1
            return attend(*qkv)
        return attend_and_count

    handles = [b.register_forward_pre_hook(lambda m, a: calls.update(["blocks"]))
               for b in model.blocks]
    for b in model.blocks:
        b.attend = counted(b.attend)  # an instance attribute hides the method
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()
        for b in model.blocks:
            del b.attend  # the class's method again


def checkpoint_run(attention: str, mode: str, seq_len: int = RUN_SEQ,
                   per_rank: int = RUN_BATCH) -> CheckpointRun:
    """ZeRO-3 on GPT(attention, mode): a warm-up step, a tracked step, a counted step."""
    model = GPT(config(seq_len, attention, mode))
    engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=LR)
    losses = [harness.train_step(engine, *batch(model, 0, per_rank)).item()]  # Adam's state
    engine.zero_grad()
    with track_memory(engine.state_tensors, activations=True) as trace:
        losses.append(harness.train_step(engine, *batch(model, 1, per_rank)).item())
    engine.zero_grad()
    with FlopCounterMode(display=False) as flops, count_calls(model) as calls:
        losses.append(harness.train_step(engine, *batch(model, 2, per_rank)).item())
    engine.zero_grad()
    return CheckpointRun(attention, mode, trace, trace.max_by_category["activations"],
                         flops.get_total_flops(), calls["blocks"], calls["attend"], losses,
                         engine.full_state_dict())


def gather_run(prefetch: bool, mode: str, seq_len: int = RUN_SEQ, per_rank: int = RUN_BATCH,
               early_stop: bool = True) -> GatherRun:
    """ZeRO-3 (SDPA) with `mode` checkpointing: a warm-up step, then a recorded step.

    early_stop=False runs each recompute to the end of the block (torch's default stops it
    once the saved tensors backward needs are back): only then does the block's forward hook,
    which ends its "forward" span, fire inside backward too.
    """
    model = GPT(config(seq_len, "sdpa", mode))
    engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=LR, prefetch=prefetch)
    with set_checkpoint_early_stop(early_stop):
        harness.train_step(engine, *batch(model, 0, per_rank))
        engine.zero_grad()
        step = harness.measured_step(engine, *batch(model, 1, per_rank), memory=False,
                                     forward_spans=model.blocks)
    gathers = Counter("/".join(e.tag.split("/")[1:]) for e in step.log.events
                      if e.op == "all_gather")  # "zero3/bwd/blocks.2" -> "bwd/blocks.2"
    return GatherRun(prefetch, mode, early_stop, step.log, dict(gathers),
                     step.log.total_ring_bytes(), step.log.total_wire_bytes(),
                     engine.full_state_dict())


@contextmanager
def _forgetting(unit: Unit) -> Iterator[None]:
    was, unit.in_backward = unit.in_backward, False
    try:
        yield
    finally:
        unit.in_backward = was


class Unguarded(ZeRO3):
    """ZeRO-3 whose forward hooks do their forward-time work even during a checkpoint's
    recompute in backward: prefetch the next unit, reshard this one. For showing the trap."""

    def pre_forward(self, unit: Unit) -> None:
        with _forgetting(unit):
            super().pre_forward(unit)

    def post_forward(self, unit: Unit, output) -> None:
        with _forgetting(unit):
            super().post_forward(unit, output)


def trap_run(early_stop: bool, reference: dict[str, torch.Tensor], seq_len: int = RUN_SEQ,
             per_rank: int = RUN_BATCH) -> TrapRun:
    """`gather_run` with the `Unguarded` engine; its error, if any, instead of raising."""
    model = GPT(config(seq_len, "sdpa", "block"))
    engine = Unguarded(model, torch.optim.AdamW, lr=LR)
    gathers: Counter = Counter()
    error, diff = None, None
    with set_checkpoint_early_stop(early_stop):
        try:  # both ranks fail alike, in their first backward, before any collective waits
            harness.train_step(engine, *batch(model, 0, per_rank))
            engine.zero_grad()
            with comm.record_comm() as log:
                harness.train_step(engine, *batch(model, 1, per_rank))
            gathers.update("/".join(e.tag.split("/")[1:]) for e in log.events
                           if e.op == "all_gather")
            diff = harness.max_diff(engine.full_state_dict(), reference)
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}".splitlines()[0]
    return TrapRun(early_stop, dict(gathers), error, diff)


def checkpointing_lesson(seq_len: int = RUN_SEQ, per_rank: int = RUN_BATCH,
                         base_modes: Sequence[str] = CHECKPOINTS) -> CheckpointingLesson:
    """Every run of the notebook's second half, on this rank (see the module docstring)."""
    runs = {(a, m): checkpoint_run(a, m, seq_len, per_rank)
            for a in ATTENTIONS for m in base_modes}
    gathers = {(p, m): gather_run(p, m, seq_len, per_rank)
               for p in (True, False) for m in ("none", "block")}
    timeline = gather_run(False, "block", seq_len, per_rank, early_stop=False)
    traps = [trap_run(stop, gathers[True, "none"].weights, seq_len, per_rank)
             for stop in (True, False)]
    max_diff = {f"{a}, {m}": harness.max_diff(runs[a, m].weights, runs[a, "none"].weights)
                for a, m in runs if m != "none"}
    for g in [*gathers.values(), timeline]:
        name = f"ZeRO-3 prefetch {'on' if g.prefetch else 'off'}, {g.checkpoint}"
        name += "" if g.early_stop else ", whole recomputes"
        max_diff[name] = harness.max_diff(g.weights, gathers[True, "none"].weights)
    for run in [*runs.values(), *gathers.values(), timeline]:
        run.weights = {}  # compared: no need to send them back
    return CheckpointingLesson(runs, gathers, timeline, traps, max_diff)


def gathers_per_phase(run: GatherRun) -> dict[str, int]:
    """All-gathers per phase: {"fwd": .., "bwd": ..}."""
    out: Counter = Counter()
    for key, count in run.gathers.items():
        out[key.split("/")[0]] += count
    return dict(out)


def with_recompute(log: CommLog, backward_only: bool = False) -> CommLog:
    """A copy of `log` in which the block forwards that ran inside backward are "recompute"
    spans, listed after the backward span (so that a timeline draws them on top of it).
    backward_only: keep only the backward, its recomputes and its collectives."""
    backward = [s for s in log.spans if s.name == "backward"]
    inside = [s for s in log.spans if s.name == "forward"
              and any(b.start <= s.start and s.end <= b.end for b in backward)]
    rest = backward if backward_only else [s for s in log.spans if s not in inside]
    events = [e for e in log.events if "/bwd/" in e.tag] if backward_only else log.events
    return dataclasses.replace(log, events=events, spans=rest + [
        Span("recompute", s.start, s.end) for s in inside])
