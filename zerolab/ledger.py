"""A ledger for every byte of one rank's peak in a training step.

    ledger = zerolab.ledger.measure(engine, x, y)    # one step, forward to step()
    ledger.rows            # bytes at the peak, by what they are (ROWS), padding apart
    ledger.unexplained     # what nothing claims; ledger.table(): the rows, printed

"Memory did not drop as the formula said" is the most common complaint about ZeRO and FSDP:
a formula counts model states; a measured peak holds more. The peak here is zerolab.memory's
(`track_memory(engine.state_tensors, activations=True)`: the largest total of live storages
during forward, backward and step), and each storage alive at that moment is put in one row:

- params, grads, optimizer, comm: what the engine says it holds (`state_tensors()`); the
  model's buffers (BatchNorm's statistics, ...); the inputs (the batch: x and y, with the
  storages they are views of); less
  - padding: the elements of a flat buffer past its parameters (sharding.py), which hold no
    parameter, gradient or optimizer state;
- activations: what autograd saved for backward (its saved-tensor hooks);
- otherwise, by when the tracker saw it made: in backward, a parameter's gradient before the
  engine takes it in (a hook on the parameter sees it: grads) or a gradient of an activation
  (activation grads; torch's MemTracker calls these TEMP); in forward, a temporary that is
  not saved (forward temporaries: the loss, ...); in step, the optimizer's (step temporaries);
- unexplained: a live storage none of these claims (made before the step, held by no one the
  engine names).

The rows add up to the measured peak. Allocator overhead is beside them, not in the sum: the
tracker counts storage bytes, and an allocator hands out more. On a CPU it is a formula (c10's
CPU allocator aligns every allocation to 64 bytes; malloc's own headers are not counted); on
CUDA, measured (the caching allocator's reserved less allocated bytes at their peaks).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zerolab.memory import MemoryTrace, SavedForBackward, TensorTracker, track_memory

if TYPE_CHECKING:  # the engine contract: the shell (a cycle at run time)
    from zerolab.shell import EngineShell

ROWS = ("params", "buffers", "inputs", "grads", "optimizer", "padding", "activations",
        "activation grads", "forward temporaries", "step temporaries", "comm")
CPU_ALIGNMENT = 64  # bytes: c10's CPU allocator aligns each allocation (c10/core/alignment.h)


@dataclass
class Ledger:
    """One rank's peak, every byte in a row."""

    peak_bytes: int  # measured: the most live storage bytes at once in the step
    rows: dict[str, int]  # ROWS -> bytes at the peak
    unexplained: int  # bytes at the peak no row claims
    phase: str  # when the peak came: "forward", "backward" or "step"
    allocator_overhead: int  # beside the peak: see the module docstring
    allocator_measured: bool  # True on CUDA (the allocator's counters), False: CPU formula
    unexplained_made: dict[str, int] = field(default_factory=dict)  # phase made in -> bytes
    trace: MemoryTrace | None = field(default=None, repr=False)

    @property
    def unexplained_fraction(self) -> float:
        return self.unexplained / self.peak_bytes if self.peak_bytes else 0.0

    def table(self) -> list[str]:
        """The ledger as lines: each row, its share of the peak, the remainder."""
        lines = [f"{row:22}{b:>12,} B {100 * b / self.peak_bytes:6.2f}%"
                 for row, b in self.rows.items()]
        lines += [f"{'unexplained':22}{self.unexplained:>12,} B "
                  f"{100 * self.unexplained_fraction:6.2f}%",
                  f"{'= peak (' + self.phase + ')':22}{self.peak_bytes:>12,} B",
                  f"{'allocator overhead':22}{self.allocator_overhead:>12,} B  (beside: "
                  f"{'measured' if self.allocator_measured else 'formula, 64-byte alignment'})"]
        return lines


class _LedgerTracker(TensorTracker):
    """zerolab.memory's tracker, which also remembers when each storage was made, and keeps
    what was alive, and in which category, at the peak."""

    def __init__(self, engine: EngineShell, inputs: list[torch.Tensor], trace: MemoryTrace) -> None:
        super().__init__(lambda: {**engine.state_tensors(),
                                  "buffers": list(engine.module.buffers()), "inputs": inputs},
                         trace, activations=True)
        self.engine = engine
        self.phase = "before"  # the step's phase now: "forward", "backward", "step"
        # What each storage held at entry was then ("before: comm"): for what nothing claims.
        self.at_entry = {id(t.untyped_storage()): category
                         for category, tensors in self.categorize().items() for t in tensors}
        self.made: dict[int, str] = {}  # id(storage) -> the phase it was made in
        self.param_grads: dict[int, weakref.ref] = {}  # backward outputs fed to a .grad
        # At the peak: id(storage) -> (storage, bytes, category or None, phase made in); ids
        # are reused once a storage is freed, so what is known of each is kept now.
        self.at_peak: dict[int, tuple[weakref.ref, int, str | None, str]] = {}
        self.grads_at_peak: set[int] = set()  # which of those are parameters' gradients
        self.padding_at_peak: dict[str, int] = {}
        self.phase_at_peak = "before"

    def _new(self, storage: torch.UntypedStorage, key: int) -> None:
        self.made[key] = self.phase  # a storage seen for the first time: made now
        super()._new(storage, key)

    def sample(self) -> int:
        before = self.trace.peak_bytes
        visits = super().sample()
        if self.trace.peak_bytes > before:
            self._keep_peak()
        return visits

    def _keep_peak(self) -> None:
        category_of: dict[int, str] = {}
        for category, tensors in self.categorize().items():
            for t in tensors:
                category_of.setdefault(id(t.untyped_storage()), category)
        for key in self.held:  # what autograd saved for backward, if nothing above claims it
            category_of.setdefault(key, "activations")
        self.at_peak, self.grads_at_peak = {}, set()
        for key, entry in [*self.live.items(), *self.fixed.items()]:
            ref = entry.ref
            storage = ref()
            if storage is not None and storage.nbytes():
                made = self.made.get(key, "before")
                if made == "before" and key in self.at_entry:
                    made = f"before: {self.at_entry[key]}"
                self.at_peak[key] = (ref, storage.nbytes(), category_of.get(key), made)
                grad = self.param_grads.get(key)
                if grad is not None and grad() is storage:
                    self.grads_at_peak.add(key)
        self.padding_at_peak = padding(self.engine)
        self.phase_at_peak = self.phase

    def note_grad(self, grad: torch.Tensor) -> None:
        """A parameter's gradient, before the engine takes it in (a hook on the parameter)."""
        storage = grad.untyped_storage()
        self.param_grads[id(storage)] = weakref.ref(storage)
        if id(storage) in self.at_peak and self.at_peak[id(storage)][0]() is storage:
            self.grads_at_peak.add(id(storage))  # alive at the peak, a gradient only now


def padding(engine: EngineShell) -> dict[str, int]:
    """Bytes this rank holds now in the padding of flat buffers, by category: the gathered
    flat_param and full flat_grad past numel, its shards' part past numel (where a shard is a
    storage of its own), and the optimizer state of those elements."""
    out = dict.fromkeys(("params", "grads", "optimizer"), 0)
    units = engine.units  # ZeRO-3's: every flat bucket, frozen ones too
    buckets = [b for u in units for b in u.buckets] if units else list(engine.buckets)
    seen: set[int] = set()

    def add(category: str, t: torch.Tensor | None, elements: int) -> None:
        if t is None or not t.untyped_storage().nbytes():
            return
        key = t.untyped_storage().data_ptr()
        if key not in seen and elements > 0:
            seen.add(key)
            out[category] += elements * t.element_size()

    for b in buckets:
        layout = b.layout
        lo, hi = layout.shard_range(engine.rank)
        pad, shard_pad = layout.padded_numel - layout.numel, max(0, hi - max(lo, layout.numel))
        add("params", getattr(b, "flat_param", None), pad)
        add("params", getattr(b, "local_shard", None), shard_pad)
        add("grads", b.flat_grad, pad)
        add("grads", getattr(b, "grad_shard", None), shard_pad)
    for slot, master, tiles in zip(engine.slots, engine.masters, engine.tiles.tiles):
        if slot.layout is None:
            continue
        lo, hi = slot.layout.shard_range(engine.rank)
        first_pad = max(lo, slot.layout.numel) - lo  # the master's first padding element
        add("optimizer", master, hi - lo - first_pad)  # a master of its own (mixed precision)
        for tile, a, b in tiles:
            n = max(0, b - max(a, first_pad))  # padding elements in this tile
            for value in engine.optimizer.state.get(tile, {}).values():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == tile.numel():
                    add("optimizer", value, n)
    return out


def measure(engine: EngineShell, x: torch.Tensor, y: torch.Tensor, loss_fn=None) -> Ledger:
    """One training step of `engine` on (x, y) (forward, backward, step(), wait_params(); no
    zero_grad) under the ledger's tracker; every rank of the engine calls it."""
    loss_fn = loss_fn or engine.module.loss
    memory = track_memory(activations=True)
    tracker = _LedgerTracker(engine, [x, y], memory.trace)
    memory._tracker = tracker  # the same tracker, which remembers more
    memory._saved = SavedForBackward(tracker.saved, tracker.released)
    hooks = [p.register_hook(lambda g: tracker.note_grad(g) or None)
             for p in engine.module.parameters() if p.requires_grad]
    try:
        with memory as trace:
            tracker.phase = "forward"
            loss = loss_fn(engine(x), y)
            tracker.phase = "backward"
            loss.backward()
            tracker.phase = "step"
            engine.step()
            engine.wait_params()
    finally:
        for h in hooks:
            h.remove()
    return _ledger(tracker, trace)


def _ledger(tracker: _LedgerTracker, trace: MemoryTrace) -> Ledger:
    rows = dict.fromkeys(ROWS, 0)
    unexplained = overhead = 0
    unexplained_made: dict[str, int] = {}
    by_phase = {"forward": "forward temporaries", "step": "step temporaries"}
    for key, (_, nbytes, category, made) in tracker.at_peak.items():
        overhead += -nbytes % CPU_ALIGNMENT
        if category is None:
            if made == "backward":
                category = "grads" if key in tracker.grads_at_peak else "activation grads"
            else:
                category = by_phase.get(made)
        if category in rows:
            rows[category] += nbytes
        else:
            unexplained += nbytes
            unexplained_made[made] = unexplained_made.get(made, 0) + nbytes
    for category, pad in tracker.padding_at_peak.items():
        rows[category] -= pad
        rows["padding"] += pad
    measured = torch.cuda.is_available() and torch.cuda.is_initialized()
    if measured:
        overhead = torch.cuda.max_memory_reserved() - torch.cuda.max_memory_allocated()
    assert sum(rows.values()) + unexplained == trace.peak_bytes, "every byte in one row"
    return Ledger(trace.peak_bytes, rows, unexplained, tracker.phase_at_peak, overhead, measured,
                  unexplained_made, trace)
