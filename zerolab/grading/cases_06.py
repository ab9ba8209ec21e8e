"""Notebook 06's exercises (ex06_fsdp): FSDP2's dim-0 shard, and a full state dict gathered
from such shards on ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zerolab.grading.exercise import BadReturn, Case, Exercise, own_memory_outputs
from zerolab.grading.inputs import non_contiguous, rng
from zerolab.grading.mistakes import (
    DTYPE_LOST,
    Evidence,
    Mistake,
    element,
    first_difference,
    matches,
    memory_mistakes,
    neighbour_rank,
    padding_kept,
    used_instead,
)
from zerolab.grading.storage import shares_memory


def _dim0_rows(rows: int, rank: int, n: int) -> tuple[int, int]:
    per_rank = -(-rows // n)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def _cases_6_1() -> list[Case]:
    shapes = ((10, 3), (2, 4), (7,), (1,), (6, 2))
    cases = [Case(f"shape {s}, world_size {n}, rank {r}",
                  lambda rank, s=s, r=r, n=n: (torch.randn(s, generator=rng("6.1", s)), r, n))
             for s in shapes for n in (1, 2, 3, 4) for r in range(n)]
    kinds = {"float64": lambda t: t.double(), "bfloat16": lambda t: t.bfloat16(),
             "a non-contiguous view": non_contiguous}
    return cases + [Case(f"shape (10, 3), {kind}, world_size 3, rank {r}",
                         lambda rank, r=r, f=f: (f(torch.randn(10, 3, generator=rng("6.1", 10))),
                                                 r, 3))
                    for kind, f in kinds.items() for r in range(3)]


def _cases_6_2(n: int) -> list[Case]:
    models = {
        "a small model": {"embed.weight": (10, 3), "norm.weight": (7,), "head.bias": (2,),
                          "gain": (1,)},
        "one (5, 2, 2) float64 parameter": {"conv.weight": (5, 2, 2)},
    }

    def make(name: str) -> Callable[[int], tuple]:
        dtype = torch.float64 if "float64" in name else torch.float32

        def args(rank: int) -> tuple:
            full = {k: torch.randn(s, generator=rng("6.2", name, k), dtype=dtype)
                    for k, s in models[name].items()}
            shards = {k: t[slice(*_dim0_rows(len(t), rank, n))].clone() for k, t in full.items()}
            return shards, {k: len(t) for k, t in full.items()}
        return args
    return [Case(name, make(name)) for name in models]


def _outputs_6_2(result: Any, args: tuple) -> dict[str, Any]:
    """The full tensors, the names of those that live in a shard's memory (a shortcut on one
    rank: the shards themselves returned), and of those whose storage holds more than their
    rows (a view of the padded gathered buffer keeps the padding alive)."""
    if not isinstance(result, dict):
        raise BadReturn(f"expected a dict of tensors, got {type(result).__name__}")
    tensors = {k: v for k, v in result.items() if isinstance(v, torch.Tensor)}
    shared = sorted(k for k, v in tensors.items() if shares_memory(v, list(args[0].values())))
    bigger = sorted(k for k, v in tensors.items() if k not in shared
                    and v.untyped_storage().nbytes() > v.numel() * v.element_size())
    return {"result": result, "in a shard's memory": shared, "in a bigger buffer": bigger}


# ---- what the grader can tell apart ------------------------------------------------------------


def _array_split(ev: Evidence) -> torch.Tensor:
    """6.1 by numpy.array_split's rule: the first rows % N ranks get one extra row."""
    param, rank, n = ev.inputs()
    base, extra = divmod(len(param), n)
    start = rank * base + min(rank, extra)
    return param[start:start + base + (1 if rank < extra else 0)]


def _rows_are(rows: Callable[[int, int], int]) -> Callable[[Evidence], bool]:
    """6.1's result has `rows(rows of param, world_size)` rows, which is wrong here."""
    def test(ev: Evidence) -> bool:
        param, _, n = ev.inputs()
        want = rows(len(param), n)
        return len(ev.got) == want != len(ev.expected)
    return test


def _padded_in_front(ev: Evidence) -> dict[str, torch.Tensor]:
    """6.2 with each shard's padding rows put before its rows."""
    ranks = [ev.inputs(r)[0] for r in range(ev.world_size)]
    full = {}
    for name, rows in ev.inputs()[1].items():
        per_rank = -(-rows // ev.world_size)
        pieces = [torch.cat([s[name].new_zeros(per_rank - len(s[name]), *s[name].shape[1:]),
                             s[name]]) for s in ranks]
        full[name] = torch.cat(pieces)[:rows]
    return full


EXERCISES = [
    Exercise("6.1", "ex06_fsdp", "dim0_shard",
             "FSDP2's per-parameter dim-0 shard, against zerolab's flat shard",
             "Every rank but the last ones gets ceil(rows / world_size) rows (torch.chunk's "
             "rule): rank r's rows start at r * ceil(rows / world_size); clamp the start and "
             "the end to rows; do not pad the last shards; return a copy.",
             _cases_6_1, outputs=own_memory_outputs,
             hints=("rows_per_rank = -(-rows // world_size); start = min(rank * rows_per_rank, "
                    "rows); end = min(start + rows_per_rank, rows); return "
                    "param[start:end].clone().",),
             mistakes=(
                 Mistake("numpy.array_split's rule, not torch.chunk's",
                         "That is numpy.array_split's rule (the first ranks get one extra "
                         "row). FSDP2 cuts like torch.chunk: ceil(rows / world_size) rows per "
                         "rank until they run out.", matches(_array_split)),
                 Mistake("the last shards padded",
                         "No padding here: the last ranks get fewer rows, or none.",
                         _rows_are(lambda rows, n: -(-rows // n))),
                 Mistake("rows per rank from floor instead of ceil",
                         "ceil(rows / world_size) rows per rank: with floor, the last rows "
                         "belong to no rank.", _rows_are(lambda rows, n: rows // n)),
                 Mistake("off by one rank: a neighbour's rows",
                         "You returned a neighbour's rows: rank r's rows start at "
                         "r * ceil(rows / world_size).", neighbour_rank(1)),
                 DTYPE_LOST, *memory_mistakes("the rows")),
             read_only=("param",)),
    Exercise("6.2", "ex06_fsdp", "full_state_dict",
             "consolidating a full state dict from dim-0 shards (uneven all-gather)",
             "Pad each shard with zero rows at its end to ceil(rows / world_size) rows, gather, "
             "then keep the first `rows` rows.",
             _cases_6_2, distributed=True, comm_checked=True, outputs=_outputs_6_2,
             hints=("padded = torch.zeros(rows_per_rank, *rest); padded[:len(shard)] = shard; "
                    "comm.all_gather(out, padded.reshape(-1), tag=..., group=group) with out = "
                    "torch.empty(world_size * padded.numel()); then out.view(world_size * "
                    "rows_per_rank, *rest)[:rows]. Loop over the names in order.",),
             mistakes=(
                 Mistake("an uneven all-gather",
                         "The last ranks hold fewer rows (or none), and an all-gather needs "
                         "the same number of elements from every rank: pad every shard to "
                         "ceil(rows / world_size) rows before gathering.", signal="SIGABRT"),
                 Mistake("the padding rows put before the shard's rows",
                         "Pad each shard at its end (after its rows): then the gathered rows "
                         "are in order, and the padding is what follows each rank's rows.",
                         matches(_padded_in_front)),
                 DTYPE_LOST,
                 Mistake("the padding rows kept",
                         "Drop the padding rows: keep the first `rows` rows of the gathered "
                         "tensor.", element(padding_kept, first_difference)),
                 Mistake("an all-reduce where an all-gather belongs",
                         "Each rank contributes different rows: an all-gather of padded "
                         "shards moves them, (N-1)/N of the full tensor's bytes. An all-reduce "
                         "of zero-filled full tensors gives the same values for twice the "
                         "bytes.", used_instead("all_reduce", "all_gather"), output="comm ops"),
                 Mistake("the shards themselves returned",
                         "A full state dict is saved while training goes on: return new "
                         "tensors (on one rank the shard holds every row, but it is the "
                         "model's live memory: copy it).",
                         lambda ev: bool(ev.got), output="in a shard's memory"),
                 Mistake("the full tensors: views into the padded buffer",
                         "A view of the gathered buffer keeps its padding rows alive with it, "
                         "in every saved tensor: .clone() the first `rows` rows, so that each "
                         "full tensor holds exactly its own bytes.",
                         lambda ev: bool(ev.got), output="in a bigger buffer")),
             read_only=("shards",)),
]
