"""Notebook 06's exercises (ex06_fsdp): FSDP2's dim-0 shard, and a full state dict gathered
from such shards on ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import _gen


def _dim0_rows(rows: int, rank: int, n: int) -> tuple[int, int]:
    per_rank = -(-rows // n)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def _cases_6_1() -> list[Case]:
    shapes = ((10, 3), (2, 4), (7,), (1,), (6, 2))
    return [Case(f"shape {s}, world_size {n}, rank {r}",
                 lambda rank, s=s, r=r, n=n: (torch.randn(s, generator=_gen("6.1", s)), r, n))
            for s in shapes for n in (1, 2, 3, 4) for r in range(n)]


def _cases_6_2(n: int) -> list[Case]:
    models = {
        "a small model": {"embed.weight": (10, 3), "norm.weight": (7,), "head.bias": (2,),
                          "gain": (1,)},
        "one (5, 2, 2) parameter": {"conv.weight": (5, 2, 2)},
    }

    def make(name: str) -> Callable[[int], tuple]:
        def args(rank: int) -> tuple:
            full = {k: torch.randn(s, generator=_gen("6.2", name, k))
                    for k, s in models[name].items()}
            shards = {k: t[slice(*_dim0_rows(len(t), rank, n))].clone() for k, t in full.items()}
            return shards, {k: len(t) for k, t in full.items()}
        return args
    return [Case(name, make(name)) for name in models]


EXERCISES = [
    Exercise("6.1", "ex06_fsdp", "dim0_shard",
             "FSDP2's per-parameter dim-0 shard, against zerolab's flat shard",
             "Every rank but the last ones gets ceil(rows / world_size) rows (torch.chunk's "
             "rule); do not pad the last shards.",
             _cases_6_1),
    Exercise("6.2", "ex06_fsdp", "full_state_dict",
             "consolidating a full state dict from dim-0 shards (uneven all-gather)",
             "Pad each shard with zero rows at its end to ceil(rows / world_size) rows, gather, "
             "then keep the first `rows` rows.",
             _cases_6_2, distributed=True),
]
