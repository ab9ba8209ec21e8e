"""Notebook 07's exercises (ex07_scaling): the largest model per stage, and a ring
collective's time by the latency-bandwidth model."""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import STAGES, fixed, stage_moved
from zerolab.grading.mistakes import Evidence, Mistake, any_of, matches, solution_with


def _cases_7_1() -> list[Case]:
    # A few hundred bytes leave a fraction of a parameter over: rounding to the nearest
    # whole number, or up, then gives an answer that does not fit. N = 3, 5 and 9 make the
    # bytes per parameter a fraction no float holds: there a float quotient lands on the
    # wrong side of a whole number (80e9 on 5 ranks, ZeRO-3 fp32: 80e9 // 3.2 is
    # 24,999,999,999), which N = 1, 8 and 64 never show.
    return [Case(f"{memory:g} bytes, N={n}, {stage}, {precision}",
                 fixed(memory, n, stage, precision))
            for memory in (80e9, 24e9, 300.0, 1000.0) for n in (1, 3, 5, 8, 9, 64)
            for stage in STAGES for precision in ("fp32", "mixed")]


def _cases_7_2() -> list[Case]:
    return [Case(f"S={s:g} bytes, N={n}, {op}, latency {latency:g} s",
                 fixed(s, n, op, 100e9, latency))
            for s in (28e9, 1000) for n in (1, 2, 3, 8)
            for op in ("all_reduce", "reduce_scatter", "all_gather") for latency in (0.0, 5e-6)]


# ---- what the grader can tell apart ------------------------------------------------------------

_NO_MASTER_WEIGHTS = {"fp32": (4, 4, 8), "mixed": (2, 2, 8)}  # a wrong table: K = 8 mixed


def _params_that_fit(ev: Evidence, table: dict[str, tuple[int, int, int]] | None = None,
                     whole: Callable[[Any], Any] = math.floor, floats: bool = False) -> Any:
    """7.1's answer, with another bytes table or another way to make it whole; exact
    (fractions) unless `floats`: then whole(memory / per_param) of floats, and with whole=None
    the float floor division memory // per_param."""
    memory, n, stage, precision = ev.inputs()
    p, g, k = (table or {"fp32": (4, 4, 8), "mixed": (2, 2, 12)})[precision]
    level = STAGES.index(stage)
    shares = ((p, n if level >= 3 else 1), (g, n if level >= 2 else 1), (k, n if level >= 1 else 1))
    if not floats:
        return whole(Fraction(memory) / sum(Fraction(b, d) for b, d in shares))
    per_param = sum(b / d for b, d in shares)  # as a learner's floats add up
    return memory // per_param if whole is None else whole(memory / per_param)


def _seconds(ev: Evidence, steps: Callable[[str, int], int], per_step_bytes: str = "S/N",
             latency_per_step: bool = True) -> float:
    """7.2's answer by a wrong model: other step counts, whole messages, latency paid once."""
    nbytes, n, op, bandwidth, latency = ev.inputs()
    count = steps(op, n)
    message = nbytes / n if per_step_bytes == "S/N" else nbytes
    return (count * latency if latency_per_step else latency) + count * message / bandwidth


def _ring_steps(op: str, n: int) -> int:
    return (2 if op == "all_reduce" else 1) * (n - 1)


EXERCISES = [
    Exercise("7.1", "ex07_scaling", "largest_model",
             "the largest model that fits per stage, given memory, N and precision",
             "Mixed precision keeps fp32 master weights: K = 12, not 8. Each stage shards what "
             "1.1 says, and a sharded category costs 1/N per rank. The answer must fit: round "
             "down, never to the nearest.",
             _cases_7_1,
             hints=("Per rank, in N-ths of a byte: per_param_n = p * (1 if ZeRO-3 else N) + g * "
                    "(1 if ZeRO-2 or 3 else N) + k * (1 if ZeRO-1, 2 or 3 else N); return "
                    "int(memory_bytes) * N // per_param_n: whole numbers, no float rounding.",),
             mistakes=(
                 Mistake("rounded up or to the nearest, not down",
                         "A model of 18.75 parameters' worth of memory holds 18, not 19: round "
                         "down (math.floor); round() and math.ceil can give a model that does "
                         "not fit.",
                         any_of(matches(lambda ev: _params_that_fit(ev, whole=round)),
                                matches(lambda ev: _params_that_fit(ev, whole=math.ceil)))),
                 Mistake("a fraction of a parameter",
                         "Return a whole number of parameters: round the quotient down.",
                         matches(lambda ev: _params_that_fit(ev, whole=float))),
                 Mistake("a float quotient: one parameter off",
                         "With N = 3, 5 or 9 the bytes per parameter (16/5 = 3.2) is no exact "
                         "float, and memory / per_param lands just under a whole number that "
                         "fits exactly (and // on floats too). Count in whole bytes: a rank "
                         "holds Ψ·(p·a + g·b + k·c)/N bytes with a, b, c each 1 or N, so "
                         "Ψ = (memory · N) // (p·a + g·b + k·c) in integers (or use "
                         "fractions.Fraction).",
                         any_of(matches(lambda ev: _params_that_fit(ev, floats=True)),
                                matches(lambda ev: _params_that_fit(ev, whole=None,
                                                                   floats=True)))),
                 Mistake("mixed precision without the fp32 master weights",
                         "Mixed-precision Adam keeps fp32 master weights besides m and v: "
                         "K = 12, not 8.",
                         matches(lambda ev: _params_that_fit(ev, _NO_MASTER_WEIGHTS))),
                 Mistake("another stage's sharding",
                         "ZeRO-1 shards the optimizer state; ZeRO-2 the gradients too; ZeRO-3 "
                         "the parameters too (as in 1.1).",
                         any_of(matches(solution_with(stage_moved(1))),
                                matches(solution_with(stage_moved(-1)))))),
             ),
    Exercise("7.2", "ex07_scaling", "ring_time",
             "the time of a ring collective by the latency-bandwidth model",
             "A ring reduce-scatter or all-gather over N ranks runs N - 1 steps, an all-reduce "
             "2(N - 1); in each step every rank sends one chunk of S/N bytes, and pays the "
             "latency once.",
             _cases_7_2,
             hints=("steps * (latency + nbytes / world_size / bandwidth), with steps = "
                    "(2 if all_reduce else 1) * (world_size - 1).",),
             mistakes=(
                 Mistake("a step sends S, not S/N",
                         "A step sends one chunk of S/N bytes, not the whole tensor.",
                         matches(lambda ev: _seconds(ev, _ring_steps, per_step_bytes="S"))),
                 Mistake("an all-reduce counted as N - 1 steps",
                         "An all-reduce is a reduce-scatter then an all-gather: 2(N - 1) "
                         "steps.", matches(lambda ev: _seconds(ev, lambda op, n: n - 1))),
                 Mistake("N steps, not N - 1",
                         "A ring over N ranks needs N - 1 steps per pass: a rank never sends "
                         "a chunk back to where it started.",
                         matches(lambda ev: _seconds(
                             ev, lambda op, n: (2 if op == "all_reduce" else 1) * n))),
                 Mistake("the latency paid once, not per step",
                         "Every step is a message, and every message pays the latency.",
                         matches(lambda ev: _seconds(ev, _ring_steps,
                                                     latency_per_step=False)))),
             ),
]
