"""A peer course's tests for DDP and a sharded optimizer, in their shape, run through thin
adapters over zerolab's public API (the adapters are the only zerolab code below).

Those tests hand a student's classes to a fixed harness through four functions: a DDP wrapper
built from a module (individual parameters, or buckets of `bucket_size_mb`), a hook called after
backward and one at the start of each batch, and a sharded optimizer built from parameters. The
harness then does what torch users do: ranks seeded differently (the wrapper must broadcast rank
0's weights), a frozen parameter and a tied weight in the model, SGD built from
`ddp_model.parameters()`, `optimizer.zero_grad()` / `backward()` / `step()` by hand, each rank
on its half of a batch reshuffled every iteration, compared with one process on the whole batch
after every step. Written here from that contract (no code of theirs).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import zerolab

STEPS = 5
GLOBAL_BATCH = 20

# ---- the adapters: the whole of zerolab's part ------------------------------------------------


def get_ddp_individual_parameters(module: nn.Module) -> nn.Module:
    """One bucket per parameter: a 1-byte cap closes a bucket after each."""
    return zerolab.DDP(module, torch.optim.SGD, lr=0.0, bucket_bytes=1)


def get_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return zerolab.DDP(module, torch.optim.SGD, lr=0.0,
                       bucket_bytes=max(1, int(bucket_size_mb * 2**20)))


def ddp_on_after_backward(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Nothing to do: as with torch's DDP, .grad holds the average when backward returns."""


def ddp_on_train_batch_start(ddp_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Nothing to do either."""


def get_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer],
                          **kwargs) -> torch.optim.Optimizer:
    """ZeRO-1 over the given parameters: each rank keeps its shard's optimizer state; step()
    updates the shard and gathers the parameters."""
    return zerolab.ZeRO1(nn.ParameterList(params), optimizer_cls, **kwargs).optimizer


# The same four on torch's own classes: the yardstick the harness was written against.
def torch_ddp_bucketed(module: nn.Module, bucket_size_mb: float) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module, bucket_cap_mb=bucket_size_mb)


def torch_sharded_optimizer(params, optimizer_cls: type[torch.optim.Optimizer],
                            **kwargs) -> torch.optim.Optimizer:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_cls, **kwargs)


# ---- the models ---------------------------------------------------------------------------------


class ToyModel(nn.Module):
    """Three Linears and a frozen parameter the optimizer must leave at [2, 2]."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 12)
        self.fc2 = nn.Linear(12, 12)
        self.fc3 = nn.Linear(12, 5)
        self.frozen = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, 10) -> (batch, 5)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class TiedToyModel(ToyModel):
    """fc2 and a fourth layer share one weight (12 x 12)."""

    def __init__(self):
        super().__init__()
        self.fc4 = nn.Linear(12, 12)
        self.fc4.weight = self.fc2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc3(torch.relu(self.fc4(h)))


MODELS = {"toy": ToyModel, "tied": TiedToyModel}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)  # every rank: the same pool of data
    return torch.randn(GLOBAL_BATCH, 10, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((x.detach() - y.detach()).abs().max().item()
               for x, y in zip(a.parameters(), b.parameters()))


# ---- the harness (run on every rank) ----------------------------------------------------------


def ddp(model_name: str, bucket_size_mb: float | None, wrap=None) -> dict:
    """The DDP test: returns what it checked, per step, for the caller to assert on (the
    harness compares on rank 0, whose single-process model started from the same weights)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # the ranks start from different weights
    single = MODELS[model_name]()
    if bucket_size_mb is None:
        wrapped = get_ddp_individual_parameters(copy.deepcopy(single))
    else:
        wrapped = (wrap or get_ddp_bucketed)(copy.deepcopy(single), bucket_size_mb)
    # rank 0's weights everywhere: equal to this rank's own on rank 0 only (frozen aside)
    start = {n: not torch.equal(p, q) for (n, p), (_, q)
             in zip(single.named_parameters(), wrapped.named_parameters())}
    x_all, y_all = _data()
    local = GLOBAL_BATCH // world_size
    loss_fn = nn.MSELoss()
    sgd, sgd_single = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (wrapped, single))
    diffs = []
    for i in range(STEPS):
        ddp_on_train_batch_start(wrapped, sgd)
        sgd.zero_grad()
        sgd_single.zero_grad()
        loss_fn(single(x_all), y_all).backward()
        sgd_single.step()
        mine = slice(rank * local, (rank + 1) * local)
        loss_fn(wrapped(x_all[mine]), y_all[mine]).backward()
        ddp_on_after_backward(wrapped, sgd)
        sgd.step()
        diffs.append(_max_diff(single, wrapped))
        order = torch.randperm(GLOBAL_BATCH, generator=torch.Generator().manual_seed(42 + i))
        x_all, y_all = x_all[order], y_all[order]
    frozen = next(p for n, p in wrapped.named_parameters() if n.endswith("frozen"))
    return {"differs_at_start": start, "diffs": diffs, "frozen": frozen.tolist(),
            "final": [p.detach().clone() for p in wrapped.parameters()]}


def sharded_optimizer(model_name: str, make=None) -> dict:
    """The sharded-optimizer test: every rank trains the same model on the same batches with
    AdamW sharded across the ranks; one process with a plain AdamW beside it."""
    torch.manual_seed(42)
    model = MODELS[model_name]()
    single = copy.deepcopy(model)
    kwargs = {"lr": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}
    plain = torch.optim.AdamW(single.parameters(), **kwargs)
    sharded = (make or get_sharded_optimizer)(model.parameters(), torch.optim.AdamW, **kwargs)
    loss_fn = nn.MSELoss()
    diffs = []
    for _ in range(STEPS * 2):
        x, y = torch.rand(10, 10), torch.rand(10, 5)  # the same on every rank (one seed)
        for m, opt in ((single, plain), (model, sharded)):
            opt.zero_grad()
            loss_fn(m(x), y).backward()
            opt.step()
        diffs.append(_max_diff(single, model))
    # What sharding is for: this rank's optimizer state, against a plain AdamW's
    return {"diffs": diffs, "frozen": model.frozen.tolist(),
            "state_numel": _state_numel(sharded), "full_state_numel": _state_numel(plain)}


def _state_numel(optimizer: torch.optim.Optimizer) -> int:
    """Elements of the optimizer's moments (Adam's exp_avg, exp_avg_sq; its step is a scalar).
    torch's ZeroRedundancyOptimizer keeps them in its local optimizer, `.optim`."""
    local = getattr(optimizer, "optim", optimizer)
    return sum(t.numel() for s in local.state.values() for t in s.values()
               if torch.is_tensor(t) and t.dim() > 0)


CASES = {f"ddp individual {m}": (ddp, (m, None)) for m in MODELS}
CASES |= {f"ddp {mb} MB {m}": (ddp, (m, mb)) for m in MODELS for mb in (0.0016, 0.0001, 0.01)}
CASES |= {f"sharded optimizer {m}": (sharded_optimizer, (m,)) for m in MODELS}
CASES |= {"torch ddp 0.0016 MB tied": (ddp, ("tied", 0.0016, torch_ddp_bucketed)),
          "torch sharded optimizer tied": (sharded_optimizer, ("tied", torch_sharded_optimizer))}


def run_all() -> dict:
    return {name: fn(*args) for name, (fn, args) in CASES.items()}
