"""The optimizer steps cache-sized tiles of what a rank holds, not whole flat shards.

Why: on a CPU, torch's optimizers update one tensor at a time (their `foreach` kernels, which
take many tensors per call, are for GPUs), and one AdamW update is about a dozen elementwise
passes over the tensor, its gradient and its two moments. Over a flat shard of millions of
elements, every pass streams all four from main memory and back. Cut into tiles of 2^18
elements (1 MiB in fp32; 4 MiB with the gradient and the moments), the dozen passes over one
tile run in the CPU's cache. Measured on this course's 2-core machine, one process: AdamW over
a flat tensor of 62M elements took 331 ms; over the same elements in tiles of 2^18, 101 ms.
torch's DDP and FSDP2 step whole parameters (a GPT-2 embedding is 38.6M elements); ZeRO-1, 2
and 3 step whole flat shards unless they are cut.

Each update is elementwise (SGD, Adam, AdamW), so a tile takes exactly the step its elements
would take in the whole tensor: the result is bitwise the same.

What a tile is: a view of a master (what the optimizer steps: a parameter in DDP, a local
shard in ZeRO), sharing its storage, so stepping the tile updates the master. Its `.grad` is
the same view of the master's `.grad`, bound just before each `optimizer.step()` (a step
pre-hook: the stages set the masters' gradients in their own ways) and dropped after it. The
optimizer keeps its state per tile; `state` joins a master's back together (checkpoints), and
`load_state` cuts it up again.

On a GPU, whole tensors are kept (`tile_numel=None`): there the optimizer's foreach and fused
kernels take a list of tensors in one launch, and tiling gains nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

CPU_TILE_NUMEL = 1 << 18  # elements per tile on a CPU: 1 MiB in fp32


def default_tile_numel(device: torch.device) -> int | None:
    """Tiles on a CPU; whole tensors on an accelerator (its optimizers take lists)."""
    return CPU_TILE_NUMEL if device.type == "cpu" else None


class OptimizerTiles:
    """The tensors an optimizer is given for `masters`, each cut into tiles of tile_numel."""

    def __init__(self, masters: list[torch.Tensor], tile_numel: int | None):
        if tile_numel is not None and tile_numel < 1:
            raise ValueError(f"tile_numel must be a positive number of elements or None "
                             f"(whole tensors); got {tile_numel}")
        self.masters = masters
        # Per master, its tiles as (tile, start, end) in the master's flat elements. A master no
        # larger than one tile is its own only tile: the optimizer is given it as it is.
        self.tiles: list[list[tuple[torch.Tensor, int, int]]] = []
        for m in masters:
            n = m.numel()
            if tile_numel is None or n <= tile_numel:
                self.tiles.append([(m, 0, n)])
                continue
            flat = m.detach().view(-1)  # a master is contiguous: one parameter, or a shard
            self.tiles.append([
                (nn.Parameter(flat[a:min(a + tile_numel, n)], requires_grad=m.requires_grad),
                 a, min(a + tile_numel, n)) for a in range(0, n, tile_numel)])
        self.cut = any(t is not m for m, ts in zip(masters, self.tiles) for t, _, _ in ts)

    def params(self) -> list[torch.Tensor]:
        """What to give the optimizer: every tile, in the masters' order."""
        return [t for ts in self.tiles for t, _, _ in ts]

    def attach(self, optimizer: torch.optim.Optimizer, keep_grads: bool = False) -> None:
        """Bind the tiles' gradients before each optimizer.step(). keep_grads: the masters'
        gradients are buffers that live as long as the engine (fp32 training), so the views
        stay bound; else (fp32 copies made for each step) they are dropped after it."""
        if self.cut:
            optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.bind_grads())
            if not keep_grads:
                optimizer.register_step_post_hook(lambda opt, args, kwargs: self._drop_grads())

    def _cut_tiles(self):
        for m, ts in zip(self.masters, self.tiles):
            for t, a, b in ts:
                if t is not m:
                    yield m, t, a, b

    def bind_grads(self) -> None:
        """Each tile's .grad: its view of the master's (GradScaler.unscale_ and step read it)."""
        for m, t, a, b in self._cut_tiles():
            if m.grad is None:
                t.grad = None
            elif t.grad is None or t.grad.data_ptr() != m.grad.data_ptr() + a * m.element_size():
                t.grad = m.grad.view(-1)[a:b]  # bound already: no op, nothing to track

    def _drop_grads(self) -> None:
        # A tile's grad is a view: kept, it would keep a freed master gradient's storage alive.
        for _, t, _, _ in self._cut_tiles():
            t.grad = None

    def state(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """The optimizer's state for `master`, joined from its tiles: per-element tensors shaped
        like the master, other values (Adam's step count) from the first tile. {} for a tensor
        the optimizer does not step (a frozen parameter), as optimizer.state.get would give."""
        i = self._index(master)
        if i is None:
            return {}
        ts = self.tiles[i]
        states = [optimizer.state.get(t, {}) for t, _, _ in ts]
        joined: dict[str, Any] = {}
        for key, first in states[0].items():
            if _per_element(first, ts[0][0]):
                joined[key] = torch.cat([s[key].reshape(-1) for s in states]).view_as(master)
            else:
                joined[key] = first
        return joined

    def load_state(self, optimizer: torch.optim.Optimizer, master: torch.Tensor,
                   state: dict[str, Any]) -> None:
        """Set the optimizer's state for `master`: per-element tensors (master's numel) are cut
        into the tiles' parts; every tile gets its own copy of the rest (a step count is
        advanced in place, tile by tile)."""
        i = self._index(master)
        if i is None:
            raise KeyError("load_state: the tensor is not one the optimizer steps")
        for t, a, b in self.tiles[i]:
            optimizer.state[t] = {
                k: (v.reshape(-1)[a:b].clone().view_as(t) if _per_element(v, master) else
                    v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}

    def _index(self, master: torch.Tensor) -> int | None:
        return next((i for i, m in enumerate(self.masters) if m is master), None)


def _per_element(value: Any, like: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.numel() == like.numel()
