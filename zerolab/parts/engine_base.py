"""What every zerolab engine does besides its stage's algorithm.

The calls a torch user makes on an engine (forward, `no_sync()`, `clip_grad_norm_()`,
`full_state_dict()`, `wait_params()`) and the bookkeeping the harness reads
(`model_state_bytes()`), written once for every stage. ddp.py builds DDP on this class, and
the stages override ddp.py's hooks (its table); what they change here is small and named where
they change it (ZeRO-1's `_owned_grads`, ZeRO-3's `full_state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zerolab.parts.buffers import broadcast_coalesced
from zerolab.parts.clipping import clip_grad_norm_
from zerolab.parts.habits import hook_module_state
from zerolab.parts.rank_state import WHOSE, load_rank_state_dict, rank_state_dict
from zerolab.parts.state_dicts import load_engine_state_dict
from zerolab.parts.storages import model_state_bytes
from zerolab.sharding import Slot


class EngineBase:
    """The user-facing calls every engine shares (attributes: ddp.DDP.__init__ sets them)."""

    def __call__(self, *args, **kwargs):
        return self.precision.forward(self.module, args, kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block communicate nothing; the
        first backward after it reduces the sum of every micro-batch (scale each loss by
        1/micro_batches for the mean, as with torch's DDP.no_sync()). Meanwhile gradients add
        up locally: ZeRO-2 and ZeRO-3 keep full ones, trading memory for traffic. Without it,
        each backward reduces its own gradients and step() takes their sum, as torch's DDP."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _sync_grads(self) -> None:
        if not self._grads_synced:
            self._finish_backward()
        self._grads_synced = True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so that their global L2 norm is at most max_norm; return the
        norm before clipping (as torch.nn.utils.clip_grad_norm_). Between backward and step."""
        self._sync_grads()
        return clip_grad_norm_(self._owned_grads(), max_norm, self._sum_over_ranks)

    def _owned_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads. DDP: all of them, identical on all ranks."""
        return [b.flat_grad for b in self.buckets]

    def _sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """DDP: every rank holds the whole gradient: its sum is already the global one."""
        return local

    def frozen_slots(self) -> list[Slot]:
        """Parameters that are never trained: held whole on every rank."""
        return [Slot(p, (p,), None) for p in self.module.parameters() if not p.requires_grad]

    def _hook_module_state(self) -> None:
        """model.state_dict() and model.load_state_dict() under the engine (parts/habits.py)."""
        hook_module_state(self)

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes held now for params, grads and optimizer state (distinct storages)."""
        return model_state_bytes(self.state_tensors())

    def wait_params(self) -> None:
        """Return once every parameter holds its latest value (DDP: always; ZeRO-1/2 with
        prefetch=True gather them asynchronously after step()). Checkpoints call it first."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers, on every rank: a collective in the sharded stages, and
        where buffers are broadcast (rank 0's buffers, as the next forward would make them)."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.buffers.enabled:
            broadcast_coalesced([state[n] for n, _ in self.module.named_buffers() if n in state],
                                self.job_group, f"{self.name}/state_dict/buffers")
        return state

    # Note: torch's engines name two forms of state. FSDP2's model.state_dict() is sharded
    # (each rank its DTensors); torch.distributed.checkpoint writes that form for any world
    # size. Here: model.state_dict() gives full tensors (parts/habits.py, for the torch.save
    # habit); engine.state_dict() gives this rank's part, for torch.save per rank and a load
    # at the same world size; zerolab.checkpoint.save(engine, folder) writes DCP, any size.

    def state_dict(self) -> dict:
        """This rank's part of the model and the optimizer, copied: {"model": {key: a tensor,
        or {"shape", "dtype", "pieces": [(offsets, tensor)]}}, "optimizer": {"state": ..,
        "param_groups": ..}}, keyed like the plain model (parts/state_dicts.py). No collective.
        torch.save(engine.state_dict(), f"rank{rank}.pt") on every rank, then
        engine.load_state_dict(torch.load(...)) at the same world size."""
        return rank_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load this rank's part (what state_dict() gave on this rank), or a full state dict
        ({"model": a plain model's state_dict(), "optimizer": optional, torch's keys}, e.g.
        zerolab.checkpoint.consolidate's): every rank takes its own part of it."""
        if WHOSE in state_dict:  # a rank's part says whose it is
            load_rank_state_dict(self, state_dict)
        else:
            load_engine_state_dict(self, state_dict)

