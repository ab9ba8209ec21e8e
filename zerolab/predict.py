"""A rank's peak in one training step, predicted without building the model.

    p = zerolab.predict.peak(lambda: GPT(config), "zero3", world_size=8, batch_size=1,
                             param_dtype=torch.bfloat16)
    p.peak_bytes, p.phase, p.rows      # the ledger's rows (zerolab.ledger.ROWS), predicted

"Will my model fit on N GPUs at stage k?" A formula (theory.py) counts model states; the peak
a rank measures (zerolab.ledger) holds more: activations, gradients on their way to a bucket,
a unit gathered and the next one prefetched, a gradient buffer being reduce-scattered. Here
the model is built under torch's FakeTensorMode (tensors with a shape, a dtype and a device,
and no memory), one forward and backward run on it, and a `Schedule` (one class per stage,
each overriding the one before, as ddp.py -> zero1.py -> zero2.py -> zero3.py do) replays
what the engine holds at each moment of that run, in the same hooks the engine uses:

- what autograd makes is real (fake) tensors, followed as zerolab.memory follows live ones:
  every op's outputs, a finalizer on each storage; a storage autograd saves for backward is an
  activation, one made in backward an activation's gradient, or a parameter's (grads);
- what the engine holds (parameters, flat buffers, shards, optimizer state, the buffers a
  collective is using) is counted by the schedule from the flat layouts (sharding.py) and the
  units (units.py) the engine itself would build: bytes with no tensor behind them.

The peak is the largest total seen after any op or any change the schedule makes; the rows
are what was alive then, by the ledger's categories, padding apart. The step is counted by
the schedule, not run: AdamW's temporaries on its tiles (parts/tiles.py) and, in mixed
precision, the fp32 copies of this rank's gradients (parts/mixed_precision.py). What it
assumes: the engine as zerolab runs it (gloo's reduce-scatter scratch with `gloo=True`),
AdamW, its state already made (any step after the first), one backward per step (no
accumulation). Checked against the ledger (tests/test_predict.py) without checkpointing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from zerolab.ddp import DEFAULT_BUCKET_BYTES
from zerolab.ledger import ROWS
from zerolab.memory import SavedForBackward
from zerolab.models import GPT, GPT_7B, GPTConfig
from zerolab.parts.mixed_precision import MixedPrecisionPolicy
from zerolab.parts.nest import tensors_in
from zerolab.parts.tiles import CPU_TILE_NUMEL
from zerolab.schedules import SCHEDULES, Schedule
from zerolab.theory import stage_name


@dataclass
class Prediction:
    """One rank's predicted peak, every byte in a row (the ledger's rows)."""

    stage: str
    world_size: int
    peak_bytes: int
    rows: dict[str, int]  # ROWS -> bytes at the peak
    phase: str  # "forward", "backward" or "step"
    num_params: int  # Ψ, distinct parameters
    samples: int = 0  # moments looked at (every op, every change the schedule made)

    def table(self) -> list[str]:
        lines = [f"{row:22}{b:>16,} B {100 * b / self.peak_bytes:6.2f}%"
                 for row, b in self.rows.items()]
        return lines + [f"{'= peak (' + self.phase + ')':22}{self.peak_bytes:>16,} B"]


class Timeline(TorchDispatchMode):
    """Follows every storage an op makes under FakeTensorMode (its bytes, the phase it was made
    in, whether autograd holds it), adds the schedule's bytes, and keeps the largest total.
    The ledger's tracker (ledger.py) on live tensors; these have a size and no memory."""

    def __init__(self, schedule: Schedule):
        super().__init__()
        self.schedule = schedule
        self.ignored: set[int] = set()  # the model's own parameters: the schedule counts them
        # id(storage) -> (bytes, the phase it was made in, a weak reference to it)
        self.live: dict[int, tuple[int, str, weakref.ref]] = {}
        self.held: dict[int, int] = {}  # storages autograd saved: how many saves
        self.param_grads: set[int] = set()  # storages a parameter's gradient hook saw
        self.phase = "forward"
        self.live_bytes, self.samples = 0, 0
        k = len(schedule.n)  # one peak per world size
        self.peak = np.full(k, -1, dtype=np.int64)
        self.rows: list[dict[str, int]] = [{} for _ in range(k)]
        self.peak_phase = ["forward"] * k
        # At each peak, what was made in backward and is no parameter's gradient yet: one may
        # be, once its parameter's hook sees it (the ledger's rule: a gradient only now).
        self.maybe_grads: list[dict[int, tuple[weakref.ref, int]]] = [{} for _ in range(k)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any([self.watch(t) for t in tensors_in(out)]):  # frees alone never make a peak
            self.sample()
        return out

    def watch(self, t: torch.Tensor) -> bool:
        """Follow t's storage if it is new; whether it was."""
        storage = t.untyped_storage()
        key = id(storage)  # one Python object per live storage, fake ones too
        if key in self.live or key in self.ignored:
            return False
        self.live[key] = (storage.nbytes(), self.phase, weakref.ref(storage))
        self.live_bytes += storage.nbytes()
        weakref.finalize(storage, self._freed, key)
        return True

    def _freed(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key)[0]
        self.schedule.listed.pop(key, None)  # ids are reused once a storage is freed
        self.held.pop(key, None)
        self.param_grads.discard(key)

    def note_grad(self, grad: torch.Tensor) -> None:
        """A parameter's gradient, before the engine takes it in (a hook on the parameter);
        alive at a peak as an activation grad, it was a gradient there."""
        storage = grad.untyped_storage()
        self.param_grads.add(id(storage))
        for i, maybe in enumerate(self.maybe_grads):
            ref, nbytes = maybe.get(id(storage), (None, 0))
            if ref is not None and ref() is storage:
                del maybe[id(storage)]
                self.rows[i]["activation grads"] -= nbytes
                self.rows[i]["grads"] += nbytes

    def saved(self, t: torch.Tensor) -> int:
        self.watch(t)
        key = id(t.untyped_storage())
        self.held[key] = self.held.get(key, 0) + 1
        return key

    def released(self, key: int) -> None:
        if key in self.held:
            self.held[key] -= 1
            if not self.held[key]:
                del self.held[key]

    def category(self, key: int, made: str) -> str:
        """The ledger's order: what the engine names, what autograd holds, then by phase."""
        if key in self.schedule.listed:
            return self.schedule.listed[key]
        if key in self.held:
            return "activations"
        if made == "backward":
            return "grads" if key in self.param_grads else "activation grads"
        return "forward temporaries" if made == "forward" else "step temporaries"

    def sample(self) -> None:
        """The total now, at every world size; at a new peak, what is alive, by row."""
        self.samples += 1
        total = self.live_bytes + sum(self.schedule.bytes.values())
        higher = np.flatnonzero(total > self.peak)
        if not len(higher):
            return
        live = dict.fromkeys(ROWS, 0)  # the same at every world size
        maybe: dict[int, tuple[weakref.ref, int]] = {}
        for key, (nbytes, made, ref) in self.live.items():
            category = self.category(key, made)
            live[category] += nbytes
            if category == "activation grads":
                maybe[key] = (ref, nbytes)
        for i in higher:
            self.maybe_grads[i] = dict(maybe)
            rows = dict(live)
            for category, nbytes in self.schedule.bytes.items():
                rows[category] += int(nbytes[i])  # what the engine holds at this world size
            for category, nbytes in self.schedule.padding.items():
                rows[category] -= int(nbytes[i])
                rows["padding"] += int(nbytes[i])
            self.peak[i], self.rows[i], self.peak_phase[i] = total[i], rows, self.phase


def peak(build: Callable[[], nn.Module], stage: str | int, world_size: int, batch_size: int,
         **kwargs) -> Prediction:
    """One rank's peak in a training step of `build()` under `stage` at `world_size`, on
    `batch_size` rows of the model's own batch, predicted (`peaks`' keywords)."""
    return peaks(build, stage, [world_size], batch_size, **kwargs)[0]


def peaks(build: Callable[[], nn.Module], stage: str | int, world_sizes: Sequence[int],
          batch_size: int, *, param_dtype: torch.dtype | None = None, rank: int = 0,
          seq_len: int | None = None, tile_numel: int | None = CPU_TILE_NUMEL,
          gloo: bool = True, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Prediction]:
    """One rank's peak in a training step of `build()` wrapped in `stage`, at each of
    `world_sizes`, on `batch_size` rows of the model's own `make_batch`, predicted: nothing is
    allocated. One forward and backward serves every world size.

    build: makes the model; it is called under torch.device("meta") (zerolab's models skip
    their initialisation there), and its tensors become fake CPU ones. param_dtype: None (fp32)
    or a 16-bit dtype (mixed precision, fp32 masters). seq_len: cut the batch's sequences to
    this length. tile_numel: the optimizer's tiles (parts/tiles.py; None on a GPU: whole
    tensors). gloo: count gloo's reduce-scatter scratch (False: NCCL's, not in torch's memory).
    """
    stage = stage_name(stage)
    if stage not in SCHEDULES:
        raise ValueError(f"no schedule for {stage!r}; expected one of {list(SCHEDULES)}")
    if not world_sizes or min(world_sizes) < 1 or not 0 <= rank < min(world_sizes):
        raise ValueError(f"need world sizes of at least 1 and 0 <= rank < each; got rank "
                         f"{rank}, world sizes {list(world_sizes)}")
    with torch.device("meta"):
        model = build()
    tokens = batch(model, batch_size, seq_len)  # real: a few int64 tokens
    inputs = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tokens}.values())
    with FakeTensorMode() as fake:
        _fake_tensors(model, param_dtype)
        x, y = (fake.from_tensor(t) for t in tokens)
        schedule = SCHEDULES[stage](model, world_sizes, rank, tile_numel=tile_numel,
                                    mixed=param_dtype is not None, gloo=gloo,
                                    bucket_bytes=bucket_bytes)
        timeline = schedule.timeline = Timeline(schedule)
        timeline.ignored |= {id(t.untyped_storage()) for t in [*model.parameters(), x, y]}
        schedule.hold()
        schedule.add("inputs", inputs)
        schedule.add("buffers", sum(b.nbytes for b in model.buffers()))
        handles = schedule.install() + [  # the ledger's own hook: a parameter's gradient
            p.register_hook(timeline.note_grad)
            for p in model.parameters() if p.requires_grad]
        try:
            _step(model, x, y, MixedPrecisionPolicy(param_dtype), schedule, timeline)
        finally:
            for h in handles:
                h.remove()
    psi = sum(p.numel() for p in model.parameters())
    return [Prediction(stage, n, int(timeline.peak[i]), timeline.rows[i], timeline.peak_phase[i],
                       psi, timeline.samples) for i, n in enumerate(world_sizes)]


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, policy: MixedPrecisionPolicy,
          schedule: Schedule, timeline: Timeline) -> None:
    """ledger.measure's step, on fake tensors: forward, backward, then the step's moments."""
    with timeline, SavedForBackward(timeline.saved, timeline.released):
        loss = model.loss(policy.forward(model, (x,), {}), y)  # the engine's forward
        timeline.phase = "backward"
        loss.backward()
        schedule.finish_backward()
        timeline.phase = "step"
        timeline.sample()
        for extra in schedule.step_moments():  # each for a moment, then gone
            for category, nbytes in extra.items():
                schedule.add(category, nbytes)
            timeline.sample()
            for category, nbytes in extra.items():
                schedule.add(category, -nbytes)


def _fake_tensors(model: nn.Module, param_dtype: torch.dtype | None) -> None:
    """Every parameter and buffer of a meta model made a fake CPU tensor (inside FakeTensorMode),
    in param_dtype if floating and given, as the engine casts; a tied parameter stays one."""
    made: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            dtype = param_dtype if param_dtype is not None and t.is_floating_point() else t.dtype
            new = torch.empty(t.shape, dtype=dtype, device="cpu")
            made[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(
                t, nn.Parameter) else new
        return made[id(t)]

    for module in model.modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in own:
            setattr(module, name, fake(t))  # nn.Module's own: a parameter stays one, a buffer one


def batch(model: nn.Module, batch_size: int, seq_len: int | None = None,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y): the model's own batch (make_batch), its sequences cut to seq_len if given. Made
    for real: its storages are the ledger's "inputs" (a GPT's x and y are views of one
    (batch, seq + 1) tensor of tokens); a measured step on this batch is what `peak` predicts."""
    x, y = model.make_batch(batch_size, seed=seed)
    if seq_len is not None:
        tokens = torch.cat([x[:, :1], y], dim=1)[:, :seq_len + 1].contiguous()
        x, y = tokens[:, :-1], tokens[:, 1:]
    return x, y


# ---- the 7B table -------------------------------------------------------------------------------

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def gpu_job(config: GPTConfig, world_sizes: Sequence[int], *, batch_size: int = 1,
            seq_len: int | None = None, param_dtype: torch.dtype | None = torch.bfloat16,
            stages: Sequence[str] = STAGES) -> dict[str, list[Prediction]]:
    """Every stage's predicted peak for a GPT of `config` at each world size, as a GPU job runs
    zerolab's engines: whole tensors for the optimizer (no CPU tiles), NCCL's reduce-scatter
    (no gloo scratch). One fake forward and backward per stage."""
    return {stage: peaks(lambda: GPT(config), stage, world_sizes, batch_size,
                         param_dtype=param_dtype, seq_len=seq_len, tile_numel=None, gloo=False)
            for stage in stages}


def table_7b(world_sizes: Sequence[int] = (8, 64), seq_len: int = 4096,
             batch_size: int = 1) -> dict[str, list[Prediction]]:
    """The 7B (models.GPT_7B) in bf16 mixed precision with AdamW, `batch_size` sequences of
    `seq_len` tokens per rank: each stage's predicted peak per rank, by row, at each world
    size. A few seconds; nothing allocated."""
    return gpu_job(GPT_7B, world_sizes, batch_size=batch_size, seq_len=seq_len)


def smallest_fitting(predictions: Sequence[Prediction], memory_bytes: float) -> int | None:
    """The smallest world size whose predicted peak fits in `memory_bytes` (None: none does)."""
    fits = [p.world_size for p in predictions if p.peak_bytes <= memory_bytes]
    return min(fits) if fits else None


def rows_table(predictions: dict[str, list[Prediction]], unit: float = 1e9) -> list[str]:
    """The rows (non-zero somewhere) by stage and world size, in `unit`s (GB by default)."""
    columns = [(stage, p) for stage, ps in predictions.items() for p in ps]
    head = f"{'':22}" + "".join(f"{s + ' N=' + str(p.world_size):>14}" for s, p in columns)
    lines = [head]
    for row in ROWS:
        if any(p.rows[row] for _, p in columns):
            lines.append(f"{row:22}" + "".join(f"{p.rows[row] / unit:14.2f}" for _, p in columns))
    lines.append(f"{'= peak':22}" + "".join(f"{p.peak_bytes / unit:14.2f}" for _, p in columns))
    lines.append(f"{'peak in':22}" + "".join(f"{p.phase:>14}" for _, p in columns))
    return lines
