"""How every rank starts from the same model.

Ranks may build their model from different seeds (or a learner may forget to seed at all); data
parallelism only works if every copy starts equal, so an engine first broadcasts rank 0's
parameters and buffers to every rank of its group. A model built on the meta device has no
values yet: the engine builds them (below), from the model's own seeded-by-name initialiser.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.sharding import FlatLayout, unflatten


def where(group: dist.ProcessGroup | None) -> tuple[int, int, torch.device]:
    """This process's rank and world size in `group`, and the device it trains on (its GPU
    under NCCL, else the CPU). Without a process group: rank 0 of 1, on the CPU."""
    if not dist.is_initialized():
        return 0, 1, torch.device("cpu")
    nccl = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    return dist.get_rank(group), dist.get_world_size(group), device


def broadcast_from_rank0(model: nn.Module, group: dist.ProcessGroup | None, tag: str) -> None:
    """Every rank starts from rank 0's parameters and buffers (ranks may have other seeds)."""
    if not dist.is_initialized():
        return
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_meta:  # not built yet: initialised by name, the same on every rank
                continue
            comm.broadcast(t.data, src, tag=f"{tag}/{name}", group=group)


# Note: a model built under `with torch.device("meta"):` has parameters with a shape and no
# storage. An engine gives them storage and initial values itself: DDP and ZeRO-1/2, which hold
# every parameter anyway, all at once (`materialize`); ZeRO-3 one unit at a time, straight into
# that unit's flat buffer, keeping its shard and freeing the rest before the next unit
# (`materialize_flat`), so that no rank ever holds the whole model. The values come from the
# model's `init_tensor(name, tensor)`, seeded by name: every rank builds the same values
# without a broadcast.


def param_names(module: nn.Module) -> dict[nn.Parameter, str]:
    """Each parameter's name (a tied weight: its first name)."""
    return {p: n for n, p in module.named_parameters()}


def materialize(model: nn.Module, device: torch.device, params: bool = True) -> None:
    """Give every meta parameter (params=True) and meta buffer of `model` storage on `device`,
    initialised by model.init_tensor(name, tensor)."""
    named = [*(model.named_parameters() if params else ()), *model.named_buffers()]
    for name, t in named:
        if t.is_meta:
            _init(model)(name, _give_storage(t, torch.empty(t.shape, dtype=t.dtype,
                                                              device=device)))


def materialize_flat(model: nn.Module, params: list[nn.Parameter], names: list[str],
                     layout: FlatLayout, device: torch.device) -> torch.Tensor:
    """Build meta `params` straight into a new flat buffer: (padded_numel,), zero padding.

    Afterwards each parameter's .data is its view into the buffer, initialised by name.
    """
    flat = torch.zeros(layout.padded_numel, dtype=params[0].dtype, device=device)
    for p, name, view in zip(params, names, unflatten(flat, layout)):
        _init(model)(name, view)
        _give_storage(p, view)
    return flat


def _give_storage(t: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Make the meta tensor `t` hold `real`'s data, in place: the same Python object (tied
    weights stay tied, hooks and the optimizer see it) with real storage. `t.data = real` is
    refused from meta to another device: torch.utils.swap_tensors first turns `t` into an empty
    tensor on real's device, then `.data` points it at `real` (as ZeRO-3's unshard does, so
    that `t` keeps a version counter of its own, not the flat buffer's)."""
    empty = torch.empty(0, dtype=t.dtype, device=real.device)
    new = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) \
        else empty
    torch.utils.swap_tensors(t, new)
    t.data = real
    return t


def _init(model: nn.Module) -> Callable[[str, torch.Tensor], None]:
    init = getattr(model, "init_tensor", None)
    if init is None:
        raise ValueError(f"{type(model).__name__} was built on the meta device, so an engine must "
                         f"create its values: give the model a method init_tensor(name, tensor) "
                         f"that fills a parameter or buffer in place (see zerolab.models.GPT).")
    return init
