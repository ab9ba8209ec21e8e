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
An optimizer's state is given as `Settled(...)`: it changes only inside `optimizer.step()`, so
the tracker reads it when a step is over instead of after every op (see the Note in TensorTracker).

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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from zerolab.parts.nest import tensors_in
from zerolab.parts.storages import (  # noqa: F401 (zerolab.memory's public names)
    CATEGORIES,
    StateTensors,
    distinct_bytes,
    model_state_bytes,
    storage_key,
)

ACTIVATIONS = "activations"  # optional category: storages autograd saved for backward


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


class Settled:
    """A category's tensors that change only inside `optimizer.step()`: an optimizer's state.

        state["optimizer"] = Settled(lambda: optimizer_tensors(optimizer))

    Iterated, it lists them as they are now, as a list would. track_memory reads it at entry,
    when an optimizer step is over, and at exit, not after every op: with the tiles
    (parts/tiles.py) an optimizer holds hundreds of tensors, and reading them after every op
    made a tracked step cost up to 12 plain ones. Its storages must not be resized in place."""

    __slots__ = ("read",)

    def __init__(self, read: Callable[[], Iterable[torch.Tensor]]):
        self.read = read

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self.read())


@dataclass
class MemoryTrace:
    """Live tensor bytes by category over a region of code, on one rank."""

    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (s, by category)
    peak_bytes: int = 0  # the largest total of live bytes
    peak_by_category: dict[str, int] = field(default_factory=dict)  # the breakdown at that peak
    max_by_category: dict[str, int] = field(default_factory=dict)  # each category's own maximum
    device_peak_bytes: int | None = None  # CUDA: the allocator's max_memory_allocated
    device_entry_bytes: int | None = None  # CUDA: the allocator's memory_allocated at entry
    t0: float = 0.0  # perf_counter() when tracking started: sample times are relative to it
    # What tracking cost, counted (tests hold the tracker to it, without a clock):
    ops: int = 0  # ops seen
    visits: int = 0  # tensors and storages looked at after ops: outputs, listed state, sizes
    full_reads: int = 0  # reads of every category, Settled ones included (entry, steps, exit)

    def _add(self, t: float, by_category: dict[str, int]) -> None:
        self.samples.append((t, by_category))
        total = sum(by_category.values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            self.peak_by_category = dict(by_category)
        for c, b in by_category.items():
            self.max_by_category[c] = max(self.max_by_category.get(c, 0), b)

    def rises(self) -> tuple[int, int | None]:
        """(the tracker's peak above the bytes it counted at entry, the CUDA allocator's peak
        above what it held at entry, or None off CUDA): what each saw the block add, the same
        quantity measured two ways. The allocator rounds every block up to 512 bytes."""
        entry = sum(self.samples[0][1].values()) if self.samples else 0
        device = (None if self.device_peak_bytes is None or self.device_entry_bytes is None
                  else self.device_peak_bytes - self.device_entry_bytes)
        return self.peak_bytes - entry, device

    def _recount(self) -> None:
        """The peak and the maxima again, from samples that were relabelled."""
        samples, self.peak_bytes, self.max_by_category = list(self.samples), 0, {}
        self.samples.clear()
        for t, by_category in samples:
            self._add(t, by_category)


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
    storage, are seen twice: count storages, with `distinct_bytes`); `on_release(token)`, with
    what on_save returned, when autograd lets that save go. Saving goes on working after the
    block ends; only new saves are no longer seen. One pair of saved-tensor hooks is active at
    a time: an inner one (torch.utils.checkpoint's, inside a checkpointed region) takes over
    from this one.
    """

    def __init__(self, on_save: Callable[[torch.Tensor], object] | None = None,
                 on_release: Callable[[object], None] | None = None):
        self.on_save = on_save
        self.on_release = on_release
        self._held: weakref.WeakSet[_Held] = weakref.WeakSet()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Held:
        held = _Held(tensor)
        self._held.add(held)
        token = self.on_save(tensor) if self.on_save is not None else None
        if self.on_release is not None:  # runs before `held` lets go of the tensor
            weakref.finalize(held, self.on_release, token)
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


class _Storage:
    """One live storage in the tracker's ledger: a weak reference, bytes and category as last
    read, and for one made inside an optimizer step the first sample after it."""

    __slots__ = ("ref", "nbytes", "category", "born")

    def __init__(self, ref: weakref.ref, nbytes: int):
        self.ref, self.nbytes, self.category, self.born = ref, nbytes, "other", None


class TensorTracker(TorchDispatchMode):
    """Sees every op's outputs; a finalizer on each new storage tells when it is freed."""

    # Note: a ledger, not a census. The tracker keeps every live storage with its bytes and
    # category, and totals by category; after an op it looks only at what can have changed:
    # the op's outputs, the storages freed since (their finalizers took them off), what
    # `categorize` lists now, and the sizes of storages that may have been resized in place
    # (how ZeRO-3 frees a unit): every live storage but a Settled category's. A Settled one
    # (an optimizer's state) is read at entry, when an optimizer step is over (torch's global
    # optimizer hooks) and at exit. Inside optimizer.step() nothing is read: optimizers store
    # what they create there at once, so when the step is over what it made and kept gets its
    # category from the op after the one that made it (the samples since are relabelled), as
    # reading everything after every op would have given. So the work after an op does not
    # grow with the optimizer's tensors, and the figures are the same.

    def __init__(self, categorize: Callable[[], StateTensors] | None, trace: MemoryTrace,
                 activations: bool):
        super().__init__()
        self.categorize, self.trace = categorize or dict, trace
        self.live: dict[int, _Storage] = {}  # id(storage) -> entry (polled for its size)
        self.fixed: dict[int, _Storage] = {}  # entries of Settled categories (not polled)
        self.finalizers: dict[int, weakref.finalize] = {}
        self.listed: dict[int, tuple[int, str]] = {}  # by the categories read after every op
        self.settled: dict[int, tuple[int, str]] = {}  # by the Settled ones: (position, name)
        self.held: dict[int, int] = {}  # storages autograd holds for backward: how many saves
        self.names = [*CATEGORIES, *([ACTIVATIONS] if activations else []), "other"]
        self.totals = dict.fromkeys(self.names, 0)
        self.in_step, self.closed = 0, False  # inside optimizer.step(): nothing is read
        self.read_all = True  # a step is over: read the Settled categories too
        self.born: list[int] = []  # storages made inside steps, not yet given a category
        self.step_start: int | None = None  # the first sample taken inside those steps
        self.t0 = trace.t0 = time.perf_counter()

    # ---- the ledger --------------------------------------------------------------------------

    def watch(self, t: torch.Tensor) -> int | None:
        """Take t's storage into the ledger (if new); its key."""
        if t.is_meta:  # meta tensors report a size but hold no memory
            return None
        storage = t.untyped_storage()
        key = id(storage)  # torch keeps one Python object per live storage
        if key not in self.live and key not in self.fixed:
            self._new(storage, key)
        return key

    def _new(self, storage: torch.UntypedStorage, key: int) -> None:
        for stale in (self.listed, self.settled, self.held):  # a dead storage had this id
            stale.pop(key, None)
        entry = _Storage(weakref.ref(storage), storage.nbytes())
        self.live[key] = entry
        self.totals["other"] += entry.nbytes
        self.finalizers[key] = weakref.finalize(storage, self._freed, key)
        if self.in_step:
            self.born.append(key)

    def _freed(self, key: int) -> None:
        entry = self.live.pop(key, None) or self.fixed.pop(key)
        self.totals[entry.category] -= entry.nbytes
        del self.finalizers[key]
        self.listed.pop(key, None)
        self.settled.pop(key, None)
        self.held.pop(key, None)

    def _decide(self, key: int) -> None:
        """Give the storage the category it has now: the first that lists it."""
        entry = self.live.get(key) or self.fixed.get(key)
        if entry is None:
            return
        settled = self.settled.get(key)
        listings = [c for c in (self.listed.get(key), settled) if c]  # (position, name)
        category = min(listings)[1] if listings else (
            ACTIVATIONS if self.held.get(key) else "other")
        if category != entry.category:
            self.totals[entry.category] -= entry.nbytes
            self.totals[category] += entry.nbytes
            entry.category = category
        is_fixed = settled is not None and category == settled[1]
        if is_fixed and key in self.live:
            self.fixed[key] = self.live.pop(key)
        elif not is_fixed and key in self.fixed:
            self.live[key] = self.fixed.pop(key)

    def _resized(self, entries: Iterable[_Storage]) -> int:
        """Read the sizes of `entries` again (a storage resized in place); how many."""
        entries = list(entries)
        for entry in entries:
            storage = entry.ref()
            if storage is not None and (nbytes := storage.nbytes()) != entry.nbytes:
                self.totals[entry.category] += nbytes - entry.nbytes
                entry.nbytes = nbytes
        return len(entries)

    # ---- reading the categories --------------------------------------------------------------

    def read(self, everything: bool = False) -> int:
        """Read the categories now (the Settled ones too if `everything`), and the sizes; how
        many tensors and storages that looked at."""
        categories = dict(self.categorize())
        for name in (n for n in categories if n not in self.totals):  # before activations/other
            self.names.insert(len(self.names) - 1 - (ACTIVATIONS in self.names), name)
            self.totals = {n: self.totals.get(n, 0) for n in self.names}
        listed, settled, visits = {}, {}, 0  # storage -> (position, category) of its first
        for position, (name, tensors) in enumerate(categories.items()):
            if isinstance(tensors, Settled) and not everything:
                continue
            into, tag = settled if isinstance(tensors, Settled) else listed, (position, name)
            for t in tensors:
                visits += 1
                key = self.watch(t)  # (one made outside dispatch, by autograd: taken in now)
                if key is not None and key not in into:
                    into[key] = tag
        # Only the storages whose listing changed since the last read can change category.
        changed = {key for key, _ in self.listed.items() ^ listed.items()}
        self.listed = listed
        if everything:
            changed |= {key for key, _ in self.settled.items() ^ settled.items()}
            self.settled = settled
            self.trace.full_reads += 1
        for key in changed:
            self._decide(key)
        visits += self._resized(self.live.values())
        if everything:
            self._resized(self.fixed.values())
            self._relabel()
        return visits

    def _relabel(self) -> None:
        """Storages made inside the optimizer step just over and kept as state: theirs from the
        op after the one that made them. Then, of the samples taken after every op inside the
        step, only those the totals changed at."""
        for key in self.born:
            entry = self.live.get(key) or self.fixed.get(key)
            if entry is not None and entry.born is not None and entry.category != "other":
                for _, by_category in self.trace.samples[entry.born:]:
                    by_category["other"] -= entry.nbytes
                    by_category[entry.category] = by_category.get(entry.category, 0) + entry.nbytes
        self.born = []
        if self.step_start is not None:
            samples = self.trace.samples
            kept = samples[:self.step_start]
            for sample in samples[self.step_start:]:
                if not kept or kept[-1][1] != sample[1]:
                    kept.append(sample)
            samples[:], self.step_start = kept, None
            self.trace._recount()

    # ---- events --------------------------------------------------------------------------------

    def sample(self) -> int:
        """Read what can have changed and record the totals if they did; the work it took."""
        visits = 0
        if not self.in_step:
            visits = self.read(everything=self.read_all)
            self.read_all = False
        if self.in_step or not self.trace.samples or self.trace.samples[-1][1] != self.totals:
            self.trace._add(time.perf_counter() - self.t0, dict(self.totals))
        return visits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        reading_all, new, visits = self.read_all, len(self.born), 0
        for inner in (i for t in tensors_in(out) for i in inner_tensors(t)):
            visits += 1
            self.watch(inner)
        visits += self.sample()  # after every op: allocations, frees and resizes since the last
        for key in self.born[new:]:  # made inside a step: the samples after this op
            if (entry := self.live.get(key)) is not None:
                entry.born = len(self.trace.samples)
        self.trace.ops += 1
        if not reading_all:  # (a read of everything is counted in full_reads, not here)
            self.trace.visits += visits
        return out

    def step_begins(self, *_) -> None:
        if not self.in_step:
            self.sample()  # what Python code changed since the last op
            if self.step_start is None:
                self.step_start = len(self.trace.samples)
        self.in_step += 1

    def step_ends(self, *_) -> None:
        self.in_step -= 1
        self.read_all = True  # at the next op: the optimizer's own post-step hooks run first

    def saved(self, t: torch.Tensor) -> int | None:
        """autograd saved t for backward (activations=True)."""
        if self.closed or (key := self.watch(t)) is None:
            return None
        self.held[key] = self.held.get(key, 0) + 1
        self._decide(key)
        return key

    def released(self, key: int | None) -> None:
        if self.closed or key not in self.held:
            return
        self.held[key] -= 1
        if not self.held[key]:
            del self.held[key]
        self._decide(key)

    def close(self) -> None:
        self.in_step, self.read_all = 0, True
        self.sample()
        self.closed = True
        for fin in self.finalizers.values():
            fin.detach()
        self.finalizers, self.live, self.fixed = {}, {}, {}


def inner_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """t, or the tensors a tensor subclass wraps (a DTensor's local shard): the ops inside a
    subclass's own dispatch, which make those, run below this mode and are not seen by it."""
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    for name in t.__tensor_flatten__()[0]:  # (a DTensor lists its device mesh too)
        if isinstance(inner := getattr(t, name), torch.Tensor):
            yield from inner_tensors(inner)


class track_memory:  # noqa: N801 (used like a function: `with track_memory(...) as trace`)
    """Track live tensor bytes by category inside a `with` block; yields a MemoryTrace.

    Counts the model state present at entry plus every tensor allocated inside the block while it
    lives. On CUDA, `device_peak_bytes` is the allocator's peak over the block as well, and
    `device_entry_bytes` what it held at entry: the allocator counts every tensor of the process
    (another model's too), so compare what each saw the block add (`rises`).
    activations=True: the storages autograd saves for backward inside the block are a category
    of their own, "activations" (see `SavedForBackward`), instead of "other".
    """

    def __init__(self, categorize: Callable[[], StateTensors] | None = None,
                 activations: bool = False):
        self.trace = MemoryTrace()
        self._tracker = TensorTracker(categorize, self.trace, activations)
        self._saved = (SavedForBackward(self._tracker.saved, self._tracker.released)
                       if activations else None)

    def __enter__(self) -> MemoryTrace:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self.trace.device_entry_bytes = torch.cuda.memory_allocated()
        self._tracker.sample()  # registers the state present at entry
        if self._saved is not None:
            self._saved.__enter__()
        # torch's global optimizer hooks: every optimizer's step, whoever built it
        self._hooks = [register_optimizer_step_pre_hook(self._tracker.step_begins),
                       register_optimizer_step_post_hook(self._tracker.step_ends)]
        self._tracker.__enter__()
        return self.trace

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        if self._saved is not None:
            self._saved.__exit__(*exc)
        self._tracker.close()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.trace.device_peak_bytes = torch.cuda.max_memory_allocated()
