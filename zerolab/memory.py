"""Measure memory from the live tensors, never from a formula.

Two tools:

- `model_state_bytes(state)`: the bytes a rank holds now for parameters, gradients and optimizer
  state, counting every storage once (a view, a tied weight or a flat_param shared by many
  parameters is one storage).
- `track_memory(categorize)`: a context manager that follows every tensor allocated inside it and
  records live bytes over time by category, and the peak. On CPU it watches allocations with a
  TorchDispatchMode and frees with a finalizer on each storage; on CUDA it also reports the
  allocator's own peak.

A `categorize` callable returns {"params": tensors, "grads": tensors, "optimizer": tensors} for
what the model holds *right now* (engines have `state_tensors()` for this), and may add
"comm": the buffers a collective is using right now (ZeRO-2's flattened full gradient of the
bucket being reduce-scattered, the shard-sized copy an async parameter all-gather sends, qwZ's
int8 gather buffers). Engines keep those in an `InFlight`, which lists them without keeping them
alive. Everything else that is alive (activations, temporaries) is "other". Categories are read
after every op, so a tensor that an op allocates and Python code only then stores (a gradient
assigned to .grad) counts as "other" until the next op; totals are exact at every op. A storage
listed in two categories counts in the first: params, grads, optimizer, comm, activations.

`track_memory(categorize, activations=True)` adds an "activations" category: the storages
autograd holds *right now* to compute the backward (`SavedForBackward`: a
torch.autograd.graph.saved_tensors_hooks pair), parameters left out. It is what ZeRO does not
shard. Recomputed activations inside torch.utils.checkpoint's backward are held by checkpoint
itself, not by autograd's saved slots, and stay "other". With both, "other" is what is left:
temporaries.

`model_state_bytes` counts params, grads and optimizer only: comm buffers and activations come
and go within a step, and are no model state.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerolab.parts.nest import tensors_in

CATEGORIES = ("params", "grads", "optimizer")  # the model states
ACTIVATIONS = "activations"  # optional category: storages autograd saved for backward
StateTensors = dict[str, Iterable[torch.Tensor]]


def _storage_key(t: torch.Tensor) -> tuple | None:
    if t.is_meta:  # a shape without memory (a model built on the meta device)
        return None
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (storage.device.type, storage.device.index, storage.data_ptr())


def distinct_bytes(tensors: Iterable[torch.Tensor], seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (each storage counted once).

    `seen` carries the storages already counted elsewhere, so that one storage shared by two
    categories is counted in the first only.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        key = _storage_key(t)
        if key is not None and key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def model_state_bytes(state: StateTensors) -> dict[str, int]:
    """{"params": .., "grads": .., "optimizer": ..} bytes for the tensors in `state`."""
    seen: set = set()
    return {c: distinct_bytes(state.get(c, ()), seen) for c in CATEGORIES}


def module_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> StateTensors:
    """The state tensors of a plain (undistributed) module and its optimizer."""
    params = list(module.parameters())
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "optimizer": optimizer_tensors(optimizer) if optimizer is not None else [],
    }


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state (Adam: exp_avg, exp_avg_sq, step)."""
    return [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]


class InFlight:
    """The buffers an engine's collectives are using now, for its `state_tensors()["comm"]`.

        self.in_flight.add(full)            # a buffer made for a collective
        self.in_flight.tensors()            # the ones still alive

    References are weak: listing a buffer must not keep it alive longer than the code does (on
    gloo, the shard-sized copy an all-gather sends is copied from at once, and freed).
    """

    def __init__(self) -> None:
        self._alive: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary())

    def add(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self._alive[id(t)] = t

    def tensors(self) -> list[torch.Tensor]:
        return list(self._alive.values())


@dataclass
class MemoryTrace:
    """Live tensor bytes by category over a region of code, on one rank."""

    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (s, by category)
    peak_bytes: int = 0  # the largest total of live bytes
    peak_by_category: dict[str, int] = field(default_factory=dict)  # the breakdown at that peak
    max_by_category: dict[str, int] = field(default_factory=dict)  # each category's own maximum
    device_peak_bytes: int | None = None  # CUDA: the allocator's max_memory_allocated
    t0: float = 0.0  # perf_counter() when tracking started: sample times are relative to it

    def _add(self, t: float, by_category: dict[str, int]) -> None:
        self.samples.append((t, by_category))
        total = sum(by_category.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_by_category = dict(by_category)
        for c, b in by_category.items():
            self.max_by_category[c] = max(self.max_by_category.get(c, 0), b)


class _Held:
    """What the pack hook hands autograd instead of a tensor: autograd keeps it exactly as long
    as it keeps the saved tensor (until the backward that uses it, or the graph, is freed)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedForBackward:
    """Every tensor autograd saves for backward inside the `with` block, while autograd holds it.

        with SavedForBackward() as saved:
            loss = model(x).sum()          # each op saves what its backward needs
        saved.tensors()                    # alive now: everything forward saved
        loss.backward()                    # each node frees its saved tensors as it runs
        saved.tensors()                    # []

    `on_save(tensor)` is called for each save (a tensor saved by two ops, or two views of one
    storage, are seen twice: count storages, with `distinct_bytes`). Saving goes on working
    after the block ends; only new saves are no longer seen. One pair of saved-tensor hooks is
    active at a time: an inner one (torch.utils.checkpoint's, inside a checkpointed region)
    takes over from this one.
    """

    def __init__(self, on_save: Callable[[torch.Tensor], None] | None = None):
        self.on_save = on_save
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Held:
        held = _Held(tensor)
        self._held.add(held)
        if self.on_save is not None:
            self.on_save(tensor)
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def tensors(self) -> list[torch.Tensor]:
        """The saved tensors autograd still holds (views and repeats included)."""
        return [held.tensor for held in list(self._held)]

    def __enter__(self) -> SavedForBackward:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class _Tracker(TorchDispatchMode):
    """Sees every op's outputs; a finalizer on each new storage tells when it is freed."""

    def __init__(self, categorize: Callable[[], StateTensors] | None, trace: MemoryTrace,
                 saved: SavedForBackward | None = None):
        super().__init__()
        self.categorize = categorize or dict
        self.trace = trace
        self.saved = saved  # activations=True: what autograd holds for backward
        # id(storage) -> (weak reference, finalizer). Bytes are read at each sample, so that a
        # storage resized in place (how ZeRO-3 frees a gathered unit) is counted as it is now.
        self.live: dict[int, tuple[weakref.ref, weakref.finalize]] = {}
        self.t0 = trace.t0 = time.perf_counter()

    def watch(self, t: torch.Tensor) -> None:
        if t.is_meta:  # meta tensors report a size but hold no memory
            return
        storage = t.untyped_storage()
        key = id(storage)  # torch keeps one Python object per live storage
        if key not in self.live:
            self.live[key] = (weakref.ref(storage),
                              weakref.finalize(storage, self.live.pop, key, None))

    def sample(self) -> None:
        category_of: dict[int, str] = {}
        categories = dict(self.categorize())
        if self.saved is not None:  # after the model state: a saved weight stays "params"
            categories[ACTIVATIONS] = self.saved.tensors()
        for category, tensors in categories.items():
            for t in tensors:
                self.watch(t)  # state created outside dispatch (e.g. by the autograd engine)
                category_of.setdefault(id(t.untyped_storage()), category)
        by_category = dict.fromkeys((*CATEGORIES, *categories, "other"), 0)
        for key, (ref, _) in list(self.live.items()):
            storage = ref()
            if storage is not None:
                by_category[category_of.get(key, "other")] += storage.nbytes()
        if not self.trace.samples or self.trace.samples[-1][1] != by_category:
            self.trace._add(time.perf_counter() - self.t0, by_category)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tensors_in(out):
            self.watch(t)
        self.sample()  # after every op: allocations, frees and in-place resizes since the last
        return out

    def close(self) -> None:
        self.sample()
        for _, fin in self.live.values():
            fin.detach()
        self.live.clear()


class track_memory:  # noqa: N801 (used like a function: `with track_memory(...) as trace`)
    """Track live tensor bytes by category inside a `with` block; yields a MemoryTrace.

    Counts the model state present at entry plus every tensor allocated inside the block while it
    lives. On CUDA, `device_peak_bytes` is the allocator's peak over the block as well.
    activations=True: the storages autograd saves for backward inside the block are a category
    of their own, "activations" (see `SavedForBackward`), instead of "other".
    """

    def __init__(self, categorize: Callable[[], StateTensors] | None = None,
                 activations: bool = False):
        self.trace = MemoryTrace()
        self._saved = SavedForBackward() if activations else None
        self._tracker = _Tracker(categorize, self.trace, self._saved)

    def __enter__(self) -> MemoryTrace:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        self._tracker.sample()  # registers the state present at entry
        if self._saved is not None:
            self._saved.__enter__()
        self._tracker.__enter__()
        return self.trace

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        if self._saved is not None:
            self._saved.__exit__(*exc)
        self._tracker.close()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.trace.device_peak_bytes = torch.cuda.max_memory_allocated()
