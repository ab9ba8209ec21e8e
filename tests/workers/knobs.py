"""Workers for tests/test_ledger.py and tests/test_lesson_n06_knobs.py: FSDP2's knobs beside
zerolab's (4 ranks), ZeRO-3's reshard_after_forward against the reference, the peak ledger
(3 ranks), DDP's bucket views and clipping (2 ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers import engines as W
from zerolab import comm, engines, harness, ledger
from zerolab.lessons import n06_fsdp2
from zerolab.memory import track_memory
from zerolab.models import GPTConfig

KNOB_MODEL = GPTConfig(n_layer=4)  # the course GPT's sizes, 4 blocks: 5 units
KNOB_LABELS = ("FSDP2 defaults", "FSDP2 reshard_after_forward=False", "FSDP2 root resharded too",
               "FSDP2 CPUOffloadPolicy()", "zerolab ZeRO-3",
               "zerolab ZeRO-3 reshard_after_forward=False",
               "zerolab ZeRO++ hpZ (secondary_shard_size=2)")


def reshard_after_forward(kind: str) -> dict:
    """ZeRO-3 with and without reshard_after_forward on the engine tests' batches: weights,
    all-gathers per step, and the most parameter bytes alive in the last step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    out = {}
    for keep in (True, False):
        model = W.build_model(kind, seed=rank)
        engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=W.LR,
                                     weight_decay=0.1, reshard_after_forward=keep)
        for x, y in W.batches(model, rank, world_size):
            with comm.record_comm(align=False) as log, \
                    track_memory(engine.state_tensors) as trace:
                harness.train_step(engine, x, y)
        out[keep] = {"state": engine.full_state_dict(),
                     "gathers": sum(e.op == "all_gather" for e in log.events),
                     "max_params": trace.max_by_category["params"],
                     "units": len(engine.units)}
    return out


def knobs_and_reshard(kind: str) -> dict:
    """4 ranks: the knobs (the course GPT, one timed pair each) and reshard_after_forward."""
    knobs = n06_fsdp2.knobs(KNOB_MODEL, KNOB_LABELS, pairs=1)
    return {"knobs": knobs, "reshard": reshard_after_forward(kind)}


def ledgers_and_padding() -> dict:
    """3 ranks: notebook 06's ledgers for every stage on the course GPT; and ZeRO-1 on the MLP
    (uneven layers: padding), with the padding its layout says it holds at the peak."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = W.build_model("mlp")
    engine = engines.make_engine("zero1", model, torch.optim.AdamW, lr=W.LR,
                                 **W.engine_kwargs("zero1"))
    x, y = harness.local_batch(model.make_batch, W.GLOBAL_BATCH, 3, rank, world_size)
    harness.train_step(engine, x, y)
    measured = ledger.measure(engine, x, y)
    expected = {"params": 0, "grads": 0, "optimizer": 0}
    for b in engine.buckets:  # ZeRO-1: full flat params and gradients, optimizer shards
        pad = b.layout.padded_numel - b.layout.numel
        lo, hi = b.layout.shard_range(rank)
        expected["params"] += 4 * pad
        expected["grads"] += 4 * pad
        expected["optimizer"] += 2 * 4 * max(0, hi - max(lo, b.layout.numel))  # exp_avg(_sq)
    return {"ledgers": n06_fsdp2.peak_ledgers(), "mlp": measured, "padding": expected}


def buckets_and_clipping() -> dict:
    """2 ranks: torch DDP's buckets as copies or views; clipping against torch's."""
    return {"buckets": n06_fsdp2.ddp_bucket_view(), "clipping": n06_fsdp2.clipping()}
