"""Parameter groups and dtypes: which parameters may share a bucket.

torch's optimizers take parameter groups, a list of dicts, each with its parameters and the
options that differ for them. The GPT recipe: weight decay on the matrices, none on the biases
and LayerNorm gains. An engine builds its optimizer itself, over flat shards that cut across
parameters, so it takes the groups as an argument, spelled as torch spells them:

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    engine = zerolab.ZeRO2(model, torch.optim.AdamW, lr=1e-3, param_groups=[
        {"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])

The keyword arguments (lr=...) are every group's defaults and a group's own keys override them,
as in torch; engine.optimizer.param_groups[i] is the user's group i (an LR scheduler's
per-group lambdas line up).

A flat shard is stepped with one group's options, so a bucket (a ZeRO-3 unit's flat buffer)
holds the parameters of one group only. A flat buffer also has one dtype: a float64 or bf16
parameter beside fp32 ones gets a bucket of its own. `key(p)` says which parameters may share.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerolab.parts.tiles import OptimizerTiles
from zerolab.sharding import Slot

GROUPS_SPELLING = ("param_groups=[{'params': decay, 'weight_decay': 0.1}, "
                   "{'params': no_decay, 'weight_decay': 0.0}]")


@dataclass(frozen=True)
class ParamGroups:
    """Each trainable parameter's group, and each group's own options."""

    index: dict[nn.Parameter, int]  # trainable parameter -> its group's position
    options: tuple[dict[str, Any], ...]  # per group, its options but "params" ({} for defaults)
    given: bool  # the user passed param_groups (else one group of every trainable parameter)

    @classmethod
    def of(cls, model: nn.Module, groups: Sequence[dict[str, Any]] | None) -> ParamGroups:
        """The groups of `model`'s trainable parameters, checked; groups=None: one group."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        if groups is None:
            return cls({p: 0 for p in trainable}, ({},), False)
        if isinstance(groups, dict) or not isinstance(groups, Sequence) or not groups or \
                not all(isinstance(g, dict) and "params" in g for g in groups):
            raise TypeError(f"param_groups must be a non-empty list of dicts, each with its "
                            f"'params', as torch's optimizers take them: {GROUPS_SPELLING}")
        names = {p: n for n, p in model.named_parameters()}
        index: dict[nn.Parameter, int] = {}
        for i, g in enumerate(groups):
            params = [g["params"]] if isinstance(g["params"], torch.Tensor) else g["params"]
            for p in params:
                if p not in names:
                    raise ValueError(f"param_groups[{i}] holds a tensor of shape "
                                     f"{tuple(p.shape)} that is not a parameter of the model")
                if p in index and index[p] != i:
                    raise ValueError(f"parameter {names[p]} is in param_groups[{index[p]}] and "
                                     f"param_groups[{i}]: each parameter belongs to one group "
                                     f"(torch's optimizers refuse this too)")
                index[p] = i
        for p in trainable:
            if p not in index:
                raise ValueError(f"parameter {names[p]} is in no group of param_groups: put every "
                                 f"trainable parameter in one group (torch would leave it "
                                 f"untrained), or freeze it with requires_grad_(False)")
        options = tuple({k: v for k, v in g.items() if k != "params"} for g in groups)
        return cls({p: i for p, i in index.items() if p.requires_grad}, options, True)

    def key(self, p: nn.Parameter) -> tuple[int, torch.dtype]:
        """Parameters may share a bucket only if their keys are equal: one group, one dtype."""
        return self.index.get(p, -1), p.dtype

    def optimizer_params(self, slots: list[Slot], tiles: OptimizerTiles) -> list:
        """What to give the optimizer: every tile (one group), or torch's list of group dicts,
        each with the tiles of the slots whose parameters are in it."""
        if not self.given:
            return tiles.params()
        return [{"params": [t for i, s in enumerate(slots) if self.index[s.params[0]] == g
                            for t, _, _ in tiles.tiles[i]], **options}
                for g, options in enumerate(self.options)]


def bucket_params(params: list[nn.Parameter], bucket_bytes: int,
                  key: Callable[[nn.Parameter], Hashable]) -> list[list[nn.Parameter]]:
    """Cut `params` (in order) into buckets: a parameter joins the open bucket of its key until
    that bucket holds bucket_bytes. With one key this is one greedy pass, one bucket at a time."""
    buckets: list[list[nn.Parameter]] = []
    open_bucket: dict[Hashable, list[nn.Parameter]] = {}  # key -> the bucket it is filling
    for p in params:
        ps = open_bucket.get(key(p))
        if ps is None or sum(q.numel() * q.element_size() for q in ps) >= bucket_bytes:
            ps = open_bucket[key(p)] = []
            buckets.append(ps)
        ps.append(p)
    return buckets
