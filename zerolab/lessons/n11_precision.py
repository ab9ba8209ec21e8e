"""Notebook 11, fewer bits on the wire and the optimizer off the GPU: what the ranks measure.

`precision_lesson` runs on 2 ranks, in one launch, everything sections 1 and 3 of the notebook
show from ranks:

- `Wire`: one ZeRO-3 step (after a first) of every way of sending (`VARIANTS`: fp32, bf16 and
  float8 gathers, a bf16 reduce; ZeRO++'s int8 qwZ and qgZ beside them), every collective's
  S, ring-model bytes and bytes written to the sockets;
- `Accuracy`: `STEPS` steps of each on the course's corpus: the loss, and the gradient's
  relative error against fp32 gathers and reductions at the same weights and batch
  (`LowBitZeRO3.exact_wire`);
- `Accumulation`: one optimizer step of `MICRO` micro-batches, reducing after each or only
  after the last (`require_backward_grad_sync = False` before), its collectives and the
  gradient bytes held before the last micro-batch;
- `Fsdp2Offload`: torch's FSDP2 with and without `CPUOffloadPolicy`, step seconds.

The formulas (`formula_bytes`) count from the units' flat layouts what each way should send.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm, harness, theory
from zerolab.data import Corpus
from zerolab.lowbit import LowBitZeRO3
from zerolab.models import GPT, GPTConfig
from zerolab.parts.quantize import BLOCK as INT8_BLOCK
from zerolab.sharding import FlatLayout
from zerolab.units import make_units
from zerolab.zeropp import ZeroPP

WORLD = 2
GLOBAL_BATCH, SEQ = 16, 32  # sequences per step over both ranks, tokens per sequence
LR = 2e-3  # 3e-3 spikes every variant's loss at step 10 (fp32's too): an Adam instability
STEPS = 40  # steps of each accuracy run
MICRO = 4  # micro-batches per optimizer step (accumulation)
FLOAT8_BLOCK = 128  # elements per scale, float8 per block

# label -> (engine, its options); the first is the reference
VARIANTS: dict[str, tuple[type, dict]] = {
    "fp32": (LowBitZeRO3, {}),
    "bf16 gather": (LowBitZeRO3, {"gather": "bf16"}),
    "float8 gather, scale per tensor": (LowBitZeRO3, {"gather": "float8"}),
    "float8 gather, scale per 128": (LowBitZeRO3, {"gather": "float8",
                                                   "float8_block": FLOAT8_BLOCK}),
    "bf16 reduce": (LowBitZeRO3, {"reduce": "bf16"}),
    "qwZ, int8 forward gather (09)": (ZeroPP, {"quantize_weights": True}),
    "qgZ, int8 reduce (09)": (ZeroPP, {"quantize_grads": True, "node_size": 1}),
}
SHORT = {"fp32": "fp32", "bf16 gather": "bf16\ngather", "float8 gather, scale per tensor":
         "float8\nper tensor", "float8 gather, scale per 128": "float8\nper 128",
         "bf16 reduce": "bf16\nreduce", "qwZ, int8 forward gather (09)": "qwZ\n(09)",
         "qgZ, int8 reduce (09)": "qgZ\n(09)"}  # a figure's labels
ACCURACY = ("fp32", "bf16 gather", "float8 gather, scale per tensor",
            "float8 gather, scale per 128", "bf16 reduce")


def config() -> GPTConfig:
    """A small GPT over the built-in corpus's characters."""
    vocab = Corpus.builtin().tokenizer.vocab_size
    return GPTConfig(vocab_size=vocab, block_size=SEQ, n_layer=2, n_embd=64, n_head=4)


def batch(step: int, rank: int, world_size: int = WORLD) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of step `step`'s global batch from the corpus."""
    return harness.local_rows(Corpus.builtin().batch(GLOBAL_BATCH, SEQ, seed=step), rank,
                              world_size)


def make(label: str, model: GPT, group=None) -> LowBitZeRO3 | ZeroPP:
    cls, options = VARIANTS[label]
    return cls(model, torch.optim.AdamW, lr=LR, group=group, **options)


# ---- the formulas -----------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitSize:
    """One ZeRO-3 unit as the formulas see it."""

    name: str
    padded: int  # P: its flat buffer's elements, padded to a multiple of N
    tensors: int  # T: its parameters (float8 per tensor: one scale each)
    root: bool  # the root stays gathered from forward to backward


def unit_sizes(cfg: GPTConfig | None = None, world_size: int = WORLD) -> list[UnitSize]:
    units = make_units(GPT(cfg or config()))
    return [UnitSize(u.name, FlatLayout.of(u.params, world_size).padded_numel, len(u.params),
                     u is units[-1]) for u in units]


def gather_bytes(label: str, u: UnitSize, world_size: int = WORLD,
                 phase: str = "fwd") -> dict[str, float]:
    """Ring-model bytes one rank sends in one all-gather of unit `u` under `label`: "gathers"
    (the codes) and "scales" (float8's per-block scales or its amax all-reduce, int8's scales).
    Each gather sends (N-1)/N of the unit: every shard but the rank's own."""
    n, share, options = world_size, (world_size - 1) / world_size, VARIANTS[label][1]
    blocks = -(-(u.padded // n) // options.get("float8_block", INT8_BLOCK))  # per shard
    if options.get("gather") == "bf16":
        return {"gathers": share * 2 * u.padded, "scales": 0.0}
    if options.get("gather") == "float8":  # one byte an element, and the scales
        scales = (share * 4 * n * blocks if options.get("float8_block") else
                  theory.ring_sent_bytes("all_reduce", 4 * u.tensors, n))  # max of T floats
        return {"gathers": share * u.padded, "scales": scales}
    if options.get("quantize_weights") and phase == "fwd":  # qwZ: int8, a scale per 256
        return {"gathers": share * u.padded, "scales": share * 4 * n * blocks}
    return {"gathers": share * 4 * u.padded, "scales": 0.0}


def formula_bytes(label: str, units: list[UnitSize], world_size: int = WORLD) -> dict[str, float]:
    """Ring-model bytes one rank sends in one step of `label`: "gathers" (parameter codes),
    "scales" and "reduce" (the gradients). Each unit is gathered in forward and again in
    backward, but the root (kept gathered), except under qwZ (its root's forward weights are
    rounded: backward gathers the exact ones)."""
    n, share, options = world_size, (world_size - 1) / world_size, VARIANTS[label][1]
    out = {"gathers": 0.0, "scales": 0.0, "reduce": 0.0}
    for u in units:
        phases = ["fwd"] + (["bwd"] if options.get("quantize_weights") or not u.root else [])
        for phase in phases:
            for k, v in gather_bytes(label, u, n, phase).items():
                out[k] += v
        if options.get("reduce") == "bf16":
            out["reduce"] += share * 2 * u.padded
        elif options.get("quantize_grads"):  # qgZ: an all-to-all of int8 rows and their scales
            out["reduce"] += share * u.padded
            out["scales"] += share * 4 * n * -(-(u.padded // n) // INT8_BLOCK)
        else:
            out["reduce"] += share * 4 * u.padded
    return out


def kind(e: comm.CommEvent) -> str:
    """"gathers", "scales" or "reduce": what a collective of a step carries."""
    if e.tag.endswith((".scales", ".amax")):
        return "scales"
    return "gathers" if e.op == "all_gather" else "reduce"


# ---- what the ranks measure --------------------------------------------------------------------


Event = tuple[str, str, str, int, int, int]  # (kind, op, dtype, S, ring bytes, wire bytes)


@dataclass
class Wire:
    """One variant on one rank: one step's collectives, and one forward gather of the first
    unit alone (nothing else in flight, so that the bytes written are its own)."""

    events: list[Event]
    gather: list[Event]

    def total(self, what: str = "", column: str = "ring", gather: bool = False) -> int:
        """Bytes of one kind ("gathers", "scales", "reduce"; "" for all) in the ring model or
        written to the sockets ("wire"): of the step, or (gather=True) of the lone gather."""
        i = {"nbytes": 3, "ring": 4, "wire": 5}[column]
        return sum(e[i] for e in (self.gather if gather else self.events)
                   if what in ("", e[0]))


def _events(log: comm.CommLog) -> list[Event]:
    return [(kind(e), e.op, e.dtype, e.nbytes, e.ring_bytes, e.wire_bytes or 0)
            for e in log.events]


def wire_step(label: str, rank: int) -> Wire:
    """A first step (Adam's state), a measured one, then the first unit gathered alone. In the
    step, calls overlap (prefetch, reductions in flight), so the bytes a window saw are shared
    among them: only the step's total is measured exactly; the lone gather's are its own."""
    model = GPT(config())
    engine = make(label, model)
    harness.train_step(engine, *batch(0, rank))
    log = harness.measured_step(engine, *batch(1, rank), memory=False).log
    with comm.record_comm() as alone:
        engine.unshard(engine.units[0], "fwd")
    engine.reshard(engine.units[0])
    return Wire(_events(log), _events(alone))


@dataclass
class Accuracy:
    """STEPS steps of one variant: this rank's losses, and the relative error of the whole
    gradient (every rank's shard) against the exact wire's, at the same weights, per step."""

    losses: list[float] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)


def _shards(engine: LowBitZeRO3) -> torch.Tensor:
    return torch.cat([b.grad_shard for b in engine.buckets]).clone()


def accuracy_run(label: str, rank: int, steps: int = STEPS) -> Accuracy:
    model = GPT(config())
    engine = make(label, model)
    out = Accuracy()
    for step in range(steps):
        x, y = batch(step, rank)
        if label != "fp32":  # the reference gradient: fp32 on the wire, same weights and batch
            with engine.exact_wire():
                model.loss(engine(x), y).backward()
            exact = _shards(engine)
            engine.zero_grad()
        loss = model.loss(engine(x), y)
        loss.backward()
        if label != "fp32":
            sums = torch.stack([(_shards(engine) - exact).pow(2).sum(), exact.pow(2).sum()])
            comm.all_reduce(sums, tag="lesson11/error", group=None)
            out.errors.append((sums[0] / sums[1]).sqrt().item())
        engine.step()
        engine.zero_grad()
        out.losses.append(loss.item())
    return out


@dataclass
class Accumulation:
    """One optimizer step of MICRO micro-batches: its collectives (kind -> (calls, ring
    bytes)) and the gradient bytes held before the last micro-batch."""

    collectives: dict[str, tuple[int, int]]
    grads_before_last: int


def accumulation_step(every: bool, rank: int) -> Accumulation:
    model = GPT(config())
    engine = make("fp32", model)
    x, y = batch(0, rank)
    harness.train_step(engine, x, y)  # a first step: Adam's state
    xs, ys = batch(1, rank)
    held = 0
    with comm.record_comm() as log:
        for i, (xm, ym) in enumerate(zip(xs.chunk(MICRO), ys.chunk(MICRO))):
            engine.require_backward_grad_sync = every or i == MICRO - 1
            if i == MICRO - 1:
                held = engine.model_state_bytes()["grads"]
            (model.loss(engine(xm), ym) / MICRO).backward()
        engine.step()
    engine.zero_grad()
    out: dict[str, tuple[int, int]] = {}
    for e in log.events:
        calls, ring = out.get(kind(e), (0, 0))
        out[kind(e)] = (calls + 1, ring + e.ring_bytes)
    return Accumulation(out, held)


@dataclass
class Fsdp2Offload:
    """torch's FSDP2 on this rank: median step seconds with and without CPUOffloadPolicy, and
    what refused (pin_memory=True needs an accelerator)."""

    seconds: dict[str, float]
    refused: str


def fsdp2_offload(rank: int, steps: int = 5) -> Fsdp2Offload:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    refused = ""
    try:
        fully_shard(GPT(config()), mesh=mesh, offload_policy=CPUOffloadPolicy())
    except Exception as e:  # noqa: BLE001 (what torch says is the lesson)
        refused = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    seconds = {}
    for name, policy in (("FSDP2", OffloadPolicy()),
                         ("FSDP2 + CPUOffloadPolicy(pin_memory=False)",
                          CPUOffloadPolicy(pin_memory=False))):
        model = GPT(config())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        times = []
        for step in range(steps + 2):
            x, y = batch(step, rank)
            dist.barrier()
            start = time.perf_counter()
            model.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        seconds[name] = statistics.median(times[2:])
    return Fsdp2Offload(seconds, refused)


@dataclass
class Lesson:
    """Everything one rank measured for notebook 11."""

    wire: dict[str, Wire]
    accuracy: dict[str, Accuracy]
    accumulation: dict[str, Accumulation]  # "every micro-batch", "only the last"
    fsdp2: Fsdp2Offload


def precision_lesson(steps: int = STEPS) -> Lesson:
    """Inside WORLD ranks: sections 1 and 3's measurements, in turn, a barrier between."""
    ctx = zerolab.init_from_env()
    wire = {}
    for label in VARIANTS:
        wire[label] = wire_step(label, ctx.rank)
        dist.barrier()
    accuracy = {label: accuracy_run(label, ctx.rank, steps) for label in ACCURACY}
    accumulation = {"every micro-batch": accumulation_step(True, ctx.rank),
                    "only the last": accumulation_step(False, ctx.rank)}
    dist.barrier()
    return Lesson(wire, accuracy, accumulation, fsdp2_offload(ctx.rank))


def mean_curves(per_rank: list[Lesson]) -> dict[str, list[float]]:
    """The loss on the whole global batch at each step: the mean of the ranks' losses."""
    return {label: [sum(s) / len(s) for s in zip(*(r.accuracy[label].losses for r in per_rank))]
            for label in ACCURACY}


def format_accuracy(curves: dict[str, list[float]], errors: dict[str, list[float]],
                    last: int = 10) -> str:
    """Per variant: the final loss (mean of the last `last` steps), its drift from fp32's, the
    largest |difference| from fp32's curve, and the gradient's relative error (median, max)."""
    ref = curves["fp32"]
    final = {k: statistics.mean(v[-last:]) for k, v in curves.items()}
    lines = [f"{'':32}{'final loss':>10}{'drift':>8}{'max |diff|':>11}"
             f"{'gradient error: median':>24}{'max':>9}"]
    for label, losses in curves.items():
        errs = errors.get(label)
        lines.append(f"{label:32}{final[label]:>10.3f}{final[label] / final['fp32'] - 1:>+8.1%}"
                     f"{max(abs(a - b) for a, b in zip(losses, ref)):>11.3f}"
                     + (f"{statistics.median(errs):>24.2%}{max(errs):>9.2%}" if errs else
                        f"{'(the reference)':>33}"))
    return "\n".join(lines)



# ---- what the prediction exercises are scored against (zerolab.lessons.predictions) ----------


def _measure_prediction(id: str) -> float:
    """Inside WORLD ranks: the measurement prediction `id` is scored against (rank 0's)."""
    ctx = zerolab.init_from_env()
    if id == "11.p1":  # ring bytes of one step's float8 codes, a scale per tensor
        return float(wire_step("float8 gather, scale per tensor", ctx.rank).total("gathers"))
    if id == "11.p2":  # gradient bytes held before the last of MICRO micro-batches
        return float(accumulation_step(False, ctx.rank).grads_before_last)
    raise ValueError(f"no measurement for prediction {id!r}")


def measured_for(id: str) -> float:
    """The measurement prediction `id` ("11.p1" ... "11.p3") is scored against."""
    if id not in ("11.p1", "11.p2", "11.p3"):
        raise ValueError(f"no measurement for prediction {id!r}; notebook 11 has 11.p1 to 11.p3")
    if id == "11.p3":  # one process, no ranks: AdamW's step on this CPU
        from zerolab.lessons import n11_offload

        return n11_offload.adamw_seconds(n11_offload.WAYS[2])
    return zerolab.launch(_measure_prediction, WORLD, args=(id,), timeout=300)[0]
