"""Exercise for notebook 01 (01_ddp): DDP, the engine, as torch's DistributedDataParallel does it.

The class runs on every rank at once: the grader starts 1, 2 and 3 processes, builds the same
model on each and trains it with your engine, then with zerolab.ddp.DDP on the same batches,
and compares what they computed, held and sent. Talk to the other ranks only through
zerolab.comm (it records every call, with its tag).

zerolab's own engine is in zerolab/ddp.py: solve this first, then read it.
Check your answer with `grade("1.3")` in the notebook, or `python -m zerolab.grade 1.3`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm

DEFAULT_BUCKET_BYTES = 1 << 20


class DDPEngine:
    """Data parallel: bucketed gradient all-reduce that overlaps backward.

        engine = DDPEngine(model, torch.optim.AdamW, lr=1e-3, group=group)
        loss = model.loss(engine(x), y)  # x: this rank's rows of the batch
        loss.backward()                  # your hooks all-reduce buckets as gradients arrive
        engine.step()
        engine.zero_grad()

    The contract (what the grader calls):
    - Every rank is given the same model (same seed): no need to broadcast it.
    - Buckets: the trainable parameters in reverse order (about the order backward produces
      their gradients), a bucket closed once it holds `bucket_bytes` (checked before adding
      the next parameter); a parameter is never split. Frozen parameters (requires_grad=False)
      get no gradient, no optimizer state, and are never communicated.
    - Each bucket's gradients live in one flat buffer; the parameters' .grad are views of it.
    - Each bucket is averaged over the ranks with zerolab.comm.all_reduce (op="avg", tag
      "ddp/bwd/<bucket name>") while backward goes on with earlier layers. When to start it,
      and when to wait for it, is yours to decide, within the targets below.
    - Several backward passes may come before step() (gradient accumulation, without
      no_sync): their gradients add up, and every rank steps with the average over the ranks
      of the sum. Mind that zerolab.comm divides an "avg" when the handle is waited for.
    - full_state_dict(): the model's full state_dict(), on every rank, as a snapshot: training
      on must not change what it returned.

    Measured, against zerolab.ddp.DDP on the same batches (1 to 3 ranks; SGD with one and
    with two backward passes per step, AdamW with two): the parameters after every step; every
    live tensor on the rank, counted by the grader (the rank's whole memory, not what your
    engine says it holds), at the end of each forward and backward and after step() (at most
    zerolab's + padding) and at the step's peak (at most zerolab's + one bucket); all_reduce
    during backward only, none of them holding backward up, one per bucket, of its size and
    in its order; 2Ψ per step (ring model: 2(N-1)/N of the gradients' bytes, per backward).
    """

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, **optimizer_kwargs):
        """Exercise 1.3: Make the buckets, their flat gradients, the hooks and the optimizer.

        Hint: autograd adds each new gradient into an existing .grad in place, so .grad views
        of a flat buffer fill the buffer. p.register_post_accumulate_grad_hook(fn) calls fn(p)
        once per backward, after every use of p has been added up (a tied weight has two).
        """
        self.module = model
        self.group = group
        # BEGIN SOLUTION
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in reversed(trainable):
            if size >= bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.flat_grads = []
        for bucket in self.buckets:
            flat = torch.zeros(sum(p.numel() for p in bucket), dtype=bucket[0].dtype)
            offset = 0
            for p in bucket:
                p.grad = flat[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            self.flat_grads.append(flat)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)  # gradients accumulated in this backward
        self.handles: list[comm.Handle] = []  # all-reduces in flight
        for p in trainable:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.optimizer = optimizer_cls(trainable, **optimizer_kwargs)
        # END SOLUTION

    def _grad_ready(self, param: nn.Parameter) -> None:
        """Exercise 1.3: A gradient is in: average its bucket over the ranks, if it is due."""
        # BEGIN SOLUTION
        i = self.bucket_of[param]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            self.ready[i] = 0  # counted afresh in the next backward
            self.handles.append(comm.all_reduce(self.flat_grads[i], op="avg",
                                                tag=f"ddp/bwd/bucket{i}", group=self.group,
                                                async_op=True))
        # END SOLUTION

    def __call__(self, *args, **kwargs):
        """Exercise 1.3: The model's forward on this rank's rows.

        Hint: the next backward adds into the flat buffers. In what state must they be then?
        """
        # BEGIN SOLUTION
        self._wait()  # an all-reduce still in flight is summed but not yet divided
        # END SOLUTION
        return self.module(*args, **kwargs)

    def _wait(self) -> None:
        """Exercise 1.3: Wait for every all-reduce in flight."""
        # BEGIN SOLUTION
        for handle in self.handles:
            handle.wait()  # zerolab.comm divides an "avg" here
        self.handles.clear()
        # END SOLUTION

    def step(self) -> None:
        """Exercise 1.3: Step the optimizer with the gradients averaged over the ranks."""
        # BEGIN SOLUTION
        self._wait()
        self.optimizer.step()
        # END SOLUTION

    def zero_grad(self) -> None:
        """Exercise 1.3: Zero the gradients (keep the buffers: .grad are views of them)."""
        # BEGIN SOLUTION
        for flat in self.flat_grads:
            flat.zero_()
        # END SOLUTION

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Exercise 1.3: The model's full state_dict(), a snapshot, on every rank."""
        # BEGIN SOLUTION
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        # END SOLUTION
