"""Notebook 09, past one node: HSDP and ZeRO++, on 4 ranks as 2 "nodes".

On one machine a "node" is a group of consecutive ranks (zerolab.parts.mesh): with 4 ranks and nodes
of 2, ranks {0, 1} are node 0 and {2, 3} node 1. zerolab.wire.peers measures the bytes each rank
sends to each other rank (per TCP connection), so the bytes that would cross the slow link
between nodes are measured, not inferred.

`nodes_lesson` runs on every rank of a 4-rank launch and returns a `NodesLesson`:
- one training step of ZeRO-3, HSDP, qwZ, hpZ and qwZ+hpZ: bytes to each peer, the comm log,
  model-state bytes, hpZ's secondary shards (`Traffic`);
- one world-wide all-gather, reduce-scatter and all-reduce: which links they use
  (`world_collectives`);
- HSDP against DDP on the same global batches, with SGD (a distance);
- loss curves on the course's corpus, ZeRO-3 with and without int8 weights;
- HSDP refused on a world that does not split into whole nodes.

`sgd_run` also trains notebook 09b's checkpoints (lessons/n09_saves.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import comm, engines, harness, theory
from zerolab.comm import CommLog
from zerolab.data import Corpus
from zerolab.models import GPT, GPTConfig
from zerolab.parts.quantize import BLOCK, dequantize_int8, quantize_int8
from zerolab.wire.peers import record_peer_bytes

# 4 blocks of hidden size 64: Ψ = 205,184 (820 kB in fp32). Each unit's size divides by 4, so
# no unit is padded at 2 or 4 ranks.
MODEL = GPTConfig(n_layer=4, n_embd=64, n_head=4)
NODE = 2  # ranks per "node"
GLOBAL_BATCH = 12  # sequences per step: divides by 2, 3 and 4 ranks
SGD = {"lr": 1e-2, "momentum": 0.9}  # for distances: see sgd_run
VARIANTS: dict[str, tuple[str, dict]] = {  # name -> (engine, keyword arguments)
    "ZeRO-3": ("zero3", {}),
    "HSDP": ("hsdp", {"shard_size": NODE}),
    "qwZ": ("zeropp", {"quantize_weights": True}),
    "hpZ": ("zeropp", {"secondary_shard_size": NODE}),
    "qwZ+hpZ": ("zeropp", {"quantize_weights": True, "secondary_shard_size": NODE}),
}
# With qgZ (measured by lessons/n09_qgz.py, whose launch runs them; the same tables take them).
QGZ_VARIANTS = {"qgZ": ("zeropp", {"quantize_grads": True, "node_size": NODE}),
                "ZeRO++ (qwZ+hpZ+qgZ)": ("zeropp", {"quantize_weights": True,
                                                    "secondary_shard_size": NODE,
                                                    "quantize_grads": True})}
CURVE_STEPS = 80  # training steps of each loss curve (the drift shows by then; 200 took most
#                   of the notebook's launch)
CURVE_BATCH, CURVE_SEQ = 16, 32  # global batch (sequences) and tokens per sequence
CURVE_LR = 3e-3


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the world size (0 of 1 outside a launch)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def batch(model: GPT, step: int) -> tuple[torch.Tensor, ...]:
    """This rank's rows of step `step`'s global batch of GLOBAL_BATCH sequences."""
    rank, world_size = rank_and_size()
    return harness.local_batch(model.make_batch, GLOBAL_BATCH, 100 + step, rank, world_size)


# ---- traffic: what crosses between the nodes -----------------------------------------------


@dataclass
class Traffic:
    """One measured training step of one variant, on one rank."""

    to: dict[int, int]  # bytes sent to each other rank in one step (zerolab.wire.peers; `fewest`)
    across: int  # of which to ranks of the other node
    log: CommLog  # every collective: tag, group_ranks, ring and wire bytes
    held: dict[str, int]  # model-state bytes after step(): params, grads, optimizer
    max_params: int  # the most parameter bytes alive at any moment of the step
    secondary_bytes: int  # hpZ: secondary shards held when the forward ends (else 0)


REPEATS = 3  # identical steps (and collectives) measured per peer: see `fewest`


def fewest(measurements: list[dict[int, int]]) -> dict[int, int]:
    """Per peer, the fewest bytes over identical measurements. The kernel's per-connection
    counter also counts a segment TCP sends again (on a loaded machine, a loopback connection
    now and then retransmits one): a repeat only adds bytes, so the fewest is what was sent."""
    peers = sorted({peer for m in measurements for peer in m})
    return {peer: min(m.get(peer, 0) for m in measurements) for peer in peers}


def measure_traffic(variant: str) -> Traffic:
    """A warm-up step (Adam's state is created), then REPEATS identical steps measured per
    peer, the first under the memory tracker too."""
    name, kwargs = {**VARIANTS, **QGZ_VARIANTS}[variant]
    model = GPT(MODEL)
    engine = engines.make_engine(name, model, torch.optim.AdamW, lr=1e-3, **kwargs)
    harness.train_step(engine, *batch(model, 0))
    secondary: list[int] = []
    # Registered after the engine's own hooks: runs once the root's forward has resharded
    # every unit, when hpZ holds all its secondary shards.
    hook = model.register_forward_hook(lambda m, args, out: secondary.append(
        sum(t.numel() * t.element_size() for t in getattr(engine, "secondary", {}).values())))
    sent, steps = [], []
    for i in range(REPEATS):  # the same batch each time: the same collectives, the same bytes
        with record_peer_bytes() as peers:
            steps.append(harness.measured_step(engine, *batch(model, 1), memory=i == 0))
        sent.append(peers.to)
    hook.remove()
    to = fewest(sent)
    across = sum(b for peer, b in to.items() if peer // NODE != dist.get_rank() // NODE)
    return Traffic(to, across, steps[0].log, steps[0].held,
                   steps[0].memory.max_by_category["params"], secondary[0])


def unit_numels(config: GPTConfig = MODEL, world_size: int = 4) -> dict[str, int]:
    """Each ZeRO-3 unit's element count, padded for `world_size` ranks: what a gather moves."""
    from zerolab.sharding import FlatLayout
    from zerolab.units import make_units

    return {u.name: FlatLayout.of(u.params, world_size).padded_numel
            for u in make_units(GPT(config))}


def world_collectives(numel: int = 1 << 16) -> dict[str, dict[int, int]]:
    """One all-gather, one reduce-scatter and one all-reduce of `numel` fp32 over every rank:
    the bytes this rank sent to each peer (the fewest over REPEATS runs of each)."""
    rank, world_size = rank_and_size()
    shard = torch.full((numel // world_size,), float(rank))
    runs: dict[str, list[dict[int, int]]] = {"all_gather": [], "reduce_scatter": [],
                                             "all_reduce": []}
    for _ in range(REPEATS):
        with record_peer_bytes() as sent:
            comm.all_gather(torch.empty(numel), shard, tag="world/all_gather")
        runs["all_gather"].append(sent.to)
        with record_peer_bytes() as sent:
            comm.reduce_scatter(torch.empty(numel // world_size), torch.ones(numel),
                                tag="world/reduce_scatter")
        runs["reduce_scatter"].append(sent.to)
        with record_peer_bytes() as sent:
            comm.all_reduce(torch.ones(numel), tag="world/all_reduce")
        runs["all_reduce"].append(sent.to)
    return {op: fewest(measured) for op, measured in runs.items()}


def share_across(per_rank: list[dict[int, int]], node_size: int = NODE) -> float:
    """Of all the bytes the ranks sent, the share that went to a rank of another node."""
    total = sum(b for to in per_rank for b in to.values())
    across = sum(b for r, to in enumerate(per_rank) for peer, b in to.items()
                 if peer // node_size != r // node_size)
    return across / total


# On 2 nodes of 2 with gloo, the share of a world-wide collective's bytes that crosses between
# the nodes (derived in notebook 09 from gloo's algorithms, and measured by world_collectives):
GATHER_SHARE = 5 / 6  # an all-gather is 4 broadcasts, each a binomial tree that ignores nodes
# zerolab's reduce-scatter sends one chunk to each other rank: 2 of a rank's 3 peers are across
REDUCE_SCATTER_SHARE = 2 / 3
ALL_REDUCE_SHARE = 1 / 2  # a ring in rank order crosses at 2 of its 4 links
PHASES = ("forward all-gather", "backward all-gather", "gradients")

# The ZeRO++ paper's cross-node volume per step, in model sizes (M = Ψ 16-bit values), by phase.
PAPER = {"ZeRO-3": (1.0, 1.0, 1.0), "qwZ": (0.5, 1.0, 1.0), "hpZ": (1.0, 0.0, 1.0),
         "qwZ+hpZ": (0.5, 0.0, 1.0), "ZeRO++ (qwZ+hpZ+qgZ)": (0.5, 0.0, 0.25)}


def formula(variant: str, numels: dict[str, int], world_size: int = 4,
            node_size: int = NODE) -> dict[str, float]:
    """Bytes one rank sends to other nodes in one step, on average over the ranks, by phase:
    what the engines issue, as gloo runs it on 2 nodes of 2. numels: unit_numels()."""
    n, fp32 = world_size, 4 * sum(numels.values())
    if variant == "HSDP":  # only the replicas' all-reduce of the gradient shards crosses
        replicas = theory.ring_sent_bytes("all_reduce", fp32 / node_size, n // node_size)
        return dict(zip(PHASES, (0.0, 0.0, replicas)))
    options = {**VARIANTS, **QGZ_VARIANTS}[variant][1]
    gathered = fp32
    if options.get("quantize_weights"):  # each rank quantises its own shard of each unit
        gathered = sum(n * theory.int8_bytes(p // n) for p in numels.values())
    forward = GATHER_SHARE * theory.ring_sent_bytes("all_gather", gathered, n)
    # Backward gathers every unit again but the root, kept gathered from forward to backward
    # (zerolab.zero3), unless qwZ rounded its forward weights: then the exact ones are gathered.
    again = fp32 if options.get("quantize_weights") else fp32 - 4 * numels["root"]
    backward = 0.0 if options.get("secondary_shard_size") else (
        GATHER_SHARE * theory.ring_sent_bytes("all_gather", again, n))
    # the gradients' reduce-scatter: a chunk straight to each other rank (zerolab.wire.backends)
    gradients = REDUCE_SCATTER_SHARE * theory.ring_sent_bytes("reduce_scatter", fp32, n)
    if options.get("quantize_grads"):  # qgZ: its hop across nodes (zerolab.zeropp)
        bits = 4 if options["quantize_grads"] == "int4" else 8
        gradients = sum(theory.qgz_sent_bytes(p, n, node_size, bits)[1] for p in numels.values())
    return dict(zip(PHASES, (forward, backward, gradients)))


def across_mean(runs: list[NodesLesson], variant: str) -> float:
    """Bytes a rank sent to the other node in the measured step, averaged over the ranks."""
    return sum(r.traffic[variant].across for r in runs) / len(runs)


def traffic_table(runs: list[NodesLesson], variants: list[str] | None = None,
                  paper_counts: dict[str, tuple[float, ...]] | None = None) -> list[str]:
    """Per variant, in model sizes M (the paper's: Ψ 16-bit values; here: 4Ψ, fp32): the
    paper's cross-node volume, the formula by phase for gloo on 2 nodes of 2, the measurement.
    variants (default: VARIANTS, then PAPER's others, unmeasured) and paper_counts (default:
    PAPER): for tables that take qgZ's measured steps too (lessons/n09_qgz.py)."""
    numels = unit_numels(MODEL, len(runs))
    m = 4 * sum(numels.values())
    paper_counts = PAPER if paper_counts is None else paper_counts
    if variants is None:
        variants = [*VARIANTS, *(p for p in PAPER if p not in VARIANTS)]
    rows = [f"{'':21}{'paper':>6} | {'formula, x M':^27} | {'measured':^18}",
            f"{'':21}{'x M':>6} |{'fwd':>7}{'bwd':>7}{'grads':>7}{'total':>7} |"
            f"{'x M':>7}{'- formula':>11}"]
    for v in variants:
        paper = f"{sum(paper_counts[v]):6.2f}" if v in paper_counts else f"{'-':>6}"
        if v not in runs[0].traffic:
            rows.append(f"{v:21}{paper} | {'(qgZ not built)':^27} |")
            continue
        by_phase, measured = formula(v, numels, len(runs)), across_mean(runs, v)
        total = sum(by_phase.values())
        rows.append(f"{v:21}{paper} |" + "".join(f"{x / m:7.3f}" for x in by_phase.values())
                    + f"{total / m:7.3f} |{measured / m:7.3f}"
                    f"{(measured - total) / 2**10:+7.0f} KiB")
    return rows


def block_errors(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) through int8 and back: the largest error in each block, and its bound,
    max|x in the block| / 254 (half a step of the scale max|x| / 127). Both (blocks,)."""
    restored = dequantize_int8(*quantize_int8(x, block), block)
    padded = torch.zeros(-(-x.numel() // block) * block)  # (blocks * block,): zeros are exact
    padded[:x.numel()] = x
    worst = torch.zeros_like(padded)
    worst[:x.numel()] = (restored - x).abs()
    return worst.view(-1, block).amax(1), padded.view(-1, block).abs().amax(1) / 254


# ---- training: distances and loss curves ---------------------------------------------------


# SGD with momentum, not Adam, where distances are compared: Adam divides by the root of its
# second moment, so an element whose gradient is about zero moves by ±lr depending on how its
# gradient was rounded, which would hide a real difference behind a reduction order.
def sgd_run(variant: str, steps: range, load_from: str | None = None,
            save_to: str | None = None, **kwargs) -> dict[str, torch.Tensor]:
    """Train MODEL with `variant` ("DDP", or one of VARIANTS) over `steps`; optionally load a
    checkpoint first and save one after. Returns the full weights."""
    from zerolab import checkpoint

    name, variant_kwargs = VARIANTS.get(variant, (variant.lower(), {}))
    model = GPT(MODEL)
    engine = engines.make_engine(name, model, torch.optim.SGD, **SGD,
                                 **{**variant_kwargs, **kwargs})
    if load_from:
        checkpoint.load(engine, load_from)
    for step in steps:
        harness.train_step(engine, *batch(model, step))
    if save_to:
        checkpoint.save(engine, save_to)
    return engine.full_state_dict()


def curve_config() -> GPTConfig:
    """A smaller GPT over the corpus's characters, for a few hundred steps on a CPU."""
    vocab = Corpus.builtin().tokenizer.vocab_size
    return GPTConfig(vocab_size=vocab, block_size=CURVE_SEQ, n_layer=2, n_embd=32, n_head=2)


def loss_curve(quantize_weights: bool, steps: int = CURVE_STEPS, **options) -> list[float]:
    """ZeRO-3 (qwZ or not; `options`: other ZeRO++ options, qgZ's) on the built-in corpus:
    this rank's loss at every step."""
    rank, world_size = rank_and_size()
    corpus = Corpus.builtin()
    model = GPT(curve_config())
    options = {"quantize_weights": quantize_weights, **options} if quantize_weights else options
    engine = engines.make_engine("zeropp" if options else "zero3", model, torch.optim.AdamW,
                                 lr=CURVE_LR, **options)
    losses = []
    for step in range(steps):
        x, y = harness.local_rows(corpus.batch(CURVE_BATCH, CURVE_SEQ, seed=step), rank,
                                  world_size)
        losses.append(harness.train_step(engine, x, y).item())
    return losses


def mean_curve(curves: list[list[float]]) -> list[float]:
    """The loss on the whole global batch at each step: the mean of the ranks' losses (each
    rank's loss is a mean over its own rows, and every rank has as many rows)."""
    return [sum(step) / len(step) for step in zip(*curves)]


# ---- one launch on 4 ranks -----------------------------------------------------------------


@dataclass
class NodesLesson:
    """Everything the 4-rank launch measures, on one rank."""

    traffic: dict[str, Traffic]  # per variant
    world: dict[str, dict[int, int]]  # world all-gather / reduce-scatter / all-reduce: to each peer
    hsdp_vs_ddp: float  # max |HSDP - DDP| over the weights after the same SGD steps
    zero3_vs_ddp: float  # the same for ZeRO-3: the yardstick (only the reduction order)
    curves: dict[str, list[float]]  # "fp32", "int8": this rank's loss at every step
    refused: str = ""  # HSDP with nodes of 3 on 4 ranks: the error's message


def nodes_lesson(curve_steps: int = CURVE_STEPS) -> NodesLesson:
    """Everything of notebook 09 that runs on 4 ranks (see the module docstring)."""
    traffic = {v: measure_traffic(v) for v in VARIANTS}
    world = world_collectives()
    ddp = sgd_run("DDP", range(3))
    distances = [harness.max_diff(sgd_run(v, range(3)), ddp) for v in ("HSDP", "ZeRO-3")]
    curves = {"fp32": loss_curve(False, curve_steps), "int8": loss_curve(True, curve_steps)}
    refused = ""
    try:  # refused before any group is made: every rank raises alike
        engines.make_engine("hsdp", GPT(MODEL), torch.optim.SGD, shard_size=NODE + 1, **SGD)
    except ValueError as e:
        refused = str(e)
    return NodesLesson(traffic, world, *distances, curves, refused)
