"""Checking an engine exercise on one rank: train the learner's engine and zerolab's engine of
the same stage side by side, step by step on the same batches, and measure one step of each.

`check_engine` has the signature of check._check_case (it is the Exercise's `check`), so the
grader's ranks run it like any distributed exercise: a fresh process group per exercise, a
watchdog per case, agreement between ranks. Every rank runs every step of both engines, whatever
it finds (a rank that stopped early would leave the others waiting in a collective); the
comparison comes after, in engine_verdict.
"""

from __future__ import annotations

import functools
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerolab import harness
from zerolab.grading.check import _is_stub, _learner_traceback
from zerolab.grading.engine_model import (
    BUCKET_BYTES,
    GLOBAL_BATCH,
    MEASURED,
    STAGES,
    STEPS,
    Setting,
    Sizes,
    engine_cases,
    make_model,
)
from zerolab.grading.engine_verdict import Measure, StepResult, known_mistakes, verdict
from zerolab.grading.exercise import Case, Exercise
from zerolab.memory import model_state_bytes


class _Engine:
    """An engine as harness.train_step and measured_step see one. Memory is counted from the
    model too (every parameter, every .grad alive), not only from what state_tensors() lists."""

    def __init__(self, engine: Any, model: nn.Module, group: dist.ProcessGroup | None):
        self.engine, self.module, self.group, self.job_group = engine, model, group, group
        self.params = list(model.parameters())  # the same objects whatever .data they get

    def __call__(self, *args: Any) -> Any:
        return self.engine(*args)

    def step(self) -> None:
        self.engine.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def wait_params(self) -> None:  # zerolab's ZeRO-2 gathers asynchronously after step()
        getattr(self.engine, "wait_params", lambda: None)()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        state = self.engine.state_tensors()
        grads = [p.grad for p in self.params]
        return {"params": [*state.get("params", ()), *self.params],
                "grads": [t for t in (*state.get("grads", ()), *grads) if t is not None],
                "optimizer": [t for t in state.get("optimizer", ()) if t is not None]}

    def model_state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self.state_tensors())


def _measure(m: harness.MeasuredStep) -> Measure:
    def phase(start: float) -> str:
        return next((s.name for s in m.log.spans if s.start <= start <= s.end), "between")
    calls = [(phase(e.start), e.op, e.tag) for e in m.log.events]
    blocking = Counter(c[:2] for c, e in zip(calls, m.log.events) if not e.async_op)
    return Measure(dict(m.held), dict(m.memory.max_by_category), Counter(c[:2] for c in calls),
                   blocking, calls, m.log.total_ring_bytes())


def _train_step(engine: _Engine, x: torch.Tensor, y: torch.Tensor, measured: bool) -> StepResult:
    if measured:
        m = harness.measured_step(engine, x, y, zero_grad=False)
        loss, measure = m.loss, _measure(m)
    else:
        loss, measure = harness.train_step(engine, x, y).item(), None
    frozen = [n for n, p in engine.module.named_parameters()
              if not p.requires_grad and p.grad is not None]
    engine.zero_grad()
    state = engine.engine.full_state_dict()
    if isinstance(state, dict):  # copied here too: a dict of live tensors would move on
        state = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in state.items()}
    return StepResult(loss, state, frozen, measure)


class _LearnerRaised(Exception):
    """The learner's engine raised; `started` says whether its constructor had returned."""

    def __init__(self, error: Exception, started: bool):
        super().__init__(str(error))
        self.error, self.started = error, started


def _run(stage_name: str, learner_cls: type, setting: Setting, rank: int, world_size: int,
         group: dist.ProcessGroup | None) -> tuple[dict, list[StepResult], list[StepResult]]:
    """Both engines, step by step: (initial state, zerolab's steps, the learner's steps)."""
    models = make_model(), make_model()
    initial = {k: v.clone() for k, v in models[0].state_dict().items()}
    args = (setting.optimizer_cls,)
    kwargs = dict(group=group, **setting.optimizer_kwargs)
    if stage_name != "zero3":  # ZeRO-3 reduces a unit at a time: no bucket size to give
        kwargs["bucket_bytes"] = BUCKET_BYTES
    reference = _Engine(STAGES[stage_name].reference(models[0], *args, **kwargs), models[0],
                        group)
    try:
        learner = _Engine(learner_cls(models[1], *args, **kwargs), models[1], group)
    except Exception as e:
        raise _LearnerRaised(e, started=False) from e
    expected, got = [], []
    for step in range(STEPS):
        x, y = harness.local_batch(models[0].make_batch, GLOBAL_BATCH, setting.seed + step,
                                   rank, world_size)
        measured = setting.measured and step == MEASURED
        expected.append(_train_step(reference, x, y, measured))
        try:
            got.append(_train_step(learner, x, y, measured))
        except Exception as e:
            raise _LearnerRaised(e, started=True) from e
    return initial, expected, got


def check_engine(stage_name: str, ex: Exercise, learner: tuple[str, Callable],
                 solution: Callable, case: Case, rank: int = 0, world_size: int = 1,
                 group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """One case of an engine exercise on this rank: a record, as check._check_case returns.

    The reference is zerolab's engine of the stage (`solution`, the course's own answer in
    solutions/, is not needed: zerolab's engine is what the numbers in the notebooks come from).
    """
    learner_file, learner_cls = learner
    [setting] = case.make(rank)
    try:
        initial, expected, got = _run(stage_name, learner_cls, setting, rank, world_size, group)
    except _LearnerRaised as raised:
        e = raised.error
        if _is_stub(e) and not raised.started:
            return {"status": "stub"}
        todo = " (a method still to write)" if _is_stub(e) else ""
        return {"status": "raised", "message": f"{type(e).__name__}: {e}{todo}",
                "traceback": _learner_traceback(e, learner_file)}
    except Exception:
        return {"status": "error", "message": "zerolab's engine raised (a bug in the grader)",
                "traceback": traceback.format_exc()}
    sizes = Sizes.of(make_model(), world_size)
    return verdict(STAGES[stage_name], sizes, initial, expected, got)


def engine_exercise(exercise_id: str, module: str, cls: str, stage: str, teaches: str,
                    hint: str, hints: tuple[str, ...] = ()) -> Exercise:
    """An engine exercise: the class `cls` in `module`, graded against zerolab's `stage`."""
    return Exercise(exercise_id, module, cls, teaches, hint, engine_cases, distributed=True,
                    kind="engine", check=functools.partial(check_engine, stage), hints=hints,
                    mistakes=known_mistakes(STAGES[stage]))
