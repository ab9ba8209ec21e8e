"""torch's own engines behind zerolab's engine interface, to compare like with like.

    engine = TorchFSDP2(model, torch.optim.AdamW, lr=1e-3)   # also TorchDDP, TorchZeRO
    loss_fn(engine(x), y).backward(); engine.step(); engine.zero_grad()
    engine.state_tensors(), engine.model_state_bytes(), engine.full_state_dict()

- `TorchDDP`: DistributedDataParallel (gradients as views into its buckets, like zerolab's DDP).
- `TorchZeRO`: DistributedDataParallel + ZeroRedundancyOptimizer. Not the paper's ZeRO-1: DDP
  all-reduces the gradients (2Ψ), each rank steps the *whole parameters* it owns, and the
  owners broadcast them (Ψ): 3Ψ, zerolab's ZeRO1AllReduce's traffic.
- `TorchFSDP2`: fully_shard on every block, then on the root (zerolab ZeRO-3's default units).

The notebooks (06) and the benchmark build them through `engines.make_engine("torch_fsdp2", ...)`,
so that one measured step measures torch and zerolab the same way. Their collectives do not go
through zerolab.comm: a comm log of theirs is empty, and their traffic is counted by
`bench.CollectiveCounter` (ring formula) or measured on the wire around the step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from zerolab.memory import Settled, StateTensors, model_state_bytes, optimizer_tensors


def fully_shard_blocks(model: nn.Module, mesh: Any, **options: Any) -> nn.Module:
    """FSDP2 as torchtitan applies it: fully_shard on every block, then on the root (the
    embeddings, the final LayerNorm, the tied head), zerolab ZeRO-3's default units. `options`
    go to every fully_shard call (mp_policy, offload_policy, ...)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: a DTensor's local shard, or the tensor itself. (Read
    through the tensor-subclass protocol, `__tensor_flatten__`, which names the local tensor's
    attribute: 0.4 µs a call on this course's machine, against to_local()'s 5.8 µs, 3.0 under
    no_grad; the memory tracker reads state_tensors() after every op.)"""
    if isinstance(t, DTensor):
        return getattr(t, t.__tensor_flatten__()[0][0])
    return t


def parameter_slots(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, name) of every parameter as its module registers it: where FSDP2 puts a unit's
    gathered parameters while it runs (in place of the DTensors). Read with getattr after
    every op by state_tensors() under the memory tracker: cheaper than walking the modules."""
    return [(m, name) for m in model.modules() for name, _ in m.named_parameters(recurse=False)]


class TorchEngine:
    """What the three share: the engine interface over a wrapped module and an optimizer."""

    name = "torch"
    module: nn.Module
    optimizer: torch.optim.Optimizer
    local_optimizer: torch.optim.Optimizer  # the one holding state on this rank
    params: list[nn.Parameter]  # the module's (DDP keeps them; FSDP2 lists its own)

    def __init__(self, model: nn.Module, group: dist.ProcessGroup | None):
        self.module = model
        self.group = self.job_group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def step(self) -> None:
        self.optimizer.step()

    def wait_params(self) -> None:
        """torch's engines finish their parameter collectives within step()."""

    def zero_grad(self) -> None:
        # Keep gradient buffers, as zerolab's DDP and ZeRO-1 do, so that bytes compare.
        self.optimizer.zero_grad(set_to_none=False)

    def state_tensors(self) -> StateTensors:
        params = self.params
        return {"params": [local(p) for p in params],
                "grads": [local(p.grad) for p in params if p.grad is not None],
                "optimizer": Settled(lambda: [local(t) for t in
                                              optimizer_tensors(self.local_optimizer)])}

    def model_state_bytes(self) -> dict[str, int]:
        return model_state_bytes(self.state_tensors())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers (a DTensor is gathered: a collective with FSDP2)."""
        return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                for k, v in self.module.state_dict().items()}


class TorchDDP(TorchEngine):
    """torch's DistributedDataParallel with a plain optimizer."""

    name = "torch_ddp"

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None, bucket_bytes: int | None = None,
                 **optimizer_kwargs: Any):
        super().__init__(model, group)
        self.ddp = _wrap_ddp(model, group, bucket_bytes)
        self.params = list(model.parameters())  # DDP keeps these (not walked at every read)
        self.optimizer = self.local_optimizer = optimizer_cls(model.parameters(),
                                                              **optimizer_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)


class TorchZeRO(TorchDDP):
    """DistributedDataParallel + ZeroRedundancyOptimizer: optimizer state sharded by whole
    parameters; each rank steps the parameters it owns and broadcasts them."""

    name = "torch_ddp_zero"

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None, bucket_bytes: int | None = None,
                 **optimizer_kwargs: Any):
        from torch.distributed.optim import ZeroRedundancyOptimizer

        TorchEngine.__init__(self, model, group)
        self.ddp = _wrap_ddp(model, group, bucket_bytes)
        self.params = list(model.parameters())
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_cls,
                                                 process_group=group,
                                                 parameters_as_bucket_view=True,
                                                 **optimizer_kwargs)
        self.local_optimizer = self.optimizer.optim

    def owned(self) -> dict[str, int]:
        """The parameter tensors and elements this rank's optimizer steps."""
        mine = [p for g in self.local_optimizer.param_groups for p in g["params"]]
        return {"tensors": len(mine), "numel": sum(p.numel() for p in mine)}


class TorchFSDP2(TorchEngine):
    """torch's FSDP2: fully_shard on every block, then on the root."""

    name = "torch_fsdp2"

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None, **optimizer_kwargs: Any):
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        super().__init__(model, group)
        device = next(model.parameters()).device.type
        mesh = (init_device_mesh(device, (self.world_size,)) if group is None
                else DeviceMesh.from_group(group, device))
        fully_shard_blocks(model, mesh)
        self.sharded = list(model.parameters())  # DTensors: the optimizer's parameters
        self.slots = parameter_slots(model)  # where FSDP2 registers gathered parameters
        self.optimizer = self.local_optimizer = optimizer_cls(self.sharded, **optimizer_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()  # FSDP2 reduce-scatters into new gradient shards anyway

    def state_tensors(self) -> StateTensors:
        # While a unit runs, FSDP2 registers plain unsharded parameters in the DTensors' place.
        gathered = [p for m, name in self.slots
                    if not isinstance(p := getattr(m, name), DTensor)]
        return {"params": [local(p) for p in self.sharded] + gathered,
                "grads": [local(p.grad) for p in self.sharded if p.grad is not None],
                "optimizer": Settled(lambda: [local(t) for t in
                                              optimizer_tensors(self.optimizer)])}

    def shard_shapes(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        """{name: (full shape, this rank's shard shape)}: FSDP2 shards each parameter on dim 0."""
        return {n: (tuple(p.shape), tuple(local(p).shape))
                for n, p in self.module.named_parameters()}


def _wrap_ddp(model: nn.Module, group: dist.ProcessGroup | None,
              bucket_bytes: int | None) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    kwargs: dict[str, Any] = {} if bucket_bytes is None else {"bucket_cap_mb": bucket_bytes / 2**20}
    # Gradients as views into DDP's all-reduce buckets, like zerolab's DDP: no second copy.
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                   else None, process_group=group,
                                   gradient_as_bucket_view=True, **kwargs)
