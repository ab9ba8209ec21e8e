"""Notebook 01's exercises (ex01_memory): model-state bytes, and measuring memory."""

from __future__ import annotations

from collections.abc import Callable

import torch

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import STAGES, fixed, stage_moved
from zerolab.grading.mistakes import Evidence, Mistake, any_of, matches, solution_with


def _cases_1_1() -> list[Case]:
    cases = []
    for num_params in (7e9, 1001):
        for p, g, k in ((4, 4, 8), (2, 2, 12)):
            for n in (1, 8, 64):
                for stage in STAGES:
                    cases.append(Case(f"Ψ={num_params:g}, N={n}, {stage}, bytes per parameter "
                                      f"(param, grad, optimizer)=({p}, {g}, {k})",
                                      fixed(num_params, n, stage, p, g, k)))
    return cases


def _other_stage(step: int) -> Mistake:
    """The numbers of the stage `step` stages later (1) or earlier (-1)."""
    more = "more" if step > 0 else "fewer"
    return Mistake(
        f"one category sharded too {'many' if step > 0 else 'few'}: "
        f"the numbers of {'the next' if step > 0 else 'the previous'} stage",
        f"You sharded {more} categories than this stage does. ZeRO-1 shards only the "
        f"optimizer state; ZeRO-2 the gradients too; ZeRO-3 the parameters too. What is not "
        f"sharded stays whole on every rank.",
        matches(solution_with(stage_moved(step))))


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

    def non_contiguous(rank: int) -> tuple:
        flat = torch.zeros(12)
        return ([flat.view(3, 4).t(), flat[::3], torch.zeros(6, 2)[:, 0]],)

    def other_dtype(rank: int) -> tuple:
        flat = torch.zeros(6, dtype=torch.float64)
        return ([flat.view(torch.int32), flat[2:4], torch.zeros(3, dtype=torch.bfloat16)],)

    return [Case("a (12,) buffer and three row views of it", views),
            Case("a tied weight listed twice", tied),
            Case("a (2,) slice of a (100,) tensor", small_slice),
            Case("a freed storage and a float64 tensor", freed),
            Case("parameters as views of one flat buffer, gradients apart", zero1_like),
            Case("float16, int64 and float32 tensors", dtypes),
            Case("non-contiguous views: a transpose, a strided slice, a column", non_contiguous),
            Case("a float64 buffer seen as int32, a slice of it, a bfloat16 tensor",
                 other_dtype)]


def _formula(ev: Evidence, whole: bool = False, fp32: bool = False) -> dict[str, float]:
    """1.1 with integer division (whole bytes), or with the fp32 byte counts whatever the
    arguments say."""
    num_params, n, stage, p, g, k = ev.inputs()
    if fp32:
        p, g, k = 4, 4, 8
    level = STAGES.index(stage)

    def part(nbytes: float, sharded: bool) -> float:
        total = nbytes * num_params
        return (total // n if whole else total / n) if sharded else total
    return {"params": part(p, level >= 3), "grads": part(g, level >= 2),
            "optimizer": part(k, level >= 1)}


def _counted(key: str, size: str) -> Callable[[Evidence], int]:
    """A wrong count: tensors deduplicated by `key` ("storage", "view start", "none"), each
    counted by `size` ("storage": its storage's bytes, "view": numel * element_size)."""
    def count(ev: Evidence) -> int:
        seen, total = set(), 0
        for i, t in enumerate(ev.inputs()[0]):
            k = {"storage": t.untyped_storage().data_ptr(), "view start": t.data_ptr(),
                 "none": i}[key]
            if k not in seen:
                seen.add(k)
                total += (t.untyped_storage().nbytes() if size == "storage"
                          else t.numel() * t.element_size())
        return total
    return count


def _contiguous_copies(ev: Evidence) -> int:
    """1.2 counted on .contiguous() copies: a non-contiguous view costs its elements."""
    seen, total = set(), 0
    for t in ev.inputs()[0]:
        if not t.is_contiguous():
            total += t.numel() * t.element_size()
        elif t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


EXERCISES = [
    Exercise("1.1", "ex01_memory", "model_state_bytes",
             "model-state bytes per rank for DDP and ZeRO-1/2/3, from the formulas",
             "ZeRO-1 shards only the optimizer state, ZeRO-2 the optimizer state and the "
             "gradients, ZeRO-3 all three; sharded means each rank holds 1/N of it, and what "
             "is not sharded is whole on every rank.",
             _cases_1_1,
             hints=("STAGES.index(stage), 0 to 3, counts how many of the three categories are "
                    "sharded, in the order optimizer state, gradients, parameters: divide "
                    "those by N.",),
             mistakes=(_other_stage(1), _other_stage(-1),
                       Mistake("whole bytes: integer division",
                               "Ψ/N need not be whole: divide with /, not //, and return "
                               "floats.", matches(lambda ev: _formula(ev, whole=True))),
                       Mistake("the bytes per parameter ignored",
                               "Use the param_bytes, grad_bytes and optimizer_bytes you are "
                               "given: mixed precision is 2, 2 and 12.",
                               matches(lambda ev: _formula(ev, fp32=True))))),
    Exercise("1.2", "ex01_memory", "distinct_storage_bytes",
             "measuring memory: count each storage once (views, tied weights, freed storage)",
             "Count storages, not tensors: two tensors share one when their "
             "t.untyped_storage().data_ptr() are equal, and a storage's size is "
             "t.untyped_storage().nbytes(), however few elements a view of it shows.",
             _cases_1_2,
             hints=("Keep a set of the storages' data_ptr() seen so far, and add nbytes() only "
                    "for a storage not seen yet.",),
             mistakes=(
                 Mistake("a non-contiguous view copied before counting",
                         ".contiguous() (and .reshape, .flatten) copy a non-contiguous view: "
                         "the copy's storage is not the one the view keeps alive. Read "
                         "t.untyped_storage() of the tensor itself.",
                         matches(_contiguous_copies)),
                 Mistake("the elements a tensor shows counted, not its whole storage",
                         "A view keeps its whole storage alive, and a freed storage holds 0 "
                         "bytes: count t.untyped_storage().nbytes(), not "
                         "numel * element_size.",
                         matches(_counted("storage", "view"))),
                 Mistake("a view's start taken for its storage",
                         "t.data_ptr() is where the tensor's first element is: two views of "
                         "one buffer start at different places. Compare the storages' "
                         "pointers, t.untyped_storage().data_ptr().",
                         any_of(matches(_counted("view start", "view")),
                                matches(_counted("view start", "storage")))),
                 Mistake("every storage counted once per tensor",
                         "Views and tied weights share a storage: count each storage once "
                         "(remember the data_ptr() of those already counted).",
                         matches(_counted("none", "storage"))),
                 Mistake("views and tied weights counted again",
                         "Adding numel * element_size per tensor counts shared memory "
                         "several times: count each storage once, all of it.",
                         matches(_counted("none", "view")))),
             read_only=("tensors",)),
]
