"""Notebook 11, "Optimizers on shards": which optimizers care how a matrix is cut.

`optimizers_on_shards` runs on every rank. One matrix W (rows, cols) and the gradients of a
few steps (the same on every rank: the reduced gradient), stepped by torch's Adafactor and
Muon in four ways, each against one process stepping W whole:

- "flat shards": ZeRO's layout, W flattened, padded and cut in N equal 1-D pieces; each rank
  steps its piece (Adafactor: a 1-D tensor, so no row and column moments; Muon: the piece as
  the (1, k) matrix it is, whose orthogonalised update is its direction). Wrong, no bytes.
- "dim-0 shards": FSDP2's layout, whole rows (torch.chunk); each rank steps its rows
  (Adafactor's column moments from its rows only; Muon orthogonalises a block). Wrong too.
- "whole, one owner": zerolab's design (zerolab/parts/whole_params.py): the rank holding most
  of W gathers the other parts of its gradient, steps W whole, sends each rank its part back.
- "whole, on every rank": every rank all-gathers the gradient and steps W whole (its state
  on every rank too), keeping its own shard. Right, with more bytes from N = 3 on.

Each design's extra bytes (its collectives, not ZeRO's own reduce-scatter and gather) are
measured (zerolab.comm, the ring model of what each rank sends, and the sockets where gloo
lets them be read) and set beside the formula.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.parts.whole_params import extra_bytes, from_owners, route, to_owners
from zerolab.sharding import FlatLayout, flatten, shard

SHAPE = (47, 32)  # odd rows: a flat shard's edge falls inside a row at 2 and 3 ranks
STEPS = 2
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict]] = {
    "Adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "Muon": (torch.optim.Muon, {"lr": 2e-2}),
}
DESIGNS = ("flat shards", "dim-0 shards", "whole, one owner", "whole, on every rank")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's defaults (Keller Jordan's)


def orthogonalize(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's heart, as torch.optim.Muon computes it: about U·V^T of g = U·S·V^T, by five
    Newton-Schulz iterations in bfloat16 on the whole (rows, cols) matrix. Returns float32,
    (rows, cols). Every element depends on every other: a piece of g cannot be done alone."""
    a, b, c = NS_COEFFICIENTS
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).float()


@dataclass
class ShardedStep:
    """One optimizer, one way of cutting W: how far from one process, and what it moved."""

    optimizer: str  # "Adafactor" or "Muon"
    design: str  # one of DESIGNS
    max_diff: float  # max |W - W_reference| after the steps
    update_error: float  # ‖ΔW - ΔW_reference‖ / ‖ΔW_reference‖ (ΔW: W after - W before)
    sent_bytes: int  # measured: the design's collectives, every rank's ring bytes together
    wire_bytes: int | None  # measured on the sockets, every rank together (None: unmeasured)
    formula_bytes: int  # what the formula says the design sends, every rank together
    state_bytes: int  # the optimizer's state, every rank's together


@dataclass
class OptimizersOnShards:
    shape: tuple[int, int]
    world_size: int
    steps: int
    rows: list[ShardedStep]

    def row(self, optimizer: str, design: str) -> ShardedStep:
        return next(r for r in self.rows if r.optimizer == optimizer and r.design == design)


def _problem(shape: tuple[int, int], steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return w, [torch.randn(shape, generator=gen) for _ in range(steps)]


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for s in optimizer.state.values()
               for v in s.values() if torch.is_tensor(v) and v.dim() > 0)


def _stepped(cls: type[torch.optim.Optimizer], kwargs: dict, param: nn.Parameter,
             grads: list[torch.Tensor]) -> int:
    """Step `param` with each gradient (shaped like it); returns the state's bytes."""
    optimizer = cls([param] if param.numel() else [{"params": []}], **kwargs)
    for g in grads:
        param.grad = g.reshape(param.shape).clone()
        optimizer.step()
    return _state_bytes(optimizer)


def _design(name: str, cls: type[torch.optim.Optimizer], kwargs: dict, w0: torch.Tensor,
            grads: list[torch.Tensor], rank: int, n: int) -> tuple[torch.Tensor, int, int]:
    """(W after the steps, as the ranks put it together; this rank's state bytes; the formula
    of the design's bytes, every rank together, over the steps)."""
    layout = FlatLayout.of([w0], n)
    k = layout.shard_numel
    mine = shard(flatten([w0], layout), layout, rank).clone()  # (k,) ZeRO's shard
    g_mine = [shard(flatten([g], layout), layout, rank) for g in grads]
    if name == "flat shards":
        shape = (k,) if cls is torch.optim.Adafactor else (1, k)  # Muon takes 2-D only
        p = nn.Parameter(mine.view(shape))
        state = _stepped(cls, kwargs, p, g_mine)
        return _gathered(p.detach().view(-1), layout, w0), state, 0
    if name == "dim-0 shards":
        rows = list(w0.chunk(n))  # FSDP2's Shard(0): whole rows, the last rank fewer
        p = nn.Parameter(rows[rank].clone())
        state = _stepped(cls, kwargs, p, [g.chunk(n)[rank] for g in grads])
        rows[rank] = p.detach()
        return _all_rows(rows, rank, n), state, 0
    if name == "whole, one owner":
        r = route(layout, rank)
        whole = nn.Parameter(w0.clone()) if r.owned else nn.Parameter(torch.empty(0))
        optimizer = cls([whole] if r.owned else [{"params": []}], **kwargs)
        for g in g_mine:
            arrived = to_owners(g, r, "n11/owner/whole.grad")  # (numel,) on the owner
            if r.owned:
                whole.grad = arrived.view(w0.shape)
            optimizer.step()
            from_owners(whole.detach().reshape(-1), mine, r, "n11/owner/whole.update")
        return (_gathered(mine, layout, w0), _state_bytes(optimizer),
                len(grads) * extra_bytes([layout], 4, 4, values_travel=False))
    # "whole, on every rank": all-gather each gradient, step W whole everywhere
    whole = nn.Parameter(w0.clone())
    optimizer = cls([whole], **kwargs)
    for g in g_mine:
        full = torch.empty(layout.padded_numel)
        comm.all_gather(full, g.contiguous(), tag="n11/everyone/grad")
        whole.grad = full[:layout.numel].view(w0.shape)
        optimizer.step()
    return (whole.detach().clone(), _state_bytes(optimizer),
            len(grads) * (n - 1) * layout.padded_numel * 4)  # (N-1)/N·S from each of N ranks


def _gathered(mine: torch.Tensor, layout: FlatLayout, w0: torch.Tensor) -> torch.Tensor:
    """W from every rank's flat shard (ZeRO's own all-gather, not counted as the design's)."""
    full = torch.empty(layout.padded_numel)
    comm.all_gather(full, mine.contiguous(), tag="n11/check/gather")
    return full[:layout.numel].view(w0.shape)


def _all_rows(rows: list[torch.Tensor], rank: int, n: int) -> torch.Tensor:
    """W from every rank's rows (torch.chunk's blocks, padded to equal ones for the gather)."""
    height = rows[0].shape[0]
    padded = torch.zeros(height, rows[0].shape[1])
    padded[:rows[rank].shape[0]] = rows[rank]
    full = torch.empty(n * height, rows[0].shape[1])
    comm.all_gather(full, padded, tag="n11/check/rows")
    return torch.cat([full[i * height:i * height + r.shape[0]] for i, r in enumerate(rows)])


def _summed(values: list[int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce(t, tag="n11/check/sum")
    return [int(v) for v in t.tolist()]


def optimizers_on_shards(shape: tuple[int, int] = SHAPE, steps: int = STEPS,
                         optimizers: dict[str, tuple[type, dict]] | None = None,
                         ) -> OptimizersOnShards:
    """Run on every rank: each optimizer in each design against one process (the module
    docstring). Every rank returns the same result (bytes summed over the ranks)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    w0, grads = _problem(shape, steps)
    rows = []
    for opt_name, (cls, kwargs) in (optimizers or OPTIMIZERS).items():
        reference = nn.Parameter(w0.clone())
        _stepped(cls, kwargs, reference, grads)
        want = reference.detach() - w0
        for design in DESIGNS:
            with comm.record_comm() as log:
                got, state, formula = _design(design, cls, kwargs, w0, grads, rank, n)
            mine = [e for e in log.events if not e.tag.startswith("n11/check/")]
            wire = [e.wire_bytes for e in mine]
            measured = _summed([sum(e.ring_bytes for e in mine), state,
                                sum(w or 0 for w in wire), wire.count(None)])
            rows.append(ShardedStep(
                opt_name, design, (got - reference.detach()).abs().max().item(),
                ((got - w0 - want).norm() / want.norm()).item(), measured[0],
                None if measured[3] else measured[2], formula, measured[1]))
    return OptimizersOnShards(shape, n, steps, rows)

