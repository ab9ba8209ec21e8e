"""What the schematic figures' tests run on their ranks: every data function of
zerolab.lessons.schematics once, in one launch, on models small enough to cost seconds."""

from __future__ import annotations

from zerolab.lessons import schematics
from zerolab.models import GPTConfig

TINY_GPT = GPTConfig(n_layer=2, n_embd=32, n_head=2)  # 2 blocks + root: 3 ZeRO-3 units


def every_schematic() -> dict:
    return {"ring": schematics.ring_all_reduce(),
            "holdings": schematics.holdings(),
            "ddp": schematics.ddp_backward(per_rank=4),
            "zero3": schematics.zero3_lifecycle(TINY_GPT, per_rank=2),
            "mesh": schematics.hsdp_mesh(),
            "flat": schematics.flat_layout()}
