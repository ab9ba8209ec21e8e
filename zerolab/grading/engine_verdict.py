"""The verdict on one case of an engine exercise, in the grader's process: the first thing in
which the learner's engine differs from zerolab's, said so that the learner can act on it.

What the two engines did on every rank arrives as data (engine_run.py). In order: step by step,
the loss, a frozen parameter's .grad, the parameters after step() (which one, by how much, and
how the update compares with the right one: N times too large is a sum instead of an average),
whether the last state dict changed since it was returned; then, on the measured step, whether
the ranks issued the same collectives, which collectives ran in forward, backward and step,
what every rank held at the end of each forward and backward, after step() and at the peak
(against zerolab's, with the stage's allowance: one bucket or unit in flight, and at rest only
padding), whether backward waited for its collectives, the size and order of each collective
(the buckets), their tags and the bytes sent. A finding the grader recognises names the kind of
mistake (engine_mistakes.py); otherwise the hint restates what the stage does.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import torch

from zerolab.grading import engine_mistakes as em
from zerolab.grading import flight
from zerolab.grading.compare import compare_tensors
from zerolab.grading.data import Freed
from zerolab.grading.engine_model import (
    FROZEN,
    LOSS_RTOL,
    PARAM_ATOL,
    Setting,
    Sizes,
    Stage,
    bucket_sizes,
    make_model,
)
from zerolab.grading.mistakes import Mistake

Record = dict[str, Any]
TAG_PHASES = {"forward": "fwd", "backward": "bwd", "step": "step"}
WORDS = {"params": "parameters", "grads": "gradients (.grad)", "optimizer": "optimizer state",
         "kept params": "parameters that autograd's saved tensors keep alive",
         "activations": "activations saved for backward",
         "other": "tensors that are no parameter, gradient or optimizer state (flattened "
                  "buffers, copies, received chunks)"}


def _wrong(output: str, message: str, mistake: Mistake | None = None, hint: str = "",
           rank: int | None = None) -> Record:
    record: Record = {"status": "wrong", "output": output, "message": message, "rank": rank}
    if mistake is not None:
        record.update(mistake=mistake.kind, hint=mistake.hint)
    elif hint:
        record["hint"] = hint
    return record


@functools.cache
def sizes_of(world_size: int) -> Sizes:
    return Sizes.of(make_model(), world_size)


@functools.cache
def _initial() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in make_model().state_dict().items()}


def verdict(stage: Stage, setting: Setting, world_size: int, expected: list[dict],
            got: list[dict]) -> Record:
    found = _verdict(stage, setting, world_size, expected, got)
    hooked = got[found.get("rank") or 0]["tensor hooks"] if found["status"] != "passed" else []
    if hooked:  # whatever showed it: gradients sent before they were complete
        found.update(mistake=em.TENSOR_HOOK.kind, hint=em.TENSOR_HOOK.hint)
        found["message"] += f" ({hooked[0]} has a hook from register_hook)"
    return found


def _verdict(stage: Stage, setting: Setting, world_size: int, expected: list[dict],
             got: list[dict]) -> Record:
    sizes = sizes_of(world_size)
    for rank in range(world_size):
        found = _steps(stage, setting, sizes, expected[rank], got[rank])
        if found is not None:
            return {**found, "rank": rank}
    found = _grad_squares(stage, sizes, expected, got)
    if found is not None:
        return found
    measured = [i for i, s in enumerate(expected[0]["steps"]) if "memory" in s]
    if not measured:
        return {"status": "passed"}
    i = measured[0]
    calls = [[c for c in g["steps"][i]["calls"]] for g in got]
    difference = flight.first_difference(calls, finished=True)
    if difference is not None:
        return _wrong("collectives", difference.describe(), em.RANKS_DIFFER)
    for rank in range(world_size):
        e, g = expected[rank]["steps"][i], got[rank]["steps"][i]
        for check in (_phases, _memory, _state_dict_memory, _blocking, _sizes, _tags,
                      _bytes_sent):
            if (found := check(stage, sizes, e, g)) is not None:
                return {**found, "rank": rank}
    return {"status": "passed"}


# ---- step by step --------------------------------------------------------------------------------


def _steps(stage: Stage, setting: Setting, sizes: Sizes, expected: dict,
           got: dict) -> Record | None:
    before = _initial()
    for step, (e, g) in enumerate(zip(expected["steps"], got["steps"]), start=1):
        if not math.isclose(g["loss"], e["loss"], rel_tol=LOSS_RTOL, abs_tol=1e-7):
            return _wrong(f"loss at step {step}", f"expected {e['loss']:.6g}, got "
                          f"{g['loss']:.6g} (the parameters before this step agreed)",
                          Mistake("forward changed", "The loss differs with the same "
                                     "parameters: every unit's parameters must be whole when "
                                     "its forward runs, and __call__ must run the model's "
                                     "forward on the input as it is.", output=""))
        if g["frozen grads"]:
            return _wrong(f"frozen parameters after step {step}",
                          f"{g['frozen grads']} (requires_grad=False) have a .grad",
                          em.FROZEN_TRAINED)
        found = _parameters(stage, setting, sizes, step, before, e["state"], g["state"])
        if found is not None:
            return found
        if g.get("not finite") and not e.get("not finite"):
            return _wrong(f"gradients after step {step}", f"{g['not finite']}, after step(): "
                          f"the parameters agree with zerolab's, so it is where no parameter's "
                          f"element lives: the padding", em.PADDING_NOT_ZERO)
        if g.get("stale"):
            return _wrong(f"state dict of step {step - 1}",
                          f"'{g['stale']}' changed after full_state_dict() returned it",
                          em.LIVE_STATE_DICT)
        before = e["state"]
    return None


def _parameters(stage: Stage, setting: Setting, sizes: Sizes, step: int,
                before: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                got: Any) -> Record | None:
    output = f"parameters after step {step}"
    if not isinstance(got, dict) or sorted(got) != sorted(expected):
        keys = sorted(got) if isinstance(got, dict) else type(got).__name__
        return _wrong(output, f"full_state_dict() keys: expected {sorted(expected)}, got {keys}",
                      em.STATE_DICT)
    for name in [*FROZEN, *(k for k in expected if k not in FROZEN)]:  # a frozen one: first
        e, g = expected[name], got[name]
        if isinstance(g, Freed):
            return _wrong(output, f"'{name}': {compare_tensors(e, g)}", em.LIVE_STATE_DICT)
        if not isinstance(g, torch.Tensor) or g.shape != e.shape:
            return _wrong(output, f"'{name}': {compare_tensors(e, g)}", em.STATE_DICT)
        if (g.double() - e.double()).abs().max() > PARAM_ATOL:
            why, mistake = _update(stage, setting, sizes, name, before[name], e, g)
            return _wrong(output, f"'{name}' differs from zerolab's {stage.label} by more than "
                          f"{PARAM_ATOL:g}: {compare_tensors(e, g)}; {why}", mistake)
    return None


def _update(stage: Stage, setting: Setting, sizes: Sizes, name: str, before: torch.Tensor,
            expected: torch.Tensor, got: torch.Tensor) -> tuple[str, Mistake]:
    """How the learner's update of a parameter compares with the right one, and why."""
    n = sizes.world_size
    if name in FROZEN:
        return "it is frozen, and it moved", em.FROZEN_TRAINED
    right, mine = (expected - before).double(), (got - before).double()
    if right.norm() == 0:
        return "it should not have moved", em.SPREAD
    k = float((mine * right).sum() / (right * right).sum())
    if (mine - k * right).norm() <= 0.02 * right.norm():  # proportional to the right update
        for ratio, mistake in em.ratio_mistakes(n):
            if (n > 1 or ratio in (0, 2, n / 2)) and abs(k - ratio) <= 0.02 * max(ratio, 1):
                if ratio == 0 and stage.name == "zero3":
                    mistake = em.STALE_UNITS
                return f"your update is {k:.2f}x the right one", mistake
    if setting.micro_batches > 1 and setting.optimizer_cls is torch.optim.SGD:
        return ("your update is not a multiple of the right one, and was right with one "
                "backward per step"), em.ACCUMULATION
    if n > 1:
        return ("your update is not a multiple of the right one (and was right on 1 rank?)",
                em.NOT_AVERAGED if stage.name == "ddp" else em.SPREAD)
    return "your update is not a multiple of the right one", em.WRONG_UPDATE


def _grad_squares(stage: Stage, sizes: Sizes, expected: list[dict],
                  got: list[dict]) -> Record | None:
    """The gradients the optimizers stepped with, squared and summed over every rank's
    parameters, step by step: with the parameters right, more than zerolab's is padding that
    is not zero (it reaches the padding's optimizer state and parameters, never a full
    tensor)."""
    for step, steps in enumerate(zip(*(r["steps"] for r in expected + got)), start=1):
        want = sum(s.get("grad squares", 0.0) for s in steps[:len(expected)])
        have = sum(s.get("grad squares", 0.0) for s in steps[len(expected):])
        if not math.isclose(have, want, rel_tol=1e-4, abs_tol=1e-12):
            return _wrong(f"gradients after step {step}",
                          f"the squares of every gradient the optimizers stepped with, summed "
                          f"over the ranks: expected {want:.6g} (zerolab's {stage.label}), got "
                          f"{have:.6g}; the parameters agree, so the difference is where no "
                          f"parameter's element lives: the padding", em.PADDING_NOT_ZERO)
    return None


# ---- the measured step ---------------------------------------------------------------------------


def _ops(step: dict, blocking: bool = False) -> Counter:
    """Collectives by (phase, op); blocking: only those their phase waited for."""
    return Counter((c["phase"], c["op"]) for c in step["calls"]
                   if not blocking or c.get("held", not c["async"]))


def _calls(ops: Counter) -> str:
    if not ops:
        return "no collective through zerolab.comm"
    return ", ".join(f"{op} x{k} in {phase}" for (phase, op), k in sorted(ops.items()))


def _phases(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    want, have = _ops(e), _ops(g)
    if set(want) == set(have):
        return None
    message = f"expected {_calls(want)}, got {_calls(have)}"
    if not have:
        return _wrong("collectives by phase", message, em.NO_COMM)
    extra = sorted(set(have) - set(want))
    phase, op = extra[0] if extra else sorted(set(want) - set(have))[0]
    return _wrong("collectives by phase", message,
                  em.phase_mistake(stage.name, op, phase, missing=not extra))


def _when(name: str) -> str:
    """"forward", "backward" or "rest", from a moment's name ("at the end of forward 1")."""
    return "rest" if name == "after step()" else name.split()[-2 if name[-1].isdigit() else -1]


def _memory(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    points = list(zip(e["memory"]["points"], g["memory"]["points"]))
    (e_peak, phase), (g_peak, _) = e["memory"]["peak"], g["memory"]["peak"]
    moments = [(name, _when(name), eb, gb) for (name, eb), (_, gb) in points]
    moments.append((f"at the step's peak (in {phase})", "peak", e_peak, g_peak))
    for name, when, want, have in moments:
        allowed = sizes.slack if when == "rest" else sizes.allowance(stage)
        if when != "rest" and stage.unit_of_work == "bucket":
            # zerolab's engines finish their reductions as backward ends (shell.py); an engine
            # that leaves the last one in flight until step() holds one bucket more till then
            allowed += sizes.bucket
        extra = sum(have.values()) - sum(want.values())
        if extra <= allowed:
            continue
        what = max(have, key=lambda c: have[c] - want.get(c, 0))
        more = have[what] - want.get(what, 0)
        allowance = ("padding" if when == "rest"
                     else f"one {stage.unit_of_work} in flight and padding")
        message = (f"{sum(have.values()):,} bytes alive {name}, zerolab's {stage.label} "
                   f"{sum(want.values()):,} (+ {allowed:,} allowed: {allowance}): "
                   f"{sizes.psi_of(extra)} more in all, the most in {WORDS[what]}: "
                   f"{sizes.psi_of(more)} ({more:,} bytes) more than zerolab's")
        return _wrong(f"memory {name}", message,
                      _memory_mistake(stage, sizes, when, what, extra, want.get(what, 0)),
                      hint=f"{stage.label} holds what its docstring says, measured: see "
                           f"'Measured' in the class docstring.")
    return None


def _state_dict_memory(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    """How far full_state_dict() raised the rank's live bytes at its peak: at most the copies
    it returns and one unit or bucket (gathered, or in flight) besides. A bound, not zerolab's
    figure: zerolab's ZeRO-3 keeps its root unit gathered while it copies the rest."""
    have, copies = g.get("state dict rise"), g.get("state dict bytes")
    if have is None or copies is None:
        return None
    allowed = copies + sizes.allowance(stage)
    if sum(have.values()) <= allowed:
        return None
    return _wrong("memory inside full_state_dict()",
                  f"full_state_dict() raised the bytes alive on the rank by "
                  f"{sum(have.values()):,} at its peak; the copies it returned hold "
                  f"{copies:,}, and one {stage.unit_of_work} and padding more are allowed "
                  f"({allowed:,} in all): {sizes.psi_of(sum(have.values()) - allowed)} more",
                  em.STATE_DICT_GATHERS_ALL if stage.name == "zero3" else em.STATE_DICT_MEMORY)


def _near(x: float, target: float, slack: float) -> bool:
    return abs(x - target) <= slack + 0.02 * target


def _memory_mistake(stage: Stage, sizes: Sizes, when: str, what: str, extra: int,
                    want: int) -> Mistake | None:
    n = sizes.world_size
    for nbytes in sizes.tied.values():
        if what in ("grads", "params") and any(_near(extra, nbytes / d, sizes.slack)
                                               for d in (1, n)):
            return em.TIED_TWICE
    if when == "rest" and what == "optimizer" and n > 1 and _near(want + extra, want * n,
                                                                   sizes.slack):
        return em.WHOLE_OPTIMIZER
    if (stage.name == "zero3" and when == "rest" and what == "params"
            and any(_near(extra, sizes.frozen * f, sizes.slack) for f in (1, (n - 1) / n))):
        return em.FROZEN_GATHERED  # the whole frozen layer, with or without its shard
    return em.memory_mistake(stage.name, when, what)


def _blocking(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    want, have = _ops(e, blocking=True), _ops(g, blocking=True)
    waited = {k: v for k, v in have.items() if k[0] == "backward" and v > want[k]}
    if waited and stage.name in em.BLOCKING:
        return _wrong("collectives by phase", f"backward waited for {_calls(Counter(waited))} "
                      f"(zerolab's {stage.label} for {want[next(iter(waited))]}): issued with "
                      "async_op=False, or waited for in the hook that issued them, before any "
                      "other gradient was computed; backward stopped until each was done",
                      em.BLOCKING[stage.name])
    return None


def _sizes(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    """Each collective's size, per phase and op (padding aside): in the order of issue during
    forward and backward (bucket and unit order), in any order in step()."""
    tolerance = 4 * (sizes.world_size - 1)
    for key in sorted(_ops(e)):
        want = [c["nbytes"] for c in e["calls"] if (c["phase"], c["op"]) == key]
        have = [c["nbytes"] for c in g["calls"] if (c["phase"], c["op"]) == key]
        if key[0] == "step":
            want, have = sorted(want), sorted(have)
        if len(want) == len(have) and all(abs(a - b) <= tolerance for a, b in zip(want, have)):
            continue
        phase, op = key
        message = (f"{op} in {phase}: expected {len(want)} of "
                   f"{_bytes_list(want)} bytes, in this order; got {len(have)} of "
                   f"{_bytes_list(have)}")
        return _wrong("collectives' sizes", message, _sizes_mistake(stage, phase, want, have,
                                                                      tolerance))
    return None


def _bytes_list(values: list[int]) -> str:
    shown = ", ".join(f"{v:,}" for v in values[:12])
    return f"[{shown}{', ...' if len(values) > 12 else ''}]"


def _sizes_mistake(stage: Stage, phase: str, want: list[int], have: list[int],
                   tolerance: int) -> Mistake:
    if stage.name != "zero3" and phase == "backward":
        forward = bucket_sizes(make_model(), forward_order=True)
        repeats = max(1, round(len(have) / max(1, len(forward))))
        if len(have) == len(forward) * repeats and all(
                abs(a - b) <= tolerance for a, b in zip(sorted(have), sorted(forward * repeats))):
            return em.BUCKETS_FORWARD
        return em.BUCKETS_OTHER
    op_count = "more" if len(have) > len(want) else "fewer"
    return Mistake(f"{op_count} collectives than zerolab's, or of other sizes",
                   f"One collective per {stage.unit_of_work}, of its flat buffer's size: "
                   f"{len(have)} where zerolab's {stage.label} makes {len(want)}.", output="")


def _tags(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    for c in g["calls"]:
        parts = c["tag"].split("/")
        if len(parts) < 3 or parts[0] != stage.name or parts[1] != TAG_PHASES.get(c["phase"]):
            want = f"{stage.name}/{TAG_PHASES.get(c['phase'], '<phase>')}/<name>"
            return _wrong("comm tags", f"{c['op']} in {c['phase']} is tagged '{c['tag']}', "
                          f"expected '{want}'", em.TAGS)
    return None


def _bytes_sent(stage: Stage, sizes: Sizes, e: dict, g: dict) -> Record | None:
    want, have = e["ring bytes"], g["ring bytes"]
    if abs(have - want) <= 3 * sizes.slack:
        return None
    ratio = f" ({have / want:.2f}x)" if want else ""
    return _wrong("bytes sent per step",
                  f"expected {want:,} ({stage.bytes_per_step} per step in the ring model, as "
                  f"zerolab's {stage.label}), got {have:,}{ratio}",
                  hint=f"{stage.label} sends {stage.bytes_per_step} per step: each gradient is "
                  "reduced once per backward and each parameter gathered once per use; a "
                  "buffer sent twice, or a collective bigger than its bucket, shows here.")
