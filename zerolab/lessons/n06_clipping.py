"""Notebook 06, section 9: clipping to one global norm when the gradients are sharded.

`clipping` runs on every rank: each zerolab stage clips with `engine.clip_grad_norm_` (a
sharded one all-reduces its shards' sums of squares, one scalar: zerolab.parts.clipping), FSDP2 with
torch.nn.utils.clip_grad_norm_ on its DTensor gradients, and the single-process reference (the
whole global batch, torch's clip_grad_norm_) on every rank too. Notebook 06 reads it as
`lesson.clipping` (zerolab.lessons.n06_fsdp2 imports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import engines, harness
from zerolab.models import GPT, GPTConfig


@dataclass
class Clipping:
    """Clipping to a global norm on one rank: zerolab's engines, FSDP2 and one process."""

    norms: dict[str, list[float]]  # per variant, the norm before clipping at every step
    full: dict[str, dict[str, torch.Tensor]]  # per variant, the weights after the steps
    collectives: dict[str, list[tuple[str, int]]]  # zerolab: (op, bytes) clipping issued


CLIP_MAX_NORM = 0.05  # small enough that every step clips
CLIP_STEPS = 3


def clipping(config: GPTConfig | None = None, global_batch: int = 12) -> Clipping:
    """Run on every rank: each stage clips with engine.clip_grad_norm_, FSDP2 with
    torch.nn.utils.clip_grad_norm_ on its DTensor gradients; the single-process reference
    (the whole global batch, torch's clip_grad_norm_) runs on every rank too."""
    from zerolab.comm import record_comm
    from zerolab.lessons.n06_fsdp2 import COURSE_GPT, LR  # here: n06_fsdp2 imports this file

    config = config or COURSE_GPT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    norms: dict[str, list[float]] = {}
    full, collectives = {}, {}
    batches = [GPT(config).make_batch(global_batch, seed=300 + s) for s in range(CLIP_STEPS)]
    for name in ("reference", *engines.STAGE_ENGINES, "torch_fsdp2"):
        model = GPT(config)
        engine = None if name == "reference" else engines.make_engine(
            name, model, torch.optim.AdamW, lr=LR)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR) if engine is None else None
        norms[name] = []
        for x, y in batches:
            if engine is not None:
                x, y = harness.local_rows((x, y), rank, world_size)
            model.loss(model(x) if engine is None else engine(x), y).backward()
            if engine is None or name == "torch_fsdp2":
                params = list(model.parameters())
                norm = torch.nn.utils.clip_grad_norm_(params, CLIP_MAX_NORM)
                norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
                norms[name].append(norm.item())
            else:
                with record_comm(align=False) as log:
                    norms[name].append(engine.clip_grad_norm_(CLIP_MAX_NORM))
                collectives[name] = [(e.op, e.nbytes) for e in log.events
                                     if e.tag.endswith("clip/norm")]
            (optimizer or engine).step()
            (optimizer or engine).zero_grad()
        full[name] = (engine.full_state_dict() if engine is not None else
                      {k: v.detach().clone() for k, v in model.state_dict().items()})
    return Clipping(norms, full, collectives)
