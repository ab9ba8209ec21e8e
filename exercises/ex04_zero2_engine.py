"""Exercise for notebook 04: the ZeRO-2 engine.

The class runs on every rank at once: the grader starts 1, 2 and 3 processes, builds the same
model on each and trains it with your engine, then with zerolab.zero2.ZeRO2 on the same
batches, and compares what they computed, held and sent. Talk to the other ranks only through
zerolab.comm (it records every call, with its tag). Use zerolab.sharding (FlatLayout, flatten,
unflatten, shard); not zerolab's engines.

zerolab's own engine is in zerolab/zero2.py (on top of zero1.py): solve this first, then read it.
Check your answer with `grade("4.2")` in the notebook, or `python -m zerolab.grade 4.2`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.sharding import FlatLayout, flatten, shard, unflatten

DEFAULT_BUCKET_BYTES = 1 << 20


class ZeRO2Engine:
    """ZeRO-2: shard the optimizer state and the gradients; parameters stay whole.

        engine = ZeRO2Engine(model, torch.optim.AdamW, lr=1e-3, group=group)
        loss = model.loss(engine(x), y)  # x: this rank's rows of the batch
        loss.backward()                  # your hooks reduce-scatter buckets as they fill
        engine.step()
        engine.zero_grad()

    The contract (what the grader calls):
    - Every rank is given the same model (same seed): no need to broadcast it.
    - Buckets as in DDP (1.3): trainable parameters in reverse order, closed at `bucket_bytes`.
      Frozen parameters (requires_grad=False) stay as they are: no gradient, no optimizer
      state, never communicated.
    - A bucket's parameters become views of one flat, padded buffer (FlatLayout.of(params,
      world_size)); rank r owns shard r of it, a *view* (not a copy): the optimizer steps only
      these shards, so its state is 1/N of the model's.
    - During backward, each bucket's gradient is reduce-scattered (op="avg", tag
      "zero2/bwd/<bucket name>") into this rank's gradient shard, and the full gradients go:
      how many full gradients, flattened or not, are alive at once is what ZeRO-2 saves, and
      it is measured (below). Several backward passes may come before step(): the shards
      add up.
    - step() steps the optimizer on this rank's shards, then all-gathers every bucket's
      shards into its flat buffer (tag "zero2/step/<bucket name>"): every rank holds all the
      new parameters when step() returns.
    - full_state_dict(): the model's full state_dict(), on every rank, as a snapshot.

    Measured, against zerolab.zero2.ZeRO2 on the same batches (1 to 3 ranks; SGD with one and
    with two backward passes per step, AdamW with two): the parameters after every step; every
    live tensor on the rank, counted by the grader (not what your engine says it holds), at
    the end of each forward and backward and after step() (at most zerolab's + padding: after
    step() 4Ψ + 4Ψ/N + 8Ψ/N with fp32 AdamW) and at the step's peak (at most zerolab's + one
    bucket: about 4Ψ/N + two buckets of gradients); reduce_scatter during backward, never
    holding backward up, one per bucket, of its size and in its order; all_gather during
    step(); 2Ψ per step (ring model), as DDP.
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **optimizer_kwargs):
        """Exercise 4.2: Make the buckets, flat parameters and shards, the hooks, the optimizer.

        Hint: p.data = view makes a parameter use a view of the flat buffer; nn.Parameter(
        shard(flat, layout, rank)) shares the shard's memory, and its .grad (a zero tensor of
        the shard's size, kept) is where the reduced gradient shards add up.
        """
        self.module = model
        self.group = group
        raise NotImplementedError(
            "Exercise 4.2: Make the buckets, flat parameters and shards, the hooks, the optimizer.")

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Exercise 4.2: A gradient is in: reduce its bucket into the shards, if it is due.

        Hint: a reduce-scatter in flight still reads its input. What must stay alive until it
        is done, and how many of those can be alive at once?
        """
        raise NotImplementedError(
            "Exercise 4.2: A gradient is in: reduce its bucket into the shards, if it is due.")

    def _finish_reductions(self) -> None:
        """Exercise 4.2: Wait for the reduce-scatters in flight, add them into the shards."""
        raise NotImplementedError(
            "Exercise 4.2: Wait for the reduce-scatters in flight, add them into the shards.")

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def step(self) -> None:
        """Exercise 4.2: Finish the reductions, step the shards, all-gather the parameters."""
        raise NotImplementedError(
            "Exercise 4.2: Finish the reductions, step the shards, all-gather the parameters.")

    def zero_grad(self) -> None:
        """Exercise 4.2: Zero this rank's gradient shards."""
        raise NotImplementedError("Exercise 4.2: Zero this rank's gradient shards.")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Exercise 4.2: The model's full state_dict(), a snapshot, on every rank."""
        raise NotImplementedError(
            "Exercise 4.2: The model's full state_dict(), a snapshot, on every rank.")
