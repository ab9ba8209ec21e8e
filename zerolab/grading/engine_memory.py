"""What a rank holds during an engine's measured step: every live storage, sorted by what the
grader can see from outside the engine, at named moments and at the peak.

The totals come from zerolab.memory's tracker over the whole process (`tracked`, started
before the model is built: every storage allocated since, whoever holds it, is watched; the
live bytes are summed after every op of the measured step, not before it: summing is what
costs). `Categories` is the
grader's own categorize callback, not the engine's report: the storages of the model's
parameters and of the parameters the engine's optimizers step ("params"), their .grad
("grads"), the optimizers' state ("optimizer"), what autograd saved for backward, split into
storages that held parameters during this step ("kept params": a unit freed by dropping
references lives on there) and the rest ("activations"), and what the grader itself holds
("grader": its copies of the state dicts, its batches; left out of every total). Everything
else is "other": flattened buffers, received chunks, copies, temporaries.

`Points` marks moments of the step (the end of each forward and backward, after step()) and
finds the step's peak and the phase it fell in.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from zerolab.memory import (
    MemoryTrace,
    SavedForBackward,
    TensorTracker,
    inner_tensors,
    optimizer_tensors,
)
from zerolab.parts.nest import tensors_in

GRADER = "grader"
SHOWN = ("params", "grads", "optimizer", "kept params", "activations", "other")


def found_in(obj: Any, kind: type, depth: int = 6, seen: set | None = None) -> list[Any]:
    """The objects of `kind` (optimizers, parameters) an engine keeps in its attributes, in
    lists, dicts and objects of its own a few levels down; not in the model (nor any module
    inside the engine)."""
    root = seen is None  # the engine itself, which may be a module (zerolab's are)
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0 or (isinstance(obj, torch.nn.Module) and not root):
        return []
    seen.add(id(obj))
    if isinstance(obj, kind):
        return [obj]
    if isinstance(obj, torch.Tensor | torch.optim.Optimizer):
        return []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, list | tuple):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return []
    return [o for item in items for o in found_in(item, kind, depth - 1, seen)]


class Categories:
    """The grader's categorize callback for track_memory (see the module docstring). Off
    (everything "other") until `active`: sorting costs time, and only the measured step needs
    it."""

    def __init__(self) -> None:
        self.active = False
        self.model: torch.nn.Module | None = None
        self.engine: Any = None
        self.grader: list[torch.Tensor] = []  # tensors the grader holds: never the learner's
        self.saved = SavedForBackward()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.params: list[torch.Tensor] = []
        self._params: dict[int, weakref.ref] = {}  # storages that held parameters this step

    def watch(self, model: torch.nn.Module, engine: Any) -> None:
        self.model, self.engine = model, engine

    def start(self) -> None:
        """Sort from now on (the engine's optimizers and shards are looked for once, here)."""
        self.optimizers = found_in(self.engine, torch.optim.Optimizer)
        shards = found_in(self.engine, torch.nn.Parameter)  # frozen shards are in no optimizer
        params = [*self.model.parameters(), *shards,
                  *(p for o in self.optimizers for g in o.param_groups for p in g["params"])]
        self.params = list({id(p): p for p in params}.values())
        self.active = True

    def hold(self, value: Any) -> None:
        """The grader keeps `value` (tensors, in lists and dicts) alive: not the engine's."""
        if isinstance(value, torch.Tensor):
            self.grader.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                self.hold(v)
        elif isinstance(value, list | tuple):
            for v in value:
                self.hold(v)

    def __call__(self) -> dict[str, list[torch.Tensor]]:
        if not self.active or self.model is None:
            return {}  # no moment is read now: the totals alone
        params = self.params
        for p in params:
            storage = p.untyped_storage()
            if storage.nbytes():
                self._params[id(storage)] = weakref.ref(storage)
        saved = self.saved.tensors()
        kept = [t for t in saved if self._held_params(t)]
        return {GRADER: self.grader, "params": params,
                "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": [t for o in self.optimizers for t in optimizer_tensors(o)],
                "kept params": kept, "activations": [t for t in saved if not self._held_params(t)]}

    def _held_params(self, t: torch.Tensor) -> bool:
        storage = t.untyped_storage()
        ref = self._params.get(id(storage))
        return ref is not None and ref() is storage


class Tracker(TensorTracker):
    """zerolab.memory's tracker (a TorchDispatchMode that watches every storage an op
    creates, and sums the live ones), summing only while `sampling`.

    Note: only what may be a peak is read. Sorting the live storages into categories (the
    callback lists every parameter, gradient, optimizer state and saved tensor) after each of
    the step's ~2,000 ops was 90% of an engine exercise's time. What a peak needs is cheaper:
    after an op the sizes are polled (a unit resized in place) and the shown bytes bounded from
    above (the storages the grader took since the last read still count as shown); only an op
    whose bound passes the most shown bytes sampled since the window began (`restart`) is read
    and sampled. The first op at a window's maximum is sampled, with the categories a read
    after every op would have given it (a read sorts by what is listed then), so the peak and
    its breakdown are the same; the samples in between, which no peak or mark reads, are not
    taken."""

    sampling = False
    best = 0  # the most shown bytes sampled since the window began

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A tensor subclass's own tensors (a DTensor's local shard) are made below this mode.
        for inner in (i for t in tensors_in(out) for i in inner_tensors(t)):
            self.watch(inner)
        if self.sampling:
            self._poll()
            if _shown_total(self.totals) > self.best:  # an upper bound: maybe a new peak
                self.sample()
        return out

    def _poll(self) -> None:
        """The sizes of the live storages again (a unit resized in place), but the grader's
        own: their bytes are never shown."""
        totals = self.totals
        for entry in self.live.values():
            if entry.category != GRADER and (storage := entry.ref()) is not None and \
                    (nbytes := storage.nbytes()) != entry.nbytes:
                totals[entry.category] += nbytes - entry.nbytes
                entry.nbytes = nbytes

    def sample(self) -> int:
        visits = super().sample()
        self.best = max(self.best, _shown_total(self.totals))
        return visits

    def restart(self) -> None:
        """A window begins with the sample just taken: its peak is looked for from here."""
        self.best = _shown_total(self.totals)


@contextlib.contextmanager
def tracked(categorize: Callable[[], dict[str, list[torch.Tensor]]]) -> Iterator[Tracker]:
    """Watch every storage the process allocates inside the block (as track_memory does)."""
    tracker = Tracker(categorize, MemoryTrace(), activations=False)
    tracker.sample()  # what exists at entry
    with tracker:
        yield tracker
    tracker.close()


class Points:
    """Live bytes at named moments of a step, and its peak (a mark closes a stretch of the
    trace: the peak's phase is the stretch it fell in)."""

    def __init__(self, tracker: Tracker, categories: Categories):
        self.tracker, self.trace, self.categories = tracker, tracker.trace, categories
        self.marks: list[tuple[str, str, int, dict[str, int]]] = []  # name, phase, index, bytes
        categories.start()
        tracker.sampling = True
        self.start = self._sample()
        tracker.restart()

    def _sample(self) -> int:
        self.tracker.sample()  # now: the frees since the last op included
        return len(self.trace.samples) - 1

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Autograd's saves inside the block are seen (as "kept params" or "activations")."""
        with self.categories.saved:
            yield

    def mark(self, name: str, phase: str) -> None:
        """Live bytes now, at the end of `phase` ("forward 1", "backward 1", "step()")."""
        index = self._sample()
        self.marks.append((name, phase, index, _shown(self.trace.samples[index][1])))

    def rise(self, fn: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
        """fn(), and how far the live bytes rose above those at its call at fn's peak, by
        category (a state dict's gathers: what one call holds at once)."""
        start = self._sample()
        self.tracker.restart()
        out = fn()
        end = self._sample()
        samples = self.trace.samples[start:end + 1]
        base = _shown(samples[0][1])
        top = max((_shown(s[1]) for s in samples), key=lambda by: sum(by.values()))
        return out, {c: top[c] - base[c] for c in SHOWN}

    def data(self) -> dict[str, Any]:
        """{"points": [[name, bytes by category]], "peak": [bytes by category, phase]}."""
        self.categories.active = False
        self.tracker.sampling = False
        samples = self.trace.samples[self.start:self.marks[-1][2] + 1]
        best = max(range(len(samples)), key=lambda i: sum(_shown(samples[i][1]).values()))
        index = self.start + best
        phase = next((phase for _, phase, end, _ in self.marks if index <= end), "step()")
        return {"points": [[name, by] for name, _, _, by in self.marks],
                "peak": [_shown(self.trace.samples[index][1]), phase]}


def _shown_total(by_category: dict[str, int]) -> int:
    return sum(by_category.get(c, 0) for c in SHOWN)


def _shown(by_category: dict[str, int]) -> dict[str, int]:
    """A sample's bytes by category, the grader's own left out."""
    return {c: by_category.get(c, 0) for c in SHOWN}
