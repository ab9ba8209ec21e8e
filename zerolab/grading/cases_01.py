"""Notebook 01's exercises (ex01_memory): model-state bytes, and measuring memory."""

from __future__ import annotations

import torch

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import STAGES, _fixed


def _cases_1_1() -> list[Case]:
    cases = []
    for num_params in (7e9, 1001):
        for p, g, k in ((4, 4, 8), (2, 2, 12)):
            for n in (1, 8, 64):
                for stage in STAGES:
                    cases.append(Case(f"Ψ={num_params:g}, N={n}, {stage}, bytes per parameter "
                                      f"(param, grad, optimizer)=({p}, {g}, {k})",
                                      _fixed(num_params, n, stage, p, g, k)))
    return cases


def _cases_1_2() -> list[Case]:
    def views(rank: int) -> tuple:
        flat = torch.zeros(12)
        return ([flat, *flat.view(3, 4)],)

    def tied(rank: int) -> tuple:
        weight, bias = torch.zeros(5, 4), torch.zeros(4)
        return ([weight, bias, weight],)

    def small_slice(rank: int) -> tuple:
        return ([torch.zeros(100)[10:12]],)

    def freed(rank: int) -> tuple:
        t = torch.zeros(8)
        t.untyped_storage().resize_(0)
        return ([t, torch.zeros(3, dtype=torch.float64)],)

    def zero1_like(rank: int) -> tuple:
        flat = torch.zeros(10)
        params = [flat[:6].view(2, 3), flat[6:9], flat[9:]]
        grads = [torch.zeros(2, 3), torch.zeros(3), torch.zeros(1)]
        return ([*params, *grads, params[0]],)

    def dtypes(rank: int) -> tuple:
        return ([torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.int64),
                 torch.zeros(2, 2)],)

    return [Case("a (12,) buffer and three row views of it", views),
            Case("a tied weight listed twice", tied),
            Case("a (2,) slice of a (100,) tensor", small_slice),
            Case("a freed storage and a float64 tensor", freed),
            Case("parameters as views of one flat buffer, gradients apart", zero1_like),
            Case("float16, int64 and float32 tensors", dtypes)]


EXERCISES = [
    Exercise("1.1", "ex01_memory", "model_state_bytes",
             "model-state bytes per rank for DDP and ZeRO-1/2/3, from the formulas",
             "ZeRO-1 shards only the optimizer state, ZeRO-2 the optimizer state and the "
             "gradients, ZeRO-3 all three; what is not sharded is whole on every rank.",
             _cases_1_1),
    Exercise("1.2", "ex01_memory", "distinct_storage_bytes",
             "measuring memory: count each storage once (views, tied weights, freed storage)",
             "Key on t.untyped_storage().data_ptr() and add t.untyped_storage().nbytes(), "
             "not numel * element_size: a view shares (and keeps alive) its whole storage.",
             _cases_1_2),
]
