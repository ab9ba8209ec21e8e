"""Notebook 12, meshes: FSDP x tensor parallelism on 4 ranks as a 2x2 DeviceMesh.

The mesh is torch's `init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))`: ranks
{0, 1} and {2, 3} are the "tp" groups (each splits every block's matmuls, zerolab.tp), ranks
{0, 2} and {1, 3} the "dp" groups (FSDP2's fully_shard over each block and the root: each rank
holds half of its TP shard, gathered per unit). zerolab.wire.peers measures what each rank
sends to each other rank, so the bytes that cross each axis are measured, per phase, not
inferred: a rank's TP peer is the other rank of its "tp" group, its DP peer that of its "dp"
group, and nothing should go to the third.

`mesh_lesson` runs on every rank of a 4-rank launch and returns a `MeshRun`: the bytes to each
peer in forward, backward and the optimizer step (the fewest over REPEATS identical steps),
the same at a second batch size (the crossover), the losses and the final full weights, to
compare with one process training the same model on the same global batches (`reference`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import harness, theory, tp
from zerolab.lessons.n09_nodes import fewest
from zerolab.models import GPT, GPTConfig
from zerolab.wire.peers import record_peer_bytes

# Notebook 09's GPT: 4 blocks, h = 64, 4 heads (2 per TP rank), sequences of 16 tokens.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)
DP, TP = 2, 2  # the mesh: (dp, tp)
SEQS = 4  # sequences per data-parallel rank per step (both ranks of a tp group read them)
SEQS_LARGER = 12  # a second batch size, for the crossover
SGD = {"lr": 1e-2, "momentum": 0.9}  # not Adam: see n09_nodes.sgd_run
STEPS = 3  # steps trained (and compared with one process) before the bytes are measured
REPEATS = 3  # identical steps measured per peer: the fewest bytes count (n09_nodes.fewest)
PHASES = ("forward", "backward", "step")


def make_mesh():
    """The 2x2 mesh over the 4 ranks of the job: rows are "dp" coordinates, columns "tp"."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))


def fsdp_tp(mesh, config: GPTConfig = MODEL) -> GPT:
    """The course's GPT with TP over mesh["tp"] (zerolab.tp), then FSDP2 over mesh["dp"]:
    fully_shard on every block, then on the root (whose weights stay gathered from forward
    to backward, FSDP2's default for the root)."""
    from torch.distributed.fsdp import fully_shard

    model = tp.tensor_parallel(GPT(config), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def global_batch(step: int, seqs: int = SEQS) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch: DP * seqs sequences of MODEL's 16 tokens (inputs,
    targets), the same in every process."""
    return GPT(MODEL).make_batch(DP * seqs, 100 + step)


def rows_of(batch: tuple[torch.Tensor, ...], dp_rank: int) -> tuple[torch.Tensor, ...]:
    """The rows a data-parallel rank trains on (both ranks of its "tp" group read them)."""
    return harness.local_rows(batch, dp_rank, DP)


@dataclass
class MeshRun:
    """What one rank measured in the 2x2 run."""

    rank: int
    tp_peer: int  # the other rank of this rank's "tp" group
    dp_peer: int  # the other rank of this rank's "dp" group
    sent: dict[str, dict[int, int]]  # phase -> {peer: bytes} in one step of SEQS per dp rank
    sent_larger: dict[int, int]  # {peer: bytes} in one whole step of SEQS_LARGER per dp rank
    local_numel: dict[str, int]  # elements of this rank's TP shard: "all", "root" (FSDP's units)
    shapes: dict[str, tuple]  # block 0's weights: name -> (full shape, TP shard's, placement)
    losses: list[float]  # this rank's loss at each of the STEPS steps
    full: dict[str, torch.Tensor]  # every weight after STEPS steps, whole (course order)

    def axis(self, peer_bytes: dict[int, int]) -> dict[str, int]:
        """Bytes by axis: to the TP peer, to the DP peer, to the third rank."""
        other = [p for p in peer_bytes if p not in (self.tp_peer, self.dp_peer)]
        return {"tp": peer_bytes.get(self.tp_peer, 0), "dp": peer_bytes.get(self.dp_peer, 0),
                "neither": sum(peer_bytes[p] for p in other)}

    def step_bytes(self) -> dict[str, int]:
        """Bytes by axis in one whole step (the phases added)."""
        total: dict[int, int] = {}
        for to in self.sent.values():
            for peer, b in to.items():
                total[peer] = total.get(peer, 0) + b
        return self.axis(total)


def local_numel(model: GPT) -> dict[str, int]:
    """Elements of this rank's TP shard of the model (before FSDP): a DTensor's local part,
    a plain parameter whole. "root": those outside the blocks (FSDP2's root unit)."""
    def numel(p) -> int:
        return p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    every = sum(numel(p) for p in model.parameters())
    blocks = sum(numel(p) for p in model.blocks.parameters())
    return {"all": every, "root": every - blocks}


def placements(block: torch.nn.Module) -> dict[str, tuple]:
    """Each weight and bias of `block`: (full shape, this rank's shard's shape, placement)."""
    out = {}
    for name, p in block.named_parameters():
        if hasattr(p, "placements"):
            out[name] = (tuple(p.shape), tuple(p.to_local().shape), repr(p.placements[0]))
        else:
            out[name] = (tuple(p.shape), tuple(p.shape), "a plain tensor, whole")
    return out


def _one_step(model: GPT, optimizer, x, y, measure: bool) -> tuple[float, dict]:
    """Forward, backward, step; with measure, the bytes to each peer in each phase."""
    sent: dict[str, dict[int, int]] = {}

    def counted():
        return record_peer_bytes() if measure else contextlib.nullcontext()
    with counted() as peers:
        loss = GPT.loss(model(x), y)
    sent["forward"] = peers.to if measure else {}
    with counted() as peers:
        loss.backward()
    sent["backward"] = peers.to if measure else {}
    with counted() as peers:
        optimizer.step()
        optimizer.zero_grad()
    sent["step"] = peers.to if measure else {}
    return loss.item(), sent


def _peers(mesh) -> tuple[int, int]:
    """This rank's TP peer and DP peer: the other rank of its "tp" and of its "dp" group."""
    rank = dist.get_rank()
    return tuple(next(r for r in dist.get_process_group_ranks(mesh.get_group(axis)) if r != rank)
                 for axis in ("tp", "dp"))


def whole_steps(model: GPT, optimizer, seqs: int, step: int, dp_rank: int) -> dict[int, int]:
    """Bytes to each peer in one whole step of `seqs` sequences per dp rank (the fewest over
    REPEATS identical steps)."""
    x, y = rows_of(global_batch(step, seqs), dp_rank)
    sent = []
    for _ in range(REPEATS):
        with record_peer_bytes() as peers:
            _one_step(model, optimizer, x, y, measure=False)
        sent.append(peers.to)
    return fewest(sent)


def mesh_lesson() -> MeshRun:
    """On every rank of a 4-rank launch: STEPS steps of FSDP x TP (compared with one process),
    then the bytes of REPEATS identical steps per phase, and of REPEATS at SEQS_LARGER."""
    mesh = make_mesh()
    dp_rank = mesh.get_local_rank("dp")
    tp_only = tp.tensor_parallel(GPT(MODEL), mesh["tp"])
    shards, shapes = local_numel(tp_only), placements(tp_only.blocks[0])
    model = fsdp_tp(mesh)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(STEPS):
        x, y = rows_of(global_batch(step), dp_rank)
        losses.append(_one_step(model, optimizer, x, y, measure=False)[0])
    full = tp.full_state(model, MODEL.n_embd, TP)
    runs: dict[str, list] = {phase: [] for phase in PHASES}
    x, y = rows_of(global_batch(STEPS), dp_rank)
    for _ in range(REPEATS):  # the same batch: the same collectives, the same bytes
        for phase, to in _one_step(model, optimizer, x, y, measure=True)[1].items():
            runs[phase].append(to)
    larger = whole_steps(model, optimizer, SEQS_LARGER, STEPS + 1, dp_rank)
    return MeshRun(dist.get_rank(), *_peers(mesh),
                   {phase: fewest(m) for phase, m in runs.items()}, larger, shards, shapes,
                   losses, full)


def reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole model, the same global batches and SGD: the loss at each step
    (on the whole global batch) and the weights after `steps` steps."""
    model = GPT(MODEL)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    losses = []
    for step in range(steps):
        x, y = global_batch(step)
        loss = GPT.loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# ---- the formulas -------------------------------------------------------------------------


def formula(local: dict[str, int], seqs: int = SEQS, config: GPTConfig = MODEL,
            dp: int = DP, tp_size: int = TP,
            reduce_scatter_factor: float = 2.0) -> dict[str, dict[str, float]]:
    """Bytes one rank sends over each axis in each phase of one fp32 step: axis -> phase ->
    bytes. local: local_numel(), this rank's TP shard (elements).

    TP: 2 all-reduces per block per pass of b·s·h elements (b·s: this dp rank's tokens), each
    2(n-1)/n of its bytes (ring). DP (FSDP2): forward all-gathers every unit's shard of the TP
    shard, (n-1)/n of 4·Ψ_local; backward all-gathers every unit but the root again and
    reduce-scatters the gradients, (n-1)/n of 4·Ψ_local times reduce_scatter_factor: 2 on
    gloo, which has no reduce-scatter and runs torch's as an all-reduce (notebook 02); 1 in
    the ring model (NCCL)."""
    tokens = seqs * config.block_size
    activation = 4 * tokens * config.n_embd  # S of one all-reduce, bytes
    per_pass = 2 * config.n_layer * theory.ring_sent_bytes("all_reduce", activation, tp_size)
    gather = theory.ring_sent_bytes("all_gather", 4 * local["all"], dp)
    again = theory.ring_sent_bytes("all_gather", 4 * (local["all"] - local["root"]), dp)
    reduce = reduce_scatter_factor * theory.ring_sent_bytes("reduce_scatter", 4 * local["all"],
                                                            dp)
    return {"tp": {"forward": per_pass, "backward": per_pass, "step": 0.0},
            "dp": {"forward": gather, "backward": again + reduce, "step": 0.0}}


def crossover_seqs(tp_at: dict[int, float], dp_bytes: float) -> int:
    """The fewest sequences per dp rank at which the TP axis carries more bytes per step than
    the DP axis: TP's bytes are a line in the sequences (through the two measured points
    tp_at = {seqs: bytes}), DP's do not depend on them."""
    (s0, b0), (s1, b1) = sorted(tp_at.items())
    slope = (b1 - b0) / (s1 - s0)
    seqs = 1
    while b0 + slope * (seqs - s0) <= dp_bytes:
        seqs += 1
    return seqs


def crossover_tokens(h: int, n_dp: int, n_tp: int, w_dp: float = 1.0,
                     w_tp: float = 1.0) -> float:
    """Tokens per dp rank at which a block's TP traffic takes as long as its FSDP traffic.

    Per block and step, in values of one dtype: FSDP sends 3 (N_dp-1)/N_dp of the rank's TP
    shard of the block's 12h² weights (two gathers and a reduce-scatter); TP sends 4 all-reduces
    of T·h, each 2(N_tp-1)/N_tp. w_dp, w_tp: each axis's link bandwidth (only their ratio
    counts). Biases and LayerNorms left out: 12h² is the block's matrices."""
    fsdp = 3 * (n_dp - 1) / n_dp * 12 * h * h / n_tp / w_dp
    tp_per_token = 4 * 2 * (n_tp - 1) / n_tp * h / w_tp
    return fsdp / tp_per_token


# ---- graded predictions (zerolab.lessons.predictions: "12.p1", "12.p2") --------------------


def _measured_on_rank(ids: list[str]) -> dict[str, float]:
    """Inside a 4-rank launch: one warm-up step, then what each prediction asks, on rank 0's
    side of the mesh (every rank measures; rank 0's value counts)."""
    mesh = make_mesh()
    dp_rank = mesh.get_local_rank("dp")
    tp_peer, dp_peer = _peers(mesh)
    model = fsdp_tp(mesh)
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    _one_step(model, optimizer, *rows_of(global_batch(0), dp_rank), measure=False)
    at = {seqs: whole_steps(model, optimizer, seqs, 1, dp_rank) for seqs in (SEQS, SEQS_LARGER)}
    out = {"12.p1": float(at[SEQS].get(tp_peer, 0)),
           "12.p2": float(crossover_seqs({s: to.get(tp_peer, 0) for s, to in at.items()},
                                         at[SEQS].get(dp_peer, 0)))}
    return {id: out[id] for id in ids}


def measured_for(id: str) -> float:
    """What prediction `id` ("12.p1", "12.p2") is scored against: one 4-rank launch."""
    import zerolab

    if id not in ("12.p1", "12.p2"):
        raise ValueError(f"no measurement for prediction {id!r} here; known: 12.p1, 12.p2")
    return zerolab.launch(_measured_on_rank, DP * TP, args=([id],), timeout=600)[0][id]
