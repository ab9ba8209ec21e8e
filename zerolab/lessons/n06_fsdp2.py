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
from zerolab.lessons.n06_clipping import CLIP_MAX_NORM, Clipping, clipping  # noqa: F401 (section 9)
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


# ---- FSDP2's knobs, beside zerolab's equivalents -------------------------------------------
#
# Measured on 4 ranks as 2 "nodes" of 2 (FSDP2's reshard_after_forward=2 needs a divisor of
# the world size other than 1 and itself). Each setting trains a few steps, then one step is
# measured (memory at its peak by category, the all-gathers it issued, the bytes it sent to
# each peer), and its step time is set against its baseline's (FSDP2's defaults for FSDP2's
# knobs, ZeRO-3's for zerolab's) as a paired ratio: the two step alternately, on the same
# batch, and the ratio is the median of the pairs' ratios (a noisy machine slows both alike).

KNOB_NODE = 2  # ranks per "node" for the bytes that cross between nodes
KNOB_PAIRS = 5  # timed step pairs per knob
FSDP2_DEFAULT, ZERO3_DEFAULT = "FSDP2 defaults", "zerolab ZeRO-3"
# label -> (engine: "fsdp2" or a zerolab engine key, its options)
KNOBS: dict[str, tuple[str, dict]] = {
    FSDP2_DEFAULT: ("fsdp2", {}),
    "FSDP2 reshard_after_forward=False": ("fsdp2", {"blocks": {"reshard_after_forward": False}}),
    "FSDP2 reshard_after_forward=2": ("fsdp2", {"blocks": {"reshard_after_forward": KNOB_NODE}}),
    "FSDP2 root resharded too": ("fsdp2", {"root": {"reshard_after_forward": True}}),
    "FSDP2 MixedPrecisionPolicy(bf16, reduce fp32)": ("fsdp2", {"mixed": True}),
    "FSDP2 explicit prefetch": ("fsdp2", {"prefetch": True}),
    "FSDP2 CPUOffloadPolicy()": ("fsdp2", {"offload": {}}),
    "FSDP2 CPUOffloadPolicy(pin_memory=False)": ("fsdp2", {"offload": {"pin_memory": False}}),
    ZERO3_DEFAULT: ("zero3", {}),
    "zerolab ZeRO-3 reshard_after_forward=False": ("zero3", {"reshard_after_forward": False}),
    "zerolab ZeRO++ hpZ (secondary_shard_size=2)": ("zeropp",
                                                    {"secondary_shard_size": KNOB_NODE}),
    "zerolab ZeRO-3 param_dtype=bf16": ("zero3", {"param_dtype": torch.bfloat16}),
    "zerolab ZeRO-3 prefetch=False": ("zero3", {"prefetch": False}),
}


@dataclass
class Knob:
    """One setting, one measured step, on one rank."""

    memory: dict[str, int]  # bytes at the peak of forward + backward, by category
    peak: int  # that peak, bytes ("other" in it: temporaries)
    step_peak: int  # the peak inside step(): the optimizer's temporaries on top of the states
    gathers: int  # all-gathers issued in the step
    gathered: int  # ring-model bytes this rank sent in them
    sent: int | None  # bytes this rank sent on the wire in the step (measured, per peer)
    across: int | None  # of which to the other "node"
    ratio: float | None  # step time / the baseline's: median of paired steps (None: baseline)
    error: str = ""  # where the setting does not run here: the error torch raised


# torch's words for "no accelerator to pin host memory for" differ by build: its CPU build says
# the first, its CUDA build on a machine without a GPU the second.
NO_ACCELERATOR = ("Cannot access accelerator device when none is available",
                  "Found no NVIDIA driver on your system")


def _said(e: Exception) -> str:
    """The error, as the same line whichever torch build raised it."""
    if isinstance(e, RuntimeError) and any(m in str(e) for m in NO_ACCELERATOR):
        return f"RuntimeError: {NO_ACCELERATOR[0]}. (no accelerator to pin memory for)"
    return f"{type(e).__name__}: {e}"


class _KnobbedFSDP2:
    """zerolab.bench.baselines.TorchFSDP2 with FSDP2's knobs: `blocks` and `root` are
    fully_shard's keyword arguments for the blocks and for the root."""

    def __new__(cls, model, optimizer_cls, *, blocks: dict | None = None,
                root: dict | None = None, mixed: bool = False, prefetch: bool = False,
                offload: dict | None = None, **optimizer_kwargs):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
            fully_shard,
        )

        from zerolab.bench.baselines import TorchEngine, TorchFSDP2, parameter_slots

        common: dict = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
        if mixed:
            common["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
        if offload is not None:
            common["offload_policy"] = CPUOffloadPolicy(**offload)
        for block in model.blocks:
            fully_shard(block, **common, **(blocks or {}))
        fully_shard(model, **common, **(root or {}))
        if prefetch:  # each block asks for the next one's gather (the previous in backward)
            order = list(model.blocks)
            for i, block in enumerate(order):
                block.set_modules_to_forward_prefetch(order[i + 1:i + 2])
                block.set_modules_to_backward_prefetch(order[max(i - 1, 0):i])
        engine = TorchFSDP2.__new__(TorchFSDP2)
        TorchEngine.__init__(engine, model, None)
        engine.sharded = list(model.parameters())
        engine.slots = parameter_slots(model)  # where FSDP2 registers gathered parameters
        engine.optimizer = engine.local_optimizer = optimizer_cls(engine.sharded,
                                                                  **optimizer_kwargs)
        return engine


def _knob_engine(label: str, model: GPT):
    name, options = KNOBS[label]
    if name == "fsdp2":
        return _KnobbedFSDP2(model, torch.optim.AdamW, lr=LR, **options)
    return engines.make_engine(name, model, torch.optim.AdamW, lr=LR, **options)


def knob(label: str, baseline, config: GPTConfig = MODEL, warmup: int = 2,
         pairs: int = KNOB_PAIRS) -> Knob:
    """Measure one setting on this rank (a collective: every rank calls it)."""
    from zerolab.memory import track_memory
    from zerolab.wire.peers import record_peer_bytes

    model = GPT(config)
    try:
        engine = _knob_engine(label, model)
        x, y = _knob_batch(model)
        for _ in range(warmup):
            harness.train_step(engine, x, y)
    except (RuntimeError, ValueError) as e:  # the same on every rank: all of them skip it
        return Knob({}, 0, 0, 0, 0, None, None, None, _said(e))
    dist.barrier()
    with record_peer_bytes() as peers, CollectiveCounter() as counter:
        with track_memory(engine.state_tensors, activations=True) as forward_backward:
            loss = model.loss(engine(x), y)
            loss.backward()
        with track_memory(engine.state_tensors) as step:
            engine.step()
            engine.wait_params()
    engine.zero_grad()
    if label.startswith("zerolab"):  # zerolab's own gathers: counted the same way, in c10d
        counter = _zerolab_gathers(engine, x, y)
    ratio = None if baseline is None or not pairs else paired_ratio(engine, baseline, x, y,
                                                                     pairs)
    return Knob(forward_backward.peak_by_category, forward_backward.peak_bytes, step.peak_bytes,
                counter.calls.get("all_gather", 0), counter.by_op.get("all_gather", 0),
                None if peers is None else sum(peers.to.values()),
                None if peers is None else peers.across(KNOB_NODE), ratio)


def _knob_batch(model: GPT) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the one batch every knob trains on."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return harness.local_batch(model.make_batch, BATCH_PER_RANK * world_size, 100, rank,
                               world_size)


def _zerolab_gathers(engine, x, y) -> CollectiveCounter:
    """zerolab's all-gathers as zerolab.comm records them (on gloo an all-gather may run as
    other c10d ops: wire/backends.py), in CollectiveCounter's terms."""
    from zerolab.comm import record_comm

    with record_comm(align=False) as log:
        harness.train_step(engine, x, y)
        engine.wait_params()
    counter = CollectiveCounter()
    gathers = [e for e in log.events if e.op == "all_gather"]
    counter.calls["all_gather"] = len(gathers)
    counter.by_op["all_gather"] = sum(e.ring_bytes for e in gathers)
    return counter


def paired_ratio(engine, baseline, x: torch.Tensor, y: torch.Tensor,
                 pairs: int = KNOB_PAIRS) -> float:
    """Median over `pairs` of (one step of engine) / (one step of baseline), taken in turn."""
    ratios = []
    for _ in range(pairs):
        times = []
        for e in (engine, baseline):
            dist.barrier()
            start = time.perf_counter()
            harness.train_step(e, x, y)
            e.wait_params()
            times.append(time.perf_counter() - start)
        ratios.append(times[0] / times[1])
    return statistics.median(ratios)


def knobs(config: GPTConfig = MODEL, labels: tuple[str, ...] = tuple(KNOBS),
          pairs: int = KNOB_PAIRS) -> dict[str, Knob]:
    """Run on every rank of a 4-rank launch: each of `labels`, measured (see KNOBS).
    `pairs=0`: no timing (every ratio None; the baselines are not built)."""
    baselines = {}
    for label in (FSDP2_DEFAULT, ZERO3_DEFAULT) if pairs else ():  # warmed up once, for timing
        model = GPT(config)
        baselines[label] = _knob_engine(label, model)
        for _ in range(2):
            harness.train_step(baselines[label], *_knob_batch(model))
    out = {}
    for label in labels:
        base = FSDP2_DEFAULT if KNOBS[label][0] == "fsdp2" else ZERO3_DEFAULT
        out[label] = knob(label, baselines.get(base) if label != base else None, config,
                          pairs=pairs)
    return out


def knob_table(per_rank: list[dict[str, Knob]], peak: bool = True) -> list[str]:
    """The measurements as a table: memory at the peaks (the largest over the ranks), rank 0's
    gathers, bytes sent per rank and to the other node (means over the ranks); the times are
    `knob_times`'. `peak=False` leaves out the fwd+bwd peak: with FSDP2's prefetch it moves from
    run to run by when its gathers' buffers come and go."""
    rows = [f"{'':46}" + (f"{'fwd+bwd':>8}" if peak else "") + f"{'params':>8}{'step':>8}"
            f"{'gathers':>8}{'sent':>7}{'across':>7}",
            f"{'':46}" + (f"{'KiB':>8}" if peak else "") + f"{'KiB':>8}{'KiB':>8}{'':>8}"
            f"{'KiB':>7}{'KiB':>7}"]
    for label, k in per_rank[0].items():
        if k.error:
            rows.append(f"{label:46}{k.error[:60]}")
            continue
        runs = [r[label] for r in per_rank]
        rows.append(f"{label:46}" + (f"{max(r.peak for r in runs) / 2**10:8.0f}" if peak else "")
                    + f"{max(r.memory.get('params', 0) for r in runs) / 2**10:8.0f}"
                    f"{max(r.step_peak for r in runs) / 2**10:8.0f}{k.gathers:8}"
                    f"{statistics.mean(r.sent or 0 for r in runs) / 2**10:7.0f}"
                    f"{statistics.mean(r.across or 0 for r in runs) / 2**10:7.0f}")
    return rows


def knob_times(per_rank: list[dict[str, Knob]]) -> list[str]:
    """Each timed setting's step time / its default's (the paired ratios of `knob`): the
    median over the ranks of each rank's median, and the smallest and largest rank's."""
    rows = [f"{'step time / its default':>61}{'ranks':>13}"]
    for label, k in per_rank[0].items():
        if k.error:
            continue
        if k.ratio is None:
            rows.append(f"{label:46}{'(the default)':>15}")
            continue
        ratios = sorted(r[label].ratio for r in per_rank)
        rows.append(f"{label:46}{statistics.median(ratios):15.2f}"
                    f"{ratios[0]:8.2f} to {ratios[-1]:.2f}")
    return rows


# ---- DDP's gradient buckets: copies or views -----------------------------------------------


@dataclass
class BucketView:
    """torch DDP with gradient_as_bucket_view on or off, on one rank, after 3 steps."""

    num_params: int  # Ψ
    held: dict[str, int]  # live bytes after step(), by category; "other": DDP's buckets
    bucket_sizes: list[list[int]]  # DDP's bucket sizes in bytes after each step
    rebuilt_at: int | None  # the step after which DDP had rebuilt its buckets (0-based)


BUCKET_MODEL = GPTConfig(n_layer=4, n_embd=128, n_head=4)  # 0.8 M parameters: 3.2 MB in fp32
COURSE_GPT = GPTConfig()  # zerolab.models.GPT()'s own


def ddp_bucket_view(config: GPTConfig = BUCKET_MODEL, steps: int = 3) -> dict[bool, BucketView]:
    """Run on every rank: torch DDP built and trained under the memory tracker, with
    gradient_as_bucket_view False (its default: .grad and the buckets are two copies, 20Ψ with
    Adam) and True (.grad are views of the buckets, 16Ψ). The model is larger than 1 MiB so
    that DDP's first bucket (1 MiB, dist._DEFAULT_FIRST_BUCKET_BYTES) shows once DDP has
    rebuilt its buckets in the order the gradients arrived in the first backward.

    Bucket sizes come from DDP's logging data (DistributedDataParallel._get_ddp_logging_data:
    not a public API; torch documents no other way to read them)."""
    from torch.nn.parallel import DistributedDataParallel

    from zerolab.memory import module_state, track_memory

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for view in (False, True):
        model = GPT(config)
        holder: dict = {}
        sizes, rebuilt_at = [], None
        # DDP is built inside the tracker, so that its buckets (made in C++) are seen.
        with track_memory(lambda m=model, h=holder: module_state(m, h.get("opt"))) as trace:
            ddp = DistributedDataParallel(model, gradient_as_bucket_view=view)
            holder["opt"] = optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            for step in range(steps):
                x, y = harness.local_batch(model.make_batch, BATCH_PER_RANK * world_size, step,
                                           rank, world_size)
                model.loss(ddp(x), y).backward()
                optimizer.step()
                data = ddp._get_ddp_logging_data()
                if data.get("has_rebuilt_buckets") and rebuilt_at is None:
                    rebuilt_at = step
                text = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")
                sizes.append([int(s) for s in str(text).split(",") if s.strip()])
                if step < steps - 1:
                    optimizer.zero_grad()
        out[view] = BucketView(num_params(model), trace.samples[-1][1], sizes, rebuilt_at)
    return out


# ---- a ledger for every byte of the peak ---------------------------------------------------


@dataclass
class PeakLedger:
    """One stage on the course GPT, one rank: its ledger, the formulas, torch's tracker."""

    ledger: object  # zerolab.ledger.Ledger
    model_states: float  # formula, fp32 Adam (theory.model_state_memory)
    deepspeed: float | None  # DeepSpeed's estimator (mixed precision): ZeRO-2 and ZeRO-3 only
    torch_tracker: dict[str, int]  # torch.distributed._tools' MemTracker at its peak
    torch_peak: int  # its total at its peak


LEDGER_STAGES = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def peak_ledgers(config: GPTConfig = COURSE_GPT, global_batch: int = 12,
                 warmup: int = 2) -> dict[str, PeakLedger]:
    """Run on every rank: each stage on the course GPT (zerolab.models.GPT()) trains `warmup`
    steps, then one step under the ledger, then one more under torch's MemTracker
    (torch.distributed._tools.mem_tracker; it runs on a CPU), on the same batch."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from zerolab import ledger as ledgers
    from zerolab.theory import deepspeed_zero2_bytes, deepspeed_zero3_bytes, model_state_memory

    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for key, stage in LEDGER_STAGES.items():
        model = GPT(config)
        engine = engines.make_engine(key, model, torch.optim.AdamW, lr=LR)
        x, y = harness.local_batch(model.make_batch, global_batch, 7, rank, world_size)
        for _ in range(warmup):
            harness.train_step(engine, x, y)
        measured = ledgers.measure(engine, x, y)
        engine.zero_grad()
        tracker = MemTracker()
        tracker.track_external(model, engine.optimizer)
        with tracker:
            harness.train_step(engine, x, y, zero_grad=False)
            engine.wait_params()
        engine.zero_grad()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
        psi = num_params(GPT(config))  # ZeRO-3's own parameters are empty at rest
        largest = max(sum(b.layout.numel for b in u.buckets) for u in engine.units) \
            if key == "zero3" else 0
        out[key] = PeakLedger(
            measured, model_state_memory(psi, world_size, stage).total,
            deepspeed_zero2_bytes(psi, world_size) if stage == "ZeRO-2" else
            deepspeed_zero3_bytes(psi, world_size, largest) if stage == "ZeRO-3" else None,
            {str(getattr(k, "value", k)): v for k, v in peak.items() if k != "Total"},
            peak["Total"])
    return out
