"""What the prediction exercises of notebooks 01 to 09b are scored against, measured afresh.

Each prediction (zerolab.lessons.predictions.PREDICTIONS, ids "01.p1" ... "09b.p1") names
`zerolab.lessons.measured:measured_for` as its measurement: the grader calls it with the
prediction's id, and it launches ranks that run zerolab's own engines and collectives on the
notebook's model and settings, and reads the quantity off the running system (the comm
recorder's events, the bytes an engine holds, the memory tracker's peak, what autograd saved).
No formula is evaluated here: the formula is what the learner is asked to work out.

    measured_for("05.p1")                  # one launch: 18 (all-gathers in a ZeRO-3 step)
    measured_many(["01.p1", "04.p1"])      # one launch per world size: {id: value}

Each measurement costs a step or two of a small model: seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm, engines, harness, models
from zerolab.lessons import (
    n01_ddp,
    n03_zero1,
    n04_zero2,
    n05_zero3,
    n06_fsdp2,
    n07_scaling,
    n08_activations,
    n09_nodes,
)

# ---- one function per prediction, run on every rank of its launch; rank 0's value counts ----


def _ddp_bytes_all_reduced() -> float:
    """01.p1: the bytes (S, summed) of the all-reduces of one DDP step, bucket_bytes=1 << 20, on
    notebook 01's larger GPT."""
    ctx = zerolab.init_from_env()
    model = models.GPT(n01_ddp.SWEEP_CONFIG)
    engine = engines.make_engine("ddp", model, bucket_bytes=1 << 20)
    x, y = harness.local_batch(model.make_batch, 2 * ctx.world_size, 0, ctx.rank,
                               ctx.world_size)
    log = harness.measured_step(engine, x, y, memory=False).log
    return float(sum(e.nbytes for e in log.events if e.op == "all_reduce"))


def _ddp_model_states() -> float:
    """01b.p1: model-state bytes a DDP rank holds after its first fp32 AdamW step."""
    ctx = zerolab.init_from_env()
    model = models.GPT()
    engine = engines.make_engine("ddp", model, lr=1e-3)
    x, y = harness.local_batch(model.make_batch, 4 * ctx.world_size, 0, ctx.rank,
                               ctx.world_size)
    return float(sum(harness.measured_step(engine, x, y, memory=False).held.values()))


def _all_reduce_wire_bytes() -> float:
    """02.p1: bytes this rank wrote to its sockets in one all-reduce of 12,288 float32."""
    zerolab.init_from_env()
    with comm.record_comm() as log:
        comm.all_reduce(torch.ones(12 * 1024), tag="predict/02", op="sum")
    return float(log.events[-1].wire_bytes)


def _zero1_optimizer_bytes() -> float:
    """03.p1: optimizer-state bytes a ZeRO-1 rank holds after step() (notebook 03's run)."""
    zerolab.init_from_env()
    run = n03_zero1.train("zero1", dist.group.WORLD, torch.device("cpu"))
    return float(run.held["optimizer"])


def _zero2_after_backward_peak_grads() -> float:
    """04.p1: the most gradient bytes alive at once in one step of ZeRO2AfterBackward."""
    zerolab.init_from_env()
    run = n04_zero2.zero2_run("zero2_after_backward")
    return float(run.step.memory.max_by_category["grads"])


def _zero3_all_gathers() -> float:
    """05.p1: all-gathers one ZeRO-3 step issues (prefetch off), forward and backward."""
    zerolab.init_from_env()
    model = models.GPT(n05_zero3.MODEL)
    engine = n05_zero3.trained_one_step("zero3", model, prefetch=False)
    log = harness.measured_step(engine, *n05_zero3.batch(model, 1), memory=False).log
    return float(sum(e.op == "all_gather" for e in log.events))


def _fsdp2_model_states() -> float:
    """06.p1: model-state bytes a rank holds with torch's FSDP2 after step()."""
    zerolab.init_from_env()
    return float(sum(n06_fsdp2.run_variant("torch_fsdp2", steps=2).held.values()))


def _zero3_ring_bytes() -> float:
    """07.p1: what one ZeRO-3 step sends from this rank, as zerolab.comm records each call (its
    ring-model bytes), on notebook 07's model after a first step."""
    zerolab.init_from_env()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = models.GPT(n07_scaling.MODEL)
    engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=n07_scaling.LR)
    for seed in (100, 101):  # the first step creates Adam's state; the second is measured
        x, y = harness.local_batch(model.make_batch, n07_scaling.GLOBAL_BATCH, seed, rank,
                                   world_size)
        measured = harness.measured_step(engine, x, y, memory=False)
    return float(measured.log.total_ring_bytes())


def _block_activations() -> float:
    """08.p1: bytes block 0 saves for backward, b = 2 sequences of s = 32 tokens, SDPA."""
    saved = n08_activations.saved_one_step(n08_activations.config(32), batch=2)
    return float(saved.by_block()["blocks.0"])


def _hsdp_bytes_across() -> float:
    """09.p1: bytes one HSDP step sends from this rank to the other node (the replicas'
    all-reduces, as zerolab.comm records them), N = 4 in nodes of 2."""
    zerolab.init_from_env()
    model = models.GPT(n09_nodes.MODEL)
    engine = engines.make_engine("hsdp", model, torch.optim.AdamW, lr=1e-3,
                                 shard_size=n09_nodes.NODE)
    harness.train_step(engine, *n09_nodes.batch(model, 0))
    log = harness.measured_step(engine, *n09_nodes.batch(model, 1), memory=False).log
    return float(sum(e.ring_bytes for e in log.events if e.tag.endswith(".replicas")))


def _born_sharded_kept() -> float:
    """09b.p1: model-state bytes a rank holds once ZeRO-3 has built notebook 09's GPT from the
    meta device, before any step (parameter and gradient shards; no optimizer state yet)."""
    zerolab.init_from_env()
    with torch.device("meta"):
        model = models.GPT(n09_nodes.MODEL)
    engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=1e-3)
    return float(sum(engine.model_state_bytes().values()))


# id -> (world size, what each rank runs)
MEASURES: dict[str, tuple[int, Callable[[], float]]] = {
    "01.p1": (2, _ddp_bytes_all_reduced),
    "01b.p1": (2, _ddp_model_states),
    "02.p1": (3, _all_reduce_wire_bytes),
    "03.p1": (4, _zero1_optimizer_bytes),
    "04.p1": (2, _zero2_after_backward_peak_grads),
    "05.p1": (2, _zero3_all_gathers),
    "06.p1": (2, _fsdp2_model_states),
    "07.p1": (4, _zero3_ring_bytes),
    "08.p1": (1, _block_activations),
    "09.p1": (4, _hsdp_bytes_across),
    "09b.p1": (4, _born_sharded_kept),
}


def _on_rank(ids: Sequence[str]) -> dict[str, float]:
    """Inside a launch: each prediction's measurement in turn, with a barrier between them so
    that one's collectives cannot mix with the next's."""
    out = {}
    for id in ids:
        out[id] = MEASURES[id][1]()
        if dist.is_initialized():
            dist.barrier()
    return out


def measured_many(ids: Sequence[str], timeout: float = 600) -> dict[str, float]:
    """The measurements of several predictions: one launch per world size they need.
    Returns {id: rank 0's value}."""
    unknown = [id for id in ids if id not in MEASURES]
    if unknown:
        raise ValueError(f"no measurement for prediction {unknown}; known: {sorted(MEASURES)}")
    out: dict[str, float] = {}
    for world_size in sorted({MEASURES[id][0] for id in ids}):
        batch = [id for id in ids if MEASURES[id][0] == world_size]
        out.update(zerolab.launch(_on_rank, world_size, args=(batch,), timeout=timeout)[0])
    return {id: out[id] for id in ids}


def measured_for(id: str) -> float:
    """The measurement prediction `id` ("01.p1" ... "09.p1") is scored against: one launch."""
    return measured_many([id])[id]
