"""One case of an engine exercise, run in the process that holds the engine: build the model,
build the engine, train STEPS steps on the case's batches, and measure. All of it comes back as
data (zerolab.grading.data) and is judged in the grader's process (engine_verdict.py).

Memory is measured by the grader, not asked of the engine: zerolab.memory's tracker watches
every storage the process allocates from before the model is built to the end of the case
(everything the engine, its hooks, autograd and the optimizer hold), and on the measured step
the grader sorts the live bytes by what it can see from outside the engine (engine_memory.py).

Per step: the loss, the state dict full_state_dict() returned (and whether the previous one
changed since: it must be a snapshot), the frozen parameters that got a .grad. On the measured
step: live bytes at the end of each forward and backward, after step() and at the peak, and
every collective with its phase, size, tag and whether it blocked.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from zerolab import comm, harness
from zerolab.grading import borrowed, flight
from zerolab.grading.check import is_stub
from zerolab.grading.data import encode
from zerolab.grading.engine_memory import Categories, Points, found_in, tracked
from zerolab.grading.engine_model import (
    BUCKET_BYTES,
    GLOBAL_BATCH,
    MEASURED,
    STEPS,
    Setting,
    make_model,
)
from zerolab.grading.exercise import Case


class _Waits:
    """Which collectives backward waited for: each parameter gets a hook of the grader's
    after the engine's (torch runs a parameter's post-accumulate-grad hooks in order), which
    sees the calls issued since its last run and those that have ended. A call that ended
    before another gradient was accumulated after its issue was waited for in the hook that
    issued it: backward stopped there (async_op=True in name only). zerolab's engines wait for
    the last ones as backward ends, in their last hook: one such call there is theirs too."""

    def __init__(self, model: torch.nn.Module, log: comm.CommLog):
        self.log, self.count, self.seen = log, 0, 0
        self.issued: dict[int, int] = {}  # id(event) -> gradients accumulated at its issue
        self.held: set[int] = set()
        self.decided: set[int] = set()
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated)
                        for p in model.parameters() if p.requires_grad]

    def _accumulated(self, param: torch.Tensor) -> None:
        events = self.log.events
        for e in events[self.seen:]:
            self.issued[id(e)] = self.count
        self.seen = len(events)
        for e in events:
            key = id(e)
            if key in self.issued and key not in self.decided and e.end is not None:
                self.decided.add(key)
                if self.issued[key] == self.count:
                    self.held.add(key)
        self.count += 1

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _calls(log: comm.CommLog, waits: _Waits) -> list[dict[str, Any]]:
    """Each collective: its phase, op, size, tag, whether it was issued async, and whether
    its phase waited for it ("held": blocking, or waited for in the hook that issued it)."""
    calls = []
    for e in log.events:
        phase = next((s.name for s in log.spans if s.start <= e.start <= s.end), "between")
        calls.append({"phase": phase, "op": e.op, "nbytes": e.nbytes, "tag": e.tag,
                      "async": e.async_op, "held": not e.async_op or id(e) in waits.held})
    return calls


def _distinct_bytes(state: Any) -> int:
    """The bytes of the distinct storages a state dict's tensors hold (a tied weight once)."""
    tensors = state.values() if isinstance(state, dict) else []
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _optimizers(engine: Any) -> list[torch.optim.Optimizer]:
    return found_in(engine, torch.optim.Optimizer)


def _gradients(engine: Any) -> dict[str, Any]:
    """What the engine's optimizers step with, after step(): the sum of every gradient's
    squares (over a rank's shards; across ranks it is the average gradient's, N times over for
    DDP: padding that is not zero adds to it) and the first tensor that holds a NaN or an inf
    (a parameter, or its .grad)."""
    total, bad = 0.0, None
    params = list({id(p): p for o in _optimizers(engine) for g in o.param_groups
                   for p in g["params"]}.values())
    for i, p in enumerate(params):
        for what, t in (("parameter", p), ("gradient", p.grad)):
            if t is None:
                continue
            local = t.detach()
            local = local.to_local() if hasattr(local, "to_local") else local
            if what == "gradient":
                total += float(local.double().pow(2).sum())
            if bad is None and not bool(torch.isfinite(local).all()):
                flat = local.reshape(-1)
                where = int((~torch.isfinite(flat)).nonzero()[0])
                bad = (f"the {what} of the optimizer's parameter {i} ({flat.numel()} "
                       f"elements) holds {float(flat[where])} at element {where}")
    return {"grad squares": total, "not finite": bad}


class _Driver:
    """Trains one engine on one case, step by step, and measures."""

    def __init__(self, engine: Any, model: torch.nn.Module, setting: Setting, rank: int,
                 world_size: int, group: dist.ProcessGroup | None, flight_path: str | None,
                 categories: Categories):
        self.engine, self.model, self.setting = engine, model, setting
        self.categories = categories  # told what the grader holds: not the engine's bytes
        self.rank, self.world_size, self.group = rank, world_size, group
        self.flight_path = flight_path
        self.previous: tuple[dict, Any] | None = None  # the last state dict, and its copy

    def batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = harness.local_batch(self.model.make_batch, GLOBAL_BATCH, self.setting.seed + step,
                                   self.rank, self.world_size)
        self.categories.hold([x, y])
        k = self.setting.micro_batches
        return list(zip(x.chunk(k), y.chunk(k)))

    def train(self, step: int, points: Points | None) -> float:
        """Forward and backward on each micro-batch, then step(); the loss."""
        k = self.setting.micro_batches
        loss = 0.0
        for i, (x, y) in enumerate(self.batches(step), start=1):
            with comm.span("forward"), points.saving() if points else contextlib.nullcontext():
                out = self.model.loss(self.engine(x), y) / k
            n = f" {i}" if k > 1 else ""
            if points:
                points.mark(f"at the end of forward{n}", f"forward{n}")
            with comm.span("backward"):
                out.backward()
            loss += out.item()
            del out
            if points:
                points.mark(f"at the end of backward{n}", f"backward{n}")
        with comm.span("step"):
            self.engine.step()
        if points:
            points.mark("after step()", "step()")
        return loss

    def finish(self, loss: float, points: Points | None = None) -> dict[str, Any]:
        """After step(): frozen parameters' .grad, what the optimizers step with, zero_grad(),
        the state dict (on the measured step: with the bytes it raised the rank's by)."""
        frozen = [n for n, p in self.model.named_parameters()
                  if not p.requires_grad and p.grad is not None]
        stale = self.stale()
        gradients = _gradients(self.engine)
        self.engine.zero_grad()
        rise = None
        if points is None:
            state = self.engine.full_state_dict()
        else:
            state, rise = points.rise(self.engine.full_state_dict)
        encoded = encode(state)
        self.categories.hold(encoded)
        # Kept until the next step, to see whether it changes (not in the measured case: what
        # a rank holds there is the engine's alone).
        keep = isinstance(state, dict) and not self.setting.measured
        self.previous = (state, encoded) if keep else None
        found = {"loss": loss, "state": encoded, "frozen grads": frozen, "stale": stale,
                 **gradients}
        if rise is not None:
            found["state dict rise"] = rise
            found["state dict bytes"] = _distinct_bytes(state)
        return found

    def stale(self) -> str | None:
        """The last state dict's first tensor whose values changed since it was returned."""
        if self.previous is None:
            return None
        state, copy = self.previous
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and isinstance(copy.get(key), torch.Tensor):
                now = encode(value)
                if not isinstance(now, torch.Tensor) or not torch.equal(now, copy[key]):
                    return key
        return None

    def measured_step(self, step: int, categories: Categories,
                      tracker: Any) -> dict[str, Any]:
        """A step under the comm recorder, with live bytes at each point."""
        points = Points(tracker, categories)
        with comm.record_comm(self.group, align=False) as log:
            stream = flight.streamed(log, self.flight_path) if self.flight_path else None
            waits = _Waits(self.model, log)
            try:
                loss = self.train(step, points)
            finally:
                waits.remove()
                if stream is not None:
                    stream.close()
        finished = self.finish(loss, points)
        return {**finished, "memory": points.data(), "calls": _calls(log, waits),
                "ring bytes": log.total_ring_bytes()}


def _check_borrowed(engine: Any, model: torch.nn.Module, learner_file: str | None) -> None:
    """A learner's engine that holds a reference engine (or let torch's FSDP wrap the model)
    is built on it: borrowed.Borrowed, which the worker turns into the verdict."""
    found = borrowed.in_engine(engine, model, learner_file) if learner_file else []
    if found:
        raise borrowed.Borrowed("; ".join(found[:3]))


def run_case(stage_name: str, engine_cls: type, case: Case, rank: int, world_size: int,
             group: dist.ProcessGroup | None, flight_path: str | None = None,
             learner_file: str | None = None) -> dict[str, Any]:
    """Train `engine_cls` (the learner's, or zerolab's reference) on one case; see above.
    learner_file: the learner's file the engine comes from (None: the reference)."""
    [setting] = case.make(rank)
    kwargs = dict(group=group, **setting.optimizer_kwargs)
    if stage_name != "zero3":  # ZeRO-3 reduces a unit at a time: no bucket size to give
        kwargs["bucket_bytes"] = BUCKET_BYTES
    categories = Categories()
    # Memory is measured on the measured case only, from before the model is built.
    with tracked(categories) if setting.measured else contextlib.nullcontext() as tracker:
        model = make_model()
        engine = engine_cls(model, setting.optimizer_cls, **kwargs)  # zerolab's, or the learner's
        _check_borrowed(engine, model, learner_file)
        categories.watch(model, engine)
        driver = _Driver(engine, model, setting, rank, world_size, group, flight_path,
                         categories)
        steps = []
        try:
            # The measured case ends with its measured step: the other cases train longer.
            for step in range(MEASURED + 1 if setting.measured else STEPS):
                if setting.measured and step == MEASURED:
                    steps.append(driver.measured_step(step, categories, tracker))
                else:
                    steps.append(driver.finish(driver.train(step, None)))
        except NotImplementedError as e:
            if is_stub(e):  # the constructor ran: a method is still to write
                e.zerolab_unwritten = True
            raise
        _check_borrowed(engine, model, learner_file)  # or built on one lazily
    hooked = [n for n, p in model.named_parameters() if getattr(p, "_backward_hooks", None)]
    return {"steps": steps, "tensor hooks": hooked}
