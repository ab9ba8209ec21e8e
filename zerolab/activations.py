"""What a model keeps for backward, measured storage by storage and attributed to its blocks.

ZeRO shards the model states; each rank still keeps, for its own micro-batch, every tensor the
backward will need: the activations. Autograd shows them to anyone who asks, through
`torch.autograd.graph.saved_tensors_hooks` (`zerolab.memory.SavedForBackward`): every tensor an
op saves for its backward passes through a pack hook. This module records them during one
forward and says where each came from:

    saved = activations.measure(model, x, y)    # forward under the recorder, then backward
    saved.by_block()     # {"embeddings": .., "blocks.0": .., ..., "head": ..} bytes
    saved.storages       # one SavedStorage per distinct storage: owner, bytes, shape, savers

Counting rules: a storage is counted once, however many ops save it or views of it (q, k and v
are three views of qkv's output: one storage); parameters are left out (model states, not
activations). A storage belongs to the block during whose forward it was first saved, or, for
a block's input kept by torch.utils.checkpoint before the block runs, to that block.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zerolab.memory import SavedForBackward
from zerolab.parts.storages import storage_key

EMBEDDINGS, HEAD = "embeddings", "head"  # owners before the first block and after the last


@dataclass(frozen=True)
class SavedStorage:
    """One storage autograd kept for backward."""

    owner: str  # "embeddings", "blocks.0", ..., "head"
    nbytes: int  # the whole storage: what stays allocated while anything saved from it lives
    shape: tuple[int, ...]  # of the first tensor saved from it (a view may show less)
    dtype: str  # "float32", "int64", "bool"
    savers: tuple[str, ...] = ()  # backward node.attribute: "NativeLayerNormBackward0.input"


@dataclass
class SavedActivations:
    """Every storage one forward saved for backward, in the order they were first saved."""

    storages: list[SavedStorage] = field(default_factory=list)

    def by_block(self) -> dict[str, int]:
        """Bytes per owner, in forward order."""
        out: dict[str, int] = {}
        for st in self.storages:
            out[st.owner] = out.get(st.owner, 0) + st.nbytes
        return out

    def blocks(self) -> list[int]:
        """Bytes of each block, in order (embeddings and head left out)."""
        return [v for k, v in self.by_block().items() if k.startswith("blocks.")]

    @property
    def total(self) -> int:
        return sum(st.nbytes for st in self.storages)

    def of(self, owner: str) -> list[SavedStorage]:
        return [st for st in self.storages if st.owner == owner]


class record_saved:  # noqa: N801 (a context manager used like a function)
    """Record what autograd saves inside the `with` block, attributed to `model.blocks`.

        with record_saved(model) as rec:
            loss = model.loss(model(x), y)
        rec.name_savers(loss)          # optional: which backward node saved what (before backward)
        rec.result()                   # SavedActivations

    The module hooks are removed when the block ends; the tensors stay saved until backward.
    """

    def __init__(self, model: nn.Module):
        self.blocks = list(getattr(model, "blocks", []))
        self.param_keys = {storage_key(p) for p in model.parameters()}
        self.owner = EMBEDDINGS  # who is running now
        # storage -> (owner, bytes, shape, dtype) of its first save. Not the tensor itself:
        # holding it here would keep it alive after backward frees it.
        self.first: dict[tuple, tuple[str, int, tuple[int, ...], str]] = {}
        self.block_inputs: dict[tuple, str] = {}  # storage of a block's input -> the block
        self.savers: dict[tuple, list[str]] = {}
        self._saved = SavedForBackward(on_save=self._on_save)
        self._handles: list[Any] = []

    def _on_save(self, t: torch.Tensor) -> None:
        key = storage_key(t)
        if key is None or key in self.param_keys or key in self.first:
            return
        self.first[key] = (self.owner, t.untyped_storage().nbytes(), tuple(t.shape),
                           str(t.dtype).removeprefix("torch."))

    def _enter_block(self, name: str, args: tuple) -> None:
        self.owner = name
        for a in args:
            if isinstance(a, torch.Tensor) and (key := storage_key(a)) is not None:
                self.block_inputs.setdefault(key, name)

    def __enter__(self) -> record_saved:
        for i, block in enumerate(self.blocks):
            name = f"blocks.{i}"
            self._handles.append(block.register_forward_pre_hook(
                lambda m, args, name=name: self._enter_block(name, args)))
            self._handles.append(block.register_forward_hook(
                lambda m, args, out: setattr(self, "owner", HEAD)))
        self._saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._saved.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def name_savers(self, loss: torch.Tensor) -> None:
        """Name the backward nodes that saved each storage, walking the graph from `loss`.

        Autograd documents a node's saved tensors as its `_saved_*` attributes. Call it before
        backward (which frees them) and never on a checkpointed model (reading a saved tensor
        of a checkpointed region runs its recompute).
        """
        for node in _graph(loss.grad_fn):
            for attr in dir(node):
                if not attr.startswith("_saved_"):
                    continue
                value = getattr(node, attr)
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(t, torch.Tensor) and (key := storage_key(t)) in self.first:
                        name = f"{type(node).__name__}.{attr.removeprefix('_saved_')}"
                        self.savers.setdefault(key, []).append(name)

    def result(self) -> SavedActivations:
        return SavedActivations([
            SavedStorage(self.block_inputs.get(key, owner), nbytes, shape, dtype,
                         tuple(sorted(set(self.savers.get(key, ())))))
            for key, (owner, nbytes, shape, dtype) in self.first.items()])


def _graph(root: Any) -> Iterator[Any]:
    """Every node of an autograd graph reachable from `root`, each once."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(next_node for next_node, _ in node.next_functions)


def measure(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *,
            name_savers: bool = False) -> SavedActivations:
    """One forward of `model` on (x, y) under `record_saved`, then the backward (gradients are
    left in .grad: zero them before training on). name_savers: also name each storage's savers
    (not with checkpointing)."""
    with record_saved(model) as rec:
        loss = model.loss(model(x), y)
    if name_savers:
        rec.name_savers(loss)
    saved = rec.result()
    loss.backward()
    return saved
