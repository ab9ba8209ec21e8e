"""Notebook 07's exercises (ex07_scaling): the largest model per stage, and a ring
collective's time by the latency-bandwidth model."""

from __future__ import annotations

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import STAGES, _fixed


def _cases_7_1() -> list[Case]:
    return [Case(f"{memory:g} bytes, N={n}, {stage}, {precision}",
                 _fixed(memory, n, stage, precision))
            for memory in (80e9, 24e9) for n in (1, 8, 64) for stage in STAGES
            for precision in ("fp32", "mixed")]


def _cases_7_2() -> list[Case]:
    return [Case(f"S={s:g} bytes, N={n}, {op}, latency {latency:g} s",
                 _fixed(s, n, op, 100e9, latency))
            for s in (28e9, 1000) for n in (1, 2, 8)
            for op in ("all_reduce", "reduce_scatter", "all_gather") for latency in (0.0, 5e-6)]


EXERCISES = [
    Exercise("7.1", "ex07_scaling", "largest_model",
             "the largest model that fits per stage, given memory, N and precision",
             "Mixed precision keeps fp32 master weights: K = 12, not 8. ZeRO-3 divides params, "
             "grads and optimizer state by N.",
             _cases_7_1),
    Exercise("7.2", "ex07_scaling", "ring_time",
             "the time of a ring collective by the latency-bandwidth model",
             "A step sends S/N bytes, not S; an all-reduce takes 2(N-1) steps, reduce-scatter "
             "and all-gather N-1.",
             _cases_7_2),
]
