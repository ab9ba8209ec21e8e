"""The verdict on an engine exercise, on one rank: the first thing in which the learner's engine
differs from zerolab's, said so that the learner can act on it.

In order: step by step, the loss, a frozen parameter's .grad, the parameters after step()
(which one, by how much, and how the update compares with the right one: N times too large is a
sum instead of an average); then, on the measured step, the model-state bytes after step(), the
peak gradient / parameter bytes against the stage's bound, which collectives ran in forward,
backward and step, their tags, and the bytes sent. A finding the grader recognises names the
kind of mistake (a Mistake: its kind and hint; engine_model.STAGES holds the stage-specific
ones); otherwise the hint restates what the stage does.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from zerolab.grading.compare import _compare_tensors
from zerolab.grading.engine_model import FROZEN, LOSS_RTOL, PARAM_ATOL, Sizes, Stage
from zerolab.grading.mistakes import Mistake


@dataclass
class Measure:
    """One measured step of one engine on this rank."""

    held: dict[str, int]  # model-state bytes after step(), before zero_grad()
    peaks: dict[str, int]  # each category's largest live bytes during the step
    ops: Counter  # (phase, op) -> calls; phase: the span the call was issued in
    blocking: Counter  # (phase, op) -> calls made with async_op=False
    tags: list[tuple[str, str, str]]  # (phase, op, tag) of every call
    ring_bytes: int  # what this rank sent in the ring model


@dataclass
class StepResult:
    """What one engine did in one step on this rank."""

    loss: float
    state: dict[str, torch.Tensor]  # full_state_dict() after step()
    frozen_grads: list[str]  # frozen parameters that had a .grad after step()
    measure: Measure | None


Record = dict[str, Any]
CATEGORIES = ("params", "grads", "optimizer")
FORMULAS = {"params": "4Ψ", "grads": "4Ψ", "optimizer": "8Ψ"}  # fp32, AdamW
TAG_PHASES = {"forward": "fwd", "backward": "bwd", "step": "step"}

FROZEN_TRAINED = Mistake(
    "a frozen parameter trained",
    "A frozen parameter (requires_grad=False) gets no gradient and no optimizer state: leave "
    "it out of the buckets and of the optimizer (ZeRO-3: it has a flat buffer of its own, "
    "gathered with its unit, never reduced nor stepped).")
STATE_DICT = Mistake(
    "full_state_dict() incomplete",
    "full_state_dict() returns the model's state_dict() with full tensors, copied, on every "
    "rank: every key, the tied lm_head.weight too.")
TIED_TWICE = Mistake(
    "a tied weight held twice",
    "The extra bytes are one shared Parameter (two module names): collect parameters with "
    "model.parameters(), which lists a shared one once; its post-accumulate-grad hook fires "
    "once, after both uses.")
WHOLE_OPTIMIZER = Mistake(
    "optimizer state for the whole model",
    "Build the optimizer on this rank's shards only: its state is then 1/N of the model's.")
STATE_MISSING = Mistake(
    "state_tensors() incomplete",
    "state_tensors() lists every tensor the rank holds now, by category: it is how memory is "
    "measured.")
TAGS = Mistake(
    "comm tags not '<stage>/<phase>/<name>'",
    "Tag each collective '<stage>/<phase>/<name>': the stage, the phase it is issued in "
    "(fwd, bwd or step) and the bucket or unit it moves, so that the log reads like the "
    "algorithm.")
NO_COMM = Mistake(
    "no collective through zerolab.comm",
    "The grader sees the collectives that go through zerolab.comm (all_reduce, "
    "reduce_scatter, all_gather, with tag= and group=), not torch.distributed's own.")


def _ratio_mistakes(n: int, shown: str = "") -> list[tuple[float, Mistake]]:
    """Known ratios of the learner's update to the right one on N ranks, most likely first
    (`shown`: how N is written in the hints, default its value)."""
    shown = shown or str(n)
    return [(n, Mistake("gradients summed, not averaged",
                        f"Your update is {shown} times too large: the gradients were summed "
                        f"over the {shown} ranks, not averaged. Use op=\"avg\" (zerolab.comm "
                        "divides by N after the sum).")),
            (1 / n, Mistake("gradients averaged twice",
                            f"Your update is {shown} times too small: op=\"avg\" already "
                            "divides by N.")),
            (2, Mistake("a gradient counted twice",
                        "Your update is twice too large: a gradient reduced, or added into its "
                        "shard, twice (a hook that fires twice? a tied weight counted twice?)."
                        )),
            (0, Mistake("a parameter not stepped",
                        "Your update is zero: the optimizer did not step this parameter (is it "
                        "in the optimizer? ZeRO: was its shard all-gathered back?)."))]


def _wrong(output: str, message: str, mistake: Mistake | None = None,
           hint: str = "") -> Record:
    record = {"status": "wrong", "output": output, "message": message}
    if mistake is not None:
        record.update(mistake=mistake.kind, hint=mistake.hint)
    elif hint:
        record["hint"] = hint
    return record


def verdict(stage: Stage, sizes: Sizes, initial: dict[str, torch.Tensor],
            expected: list[StepResult], got: list[StepResult]) -> Record:
    before = initial
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        if not math.isclose(g.loss, e.loss, rel_tol=LOSS_RTOL, abs_tol=1e-7):
            return _wrong(f"loss at step {step}", f"expected {e.loss:.6g}, got {g.loss:.6g} "
                          "(the parameters before this step agreed)", stage.mistakes["loss"])
        if g.frozen_grads:
            return _wrong(f"frozen parameters after step {step}",
                          f"{g.frozen_grads} (requires_grad=False) have a .grad", FROZEN_TRAINED)
        if (found := _parameters(stage, sizes, step, before, e.state, g.state)) is not None:
            return found
        before = e.state
    for e, g in zip(expected, got):
        for check in (_held, _peaks, _phases, _tags, _bytes_sent):
            if e.measure is not None and (found := check(stage, sizes, e.measure, g.measure)):
                return found
    return {"status": "passed"}


# ---- parameters --------------------------------------------------------------------------------


def _parameters(stage: Stage, sizes: Sizes, step: int, before: dict[str, torch.Tensor],
                expected: dict[str, torch.Tensor], got: Any) -> Record | None:
    output = f"parameters after step {step}"
    if not isinstance(got, dict) or sorted(got) != sorted(expected):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        return _wrong(output, f"full_state_dict() keys: expected {sorted(expected)}, got {keys}",
                      STATE_DICT)
    for name in [FROZEN] + [k for k in expected if k != FROZEN]:  # a frozen one moved: first
        e, g = expected[name], got[name]
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            return _wrong(output, f"'{name}': {_compare_tensors(e, g)}", STATE_DICT)
        if (g.double() - e.double()).abs().max() > PARAM_ATOL:
            why, mistake = _update(stage, sizes, name, before[name], e, g)
            return _wrong(output, f"'{name}' differs from zerolab's {stage.label} by more than "
                          f"{PARAM_ATOL:g}: {_compare_tensors(e, g)}; {why}", mistake)
    return None


def _update(stage: Stage, sizes: Sizes, name: str, before: torch.Tensor,
            expected: torch.Tensor, got: torch.Tensor) -> tuple[str, Mistake]:
    """How the learner's update of a parameter compares with the right one, and why."""
    n = sizes.world_size
    if name == FROZEN:
        return "it is frozen, and it moved", FROZEN_TRAINED
    right, mine = (expected - before).double(), (got - before).double()
    if right.norm() == 0:
        return "it should not have moved", stage.mistakes["spread"]
    k = float((mine * right).sum() / (right * right).sum())
    if (mine - k * right).norm() <= 0.02 * right.norm():  # proportional to the right update
        for ratio, mistake in _ratio_mistakes(n):
            if (n > 1 or ratio in (0, 2)) and abs(k - ratio) <= 0.02 * max(ratio, 1):
                return f"your update is {k:.2f}x the right one", mistake
    if n > 1:
        return ("your update is not a multiple of the right one (and was right on 1 rank?)",
                stage.mistakes["spread"])
    return "your update is not a multiple of the right one", Mistake(
        "a wrong update",
        "Each parameter takes one optimizer step on its averaged gradient: build the optimizer "
        "with **optimizer_kwargs, and let every gradient reach it once.")


# ---- the measured step -------------------------------------------------------------------------


def _held(stage: Stage, sizes: Sizes, e: Measure, g: Measure) -> Record | None:
    for c in CATEGORIES:
        want, have = e.held.get(c, 0), g.held.get(c, 0)
        if abs(have - want) > sizes.slack:
            formula = FORMULAS[c] + ("/N" if c in stage.sharded else "")
            return _wrong("model-state bytes after step()",
                          f"{c}: expected {want:,} bytes ({stage.label} holds {formula} of "
                          f"them, + padding), got {have:,} ({have - want:+,})",
                          _held_mistake(stage, sizes, c, want, have),
                          f"{stage.label} holds {formula} of {c}: see the class docstring.")
    return None


def _near(x: float, target: float, slack: float) -> bool:
    return abs(x - target) <= slack + 0.02 * target


def _held_mistake(stage: Stage, sizes: Sizes, category: str, want: int,
                  have: int) -> Mistake | None:
    extra, n = have - want, sizes.world_size
    for nbytes in sizes.tied.values():
        if any(_near(extra, nbytes / d, sizes.slack) for d in (1, n)):
            return TIED_TWICE
    if extra < 0:
        return STATE_MISSING
    if category == "optimizer" and n > 1 and _near(have, want * n, sizes.slack):
        return WHOLE_OPTIMIZER
    return stage.mistakes.get(f"held {category}")


def _peaks(stage: Stage, sizes: Sizes, e: Measure, g: Measure) -> Record | None:
    for c, (bound, why) in stage.peak_bounds(sizes).items():
        have = g.peaks.get(c, 0)
        if have > bound + sizes.slack:
            return _wrong(f"peak {c} bytes during the step",
                          f"{have:,}, above the bound {bound + sizes.slack:,} = {why} "
                          f"+ padding (zerolab's {stage.label}: {e.peaks.get(c, 0):,})",
                          stage.mistakes[f"peak {c}"])
    return None


def _calls(ops: Counter) -> str:
    if not ops:
        return "no collective through zerolab.comm"
    return ", ".join(f"{op} x{k} in {phase}" for (phase, op), k in sorted(ops.items()))


def _phases(stage: Stage, sizes: Sizes, e: Measure, g: Measure) -> Record | None:
    message = f"expected {_calls(e.ops)}, got {_calls(g.ops)}"
    if set(g.ops) != set(e.ops):
        if not g.ops:
            mistake = NO_COMM
        elif {op for _, op in g.ops} - {op for _, op in e.ops} and "all_reduce" in stage.mistakes:
            mistake = stage.mistakes["all_reduce"]
        else:
            mistake = stage.mistakes["late"]
        return _wrong("collectives by phase", message, mistake)
    waited = {key for key in g.blocking if key[0] == "backward" and not e.blocking[key]}
    if waited and "blocking" in stage.mistakes:
        waits = Counter({key: g.blocking[key] for key in waited})
        return _wrong("collectives by phase", f"{_calls(waits)} issued with "
                      "async_op=False: backward stopped until each was done",
                      stage.mistakes["blocking"])
    per = "unit" if stage.name == "zero3" else "bucket of about bucket_bytes"
    for (phase, op), want in e.ops.items():
        have = g.ops[phase, op]
        if have > 2 * want + 1 or 2 * have + 1 < want:
            return _wrong("collectives by phase", message, Mistake(
                f"{'too many' if have > want else 'too few'} collectives",
                f"One {op} per {per}: {have} calls in {phase} where zerolab's {stage.label} "
                f"makes {want}."))
    return None


def _tags(stage: Stage, sizes: Sizes, e: Measure, g: Measure) -> Record | None:
    for phase, op, tag in g.tags:
        parts = tag.split("/")
        if len(parts) < 3 or parts[0] != stage.name or parts[1] != TAG_PHASES.get(phase):
            want = f"{stage.name}/{TAG_PHASES.get(phase, '<phase>')}/<name>"
            return _wrong("comm tags", f"{op} in {phase} is tagged '{tag}', expected '{want}'",
                          TAGS)
    return None


def _bytes_sent(stage: Stage, sizes: Sizes, e: Measure, g: Measure) -> Record | None:
    if abs(g.ring_bytes - e.ring_bytes) <= 3 * sizes.slack:
        return None
    ratio = f" ({g.ring_bytes / e.ring_bytes:.2f}x)" if e.ring_bytes else ""
    return _wrong("bytes sent per step",
                  f"expected {e.ring_bytes:,} ({stage.bytes_per_step} in the ring model, as "
                  f"zerolab's {stage.label}), got {g.ring_bytes:,}{ratio}",
                  hint=f"{stage.label} sends {stage.bytes_per_step} per step: each gradient is "
                  "reduced once and each parameter gathered once per use; a buffer sent twice, "
                  "or a collective bigger than its bucket, shows here.")


def known_mistakes(stage: Stage) -> tuple[Mistake, ...]:
    """Every kind of mistake the grader names for this stage (for `hint(..., all_levels=True)`)."""
    common = (FROZEN_TRAINED, TIED_TWICE, WHOLE_OPTIMIZER, STATE_MISSING, STATE_DICT, TAGS,
              NO_COMM)
    return (*(m for _, m in _ratio_mistakes(2, "N")), *stage.mistakes.values(), *common)
