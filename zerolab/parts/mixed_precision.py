"""Mixed precision as a policy object, the way FSDP2's `MixedPrecisionPolicy` is one.

    engine = zerolab.ZeRO2(model, torch.optim.AdamW, param_dtype=torch.bfloat16, lr=1e-3)

With `param_dtype=torch.bfloat16` the model computes and communicates in 16 bits: parameters,
buffers and gradients are bf16, and so are the collectives. The optimizer cannot step in bf16
(an update much smaller than a weight would round away), so it steps **fp32 master copies**:
4 more bytes per parameter, which with Adam's m and v (8 bytes) make the paper's K = 12.

Each engine asks the policy these things, at these moments:

- at construction, `cast_module(model)`: cast the model and remember its fp32 values, from
  which `masters(...)` cuts the fp32 copies of whatever the optimizer steps (a parameter in
  DDP, a flat shard in ZeRO);
- at every forward, `forward(module, args, kwargs)`: inputs in, outputs back to fp32;
- at every step, `step(optimizer, pairs)`: gradients up to fp32 masters, step, and the new
  values rounded back into the 16-bit tensors;
- after `model.load_state_dict(...)`, `reload(pairs)`: the masters take what was loaded.

With `param_dtype=None` (fp32 training) each of these does nothing, and the masters are the
stepped tensors themselves: no copy, no extra bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerolab.parts.nest import map_tensors
from zerolab.sharding import Slot, local_values


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """How an engine casts: `param_dtype=None` is plain fp32 training."""

    param_dtype: torch.dtype | None = None  # compute and communication dtype; None: fp32

    def cast_module(self, model: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
        """Cast floating parameters and buffers to param_dtype, in place.

        Returns {trainable parameter: its fp32 value before the cast} ({} in fp32), from which
        the masters are cut once the engine knows what each rank steps.
        """
        if self.param_dtype is None:
            return {}
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("param_dtype with a model on the meta device is not supported: "
                             "build the model in full, or train it in fp32")
        fp32 = {p: p.detach().float().clone() for p in model.parameters() if p.requires_grad}
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.is_floating_point():
                    t.data = t.data.to(self.param_dtype)
        return fp32

    def masters(self, slots: list[Slot], fp32_values: dict[nn.Parameter, torch.Tensor],
                rank: int) -> list[torch.Tensor]:
        """What the optimizer steps: each slot's tensor itself in fp32, else an fp32 copy of it,
        cut from cast_module's fp32 values (this rank's shard of them in ZeRO)."""
        if self.param_dtype is None:
            return [s.tensor for s in slots]
        return [nn.Parameter(local_values([fp32_values[p] for p in s.params], s.layout, rank)
                             .detach().clone().view_as(s.tensor)) for s in slots]

    def forward(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Floating inputs in the compute dtype, floating outputs back in fp32."""
        if self.param_dtype is None:
            return module(*args, **kwargs)
        args, kwargs = map_tensors(lambda t: _cast(t, self.param_dtype), (args, kwargs))
        return map_tensors(lambda t: _cast(t, torch.float32), module(*args, **kwargs))

    def step(self, optimizer: torch.optim.Optimizer,
             pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """optimizer.step() on the masters. pairs: (master, the 16-bit tensor it stands for)."""
        mixed = [(m, t) for m, t in pairs if m is not t]  # empty in fp32
        for master, t in mixed:
            master.grad = t.grad.float()  # the update is computed in fp32
        optimizer.step()
        with torch.no_grad():
            for master, t in mixed:
                t.copy_(master)  # rounded to the compute dtype
                master.grad = None

    def reload(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """After values were loaded into the 16-bit tensors (model.load_state_dict): each master
        takes the loaded value where it differs from the master's own rounding. A master whose
        rounding is what was loaded keeps its fp32 bits: a save and load round trip changes
        nothing. pairs: (master, the 16-bit tensor it stands for); nothing to do in fp32."""
        with torch.no_grad():
            for master, t in pairs:
                if master is not t:
                    changed = master.to(t.dtype) != t
                    master[changed] = t[changed].float()


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t  # token ids stay integers
