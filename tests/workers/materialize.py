"""Workers for tests/test_materialize.py: engines built from a model on the meta device."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import engines, harness, models

CONFIG = models.GPTConfig(n_layer=4, n_embd=48, n_head=4)  # uneven shards at 3 ranks
STEPS = 3


def build(meta: bool) -> models.GPT:
    if not meta:
        return models.GPT(CONFIG)
    with torch.device("meta"):
        return models.GPT(CONFIG)


def construction_peak(engine_key: str, meta: bool) -> dict:
    """Peak live bytes while the model and the engine are built, and what the rank holds then."""
    with zerolab.track_memory() as trace:
        model = build(meta)
        engine = engines.make_engine(engine_key, model, torch.optim.AdamW, lr=1e-3)
    full = 4 * models.num_params(models.GPT(CONFIG))
    out = {"peak": trace.peak_bytes, "full_model_bytes": full, "held": engine.model_state_bytes()}
    if engine_key == "zero3":
        out["largest_unit_bytes"] = max(sum(4 * b.layout.padded_numel for b in u.buckets)
                                         for u in engine.units)
    return out


def train(engine_key: str, meta: bool) -> dict[str, torch.Tensor]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build(meta)
    engine = engines.make_engine(engine_key, model, torch.optim.AdamW, lr=1e-2)
    for step in range(STEPS):
        x, y = harness.local_batch(model.make_batch, 6, 100 + step, rank, world_size)
        harness.train_step(engine, x, y)
    return engine.full_state_dict()


def compare(engine_keys: list[str]) -> dict:
    return {s: {"meta": train(s, True), "full": train(s, False),
                "peak_meta": construction_peak(s, True),
                "peak_full": construction_peak(s, False)} for s in engine_keys}
