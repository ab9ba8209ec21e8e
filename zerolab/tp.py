"""Tensor parallelism (TP) on the course's GPT: each block's matmuls split over the ranks of one
mesh axis, with torch's DeviceMesh, DTensor and `parallelize_module`.

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = tp.tensor_parallel(GPT(config), mesh["tp"])   # Megatron's split of every block
    for block in model.blocks:                           # then FSDP over the other axis
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])

The split (Shoeybi et al., Megatron-LM, 2019), per block, on n ranks of the "tp" axis:
- attention: `qkv` column-parallel (each rank computes q, k, v of n_head / n heads), attention
  on its own heads (no communication), `proj` row-parallel: each rank's (b, s, h) output is a
  partial sum, all-reduced over the axis;
- MLP: `fc` column-parallel (rank r keeps rows r of W1: a (b, s, 4h / n) slice of the hidden
  layer, GELU on it alone), `fc_out` row-parallel (the matching columns of W2), one all-reduce.
So forward all-reduces b·s·h elements twice per block; backward twice more (the gradient of
the block's input to each half is a partial sum over the ranks). Embeddings, LayerNorms and the
head stay whole on every rank of the axis, their gradients equal on every rank.

Two things the course's `Block` needs for that, kept out of models.py:
- `qkv` is one Linear whose rows are [q | k | v]; torch's column split cuts rows into n
  contiguous slices, so the rows are first reordered to [q0 k0 v0 | q1 k1 v1 | ...]
  (`interleave_qkv`), rank r's slice then holding q, k and v of its heads (Megatron does the
  same to its fused QKV); `deinterleave_qkv` undoes it on a full state dict;
- `Block.forward` reads h and the head count from its input; `LocalHeadsBlock` reads them from
  the local q, k, v, whose width is h / n on a TP rank (the same result on one rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zerolab.models import GPT, Block

TP_PLAN_NAMES = {"qkv": "colwise", "proj": "rowwise", "fc": "colwise", "fc_out": "rowwise"}


class LocalHeadsBlock(Block):
    """The course's Block, its forward written for any number of local heads: the head count
    is the local q's width over the head size (n_head on one rank, n_head / n on a TP rank)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, h) -> same
        b, t, h = x.shape
        head_dim = h // self.n_head
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)  # each (b, t, local width)
        q, k, v = (z.view(b, t, -1, head_dim).transpose(1, 2) for z in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, t, -1)  # (b, t, local width)
        x = x + self.proj(y)  # row-parallel: all-reduced to (b, t, h)
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


def local_heads(model: GPT) -> GPT:
    """`model` with each Block replaced, in place, by a LocalHeadsBlock holding the same
    parameters (the same names, the same values)."""
    for i, block in enumerate(model.blocks):
        new = LocalHeadsBlock(model.config)
        new.load_state_dict(block.state_dict())
        model.blocks[i] = new
    return model


def _qkv_order(h: int, n: int) -> torch.Tensor:
    """Row indices that reorder [q | k | v] (3h rows) into n slices [q_r k_r v_r]: (3h,)."""
    return torch.arange(3 * h).view(3, n, h // n).transpose(0, 1).reshape(-1)


def interleave_qkv(model: GPT, n: int) -> None:
    """Reorder every block's qkv rows, in place, so that n contiguous slices hold q, k and v
    of n_head / n heads each."""
    h, heads = model.config.n_embd, model.config.n_head
    if heads % n:
        raise ValueError(f"{heads} heads do not split over {n} tensor-parallel ranks")
    order = _qkv_order(h, n)
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.weight.copy_(block.qkv.weight[order])
            block.qkv.bias.copy_(block.qkv.bias[order])


def deinterleave_qkv(state: dict[str, torch.Tensor], h: int, n: int) -> dict[str, torch.Tensor]:
    """A full state dict of a model interleaved for n ranks, with qkv's rows back in the
    course's order [q | k | v] (a new dict; the other tensors as they are)."""
    back = torch.argsort(_qkv_order(h, n))
    return {k: v[back] if k.endswith(("qkv.weight", "qkv.bias")) else v
            for k, v in state.items()}


def tensor_parallel(model: GPT, tp_mesh) -> GPT:
    """Megatron's split of every block of `model` over the 1-D DeviceMesh `tp_mesh`, with
    torch's parallelize_module: the TP_PLAN_NAMES layers' weights become DTensors sharded
    over the axis (column-parallel: Shard(0); row-parallel: Shard(1)). In place; returns it."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    local_heads(model)
    interleave_qkv(model, tp_mesh.size())
    for block in model.blocks:
        parallelize_module(block, tp_mesh,
                           {name: styles[kind]() for name, kind in TP_PLAN_NAMES.items()})
    return model


def full_state(model: nn.Module, h: int, n: int) -> dict[str, torch.Tensor]:
    """Every parameter of a TP (and FSDP) model, whole, in the course's qkv order: a
    collective over the mesh (DTensor.full_tensor gathers each parameter)."""
    state = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().clone()
    return deinterleave_qkv(state, h, n)
