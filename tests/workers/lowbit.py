"""Workers for tests/test_lowbit.py: ZeRO-3 gathering in bf16 and float8, reducing in bf16."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import harness
from zerolab.lessons import n11_precision as lesson
from zerolab.models import GPT
from zerolab.sharding import unflatten

LABELS = ("fp32", "bf16 gather", "float8 gather, scale per tensor",
          "float8 gather, scale per 128", "bf16 reduce")


def _gathered(engine, unit) -> dict[int, torch.Tensor]:
    """The unit's parameters as a gather fills them (every rank the same), by id."""
    engine.unshard(unit, "fwd")
    out = {}
    for b in unit.buckets:
        for p, view in zip(b.params, unflatten(b.flat_param, b.layout)):
            out[id(p)] = view.detach().clone()
    engine.reshard(unit)
    return out


def everything() -> dict:
    """Per variant of the lesson: one step's collectives and one gather alone (wire_step).
    Per LABEL: the gradient shard against the exact wire's at the same weights, and each
    unit's gathered weights against the exact fp32 ones. The lesson's accumulation step."""
    ctx = zerolab.init_from_env()
    out = {label: {"wire": lesson.wire_step(label, ctx.rank)} for label in lesson.VARIANTS}
    for label in LABELS:
        model = GPT(lesson.config())
        engine = lesson.make(label, model)
        harness.train_step(engine, *lesson.batch(0, ctx.rank))
        x, y = lesson.batch(1, ctx.rank)
        with engine.exact_wire():
            model.loss(engine(x), y).backward()
        exact = torch.cat([b.grad_shard for b in engine.buckets]).clone()
        engine.zero_grad()
        model.loss(engine(x), y).backward()
        low = torch.cat([b.grad_shard for b in engine.buckets]).clone()
        engine.zero_grad()
        weights = []
        for unit in engine.units:
            with engine.exact_wire():
                full = _gathered(engine, unit)
            rounded = _gathered(engine, unit)
            weights += [(full[k], rounded[k]) for k in full]
        out[label].update(exact=exact, low=low, weights=weights)
        dist.barrier()
    out["accumulation"] = {every: lesson.accumulation_step(every, ctx.rank)
                           for every in (True, False)}
    return out
