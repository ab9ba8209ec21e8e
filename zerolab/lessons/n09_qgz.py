"""Notebook 09, qgZ: ZeRO++'s quantised gradients on 4 ranks as 2 "nodes" of 2.

`qgz_lesson` runs on every rank of a 4-rank launch and returns a `QgzLesson`:
- one backward's gradients (n09_nodes.MODEL on this rank's batch), flattened per ZeRO-3 unit,
  reduce-scattered over the 4 ranks three ways: as ZeRO-3 does (fp32, each chunk straight to
  its owner), and with qgZ in int8 and in int4 (zerolab.parts.qgz.quantized_reduce_scatter): the
  bytes this rank sent to each peer (zerolab.wire.peers, the fewest of n09_REPEATS), and
  how far the quantised results land from fp32's, against their bound (`Gradients`);
- one measured training step of qgZ alone and of ZeRO++ whole (qwZ+hpZ+qgZ), as n09_nodes
  measures the other variants (n09_nodes.measure_traffic, QGZ_VARIANTS): for its tables;
- loss curves on the course's corpus (n09_nodes.loss_curve): ZeRO-3 with each way.

`bytes_table` sets the bytes against their formula (zerolab.theory.qgz_sent_bytes) and the
paper's count; `drift_table` the final losses against fp32's. (n09_nodes holds the rest of the
notebook; this module is its own to keep each under 500 lines.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab import comm, theory
from zerolab.lessons import n09_nodes, schematics
from zerolab.lessons.n09_nodes import NODE, REPEATS
from zerolab.models import GPT
from zerolab.parts.mesh import make_nodes
from zerolab.parts.qgz import quantized_reduce_scatter
from zerolab.parts.quantize import LEVELS
from zerolab.sharding import FlatLayout, flatten
from zerolab.units import make_units
from zerolab.wire.peers import record_peer_bytes

WAYS = {"fp32": None, "qgZ int8": 8, "qgZ int4": 4}  # how gradients travel -> bits (None: fp32)
# The paper's cross-node count for the gradients, x ZeRO-3's: int4 of fp16 is a quarter. Its
# ZeRO-3 is a ring reduce-scatter, which leaves each node once, (N-1)/N·S per node; zerolab's
# sends every chunk straight to its owner, k(N-k)/N·S out of each node (every rank sends its
# chunks across): up to k times as much, so qgZ's share of it is about a k-th of the paper's.
PAPER = {"fp32": 1.0, "qgZ int4": 0.25}
LAST = 20  # steps: the final loss is the mean over the last ones (batch-to-batch noise)


@dataclass
class Gradients:
    """One backward's gradients, reduce-scattered over every rank each way of WAYS, on one rank."""

    to: dict[str, dict[int, int]]  # way -> bytes sent to each other rank
    across: dict[str, int]  # way -> of which to a rank of the other node
    error: dict[str, float]  # way -> max |its averaged gradient shards - fp32's|
    bound: dict[str, float]  # way -> the most the rounding can move one: see `rounding_bound`
    largest: float  # max |fp32's averaged gradient shards|: what the errors compare to


def rounding_bound(largest_input: float, bits: int, world_size: int = 4,
                   node_size: int = NODE) -> float:
    """How far qgZ's average can land from the exact one, for inputs of at most `largest_input`:
    hop 1 rounds each rank's values once (half a step, max|block| / 2L), hop 2 each node's sum
    (at most k times as large), and the average divides the N roundings by N. A hop over one
    rank rounds nothing."""
    half_step = largest_input / (2 * LEVELS[bits])
    hop1 = half_step if node_size > 1 else 0.0
    hop2 = half_step * (1 + 1 / (2 * LEVELS[bits])) if world_size > node_size else 0.0
    return hop1 + hop2


def gradients() -> Gradients:
    """Every way of WAYS on the same gradients; REPEATS times, for the fewest bytes per peer."""
    rank, world_size = n09_nodes.rank_and_size()
    nodes = make_nodes(NODE)
    model = GPT(n09_nodes.MODEL)
    x, y = n09_nodes.batch(model, 0)
    model.loss(model(x), y).backward()
    units = make_units(model)
    fulls = [flatten([p.grad for p in u.params], FlatLayout.of(u.params, world_size))
             for u in units]  # (padded_numel,) per unit
    largest = torch.stack([f.abs().max() for f in fulls]).max()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)  # the largest input on any rank
    sent: dict[str, list[dict[int, int]]] = {way: [] for way in WAYS}
    shards: dict[str, torch.Tensor] = {}
    for _ in range(REPEATS):
        for way, bits in WAYS.items():
            outs = [torch.empty(f.numel() // world_size) for f in fulls]  # (shard_numel,)
            with record_peer_bytes() as peers:
                for unit, full, out in zip(units, fulls, outs):
                    tag = f"lesson09/{way}/{unit.name}"
                    if bits is None:  # ZeRO-3's (zerolab.zero2.ZeRO2._reduce)
                        comm.reduce_scatter(out, full, op="avg", tag=tag)
                    else:
                        quantized_reduce_scatter(out, full, nodes, tag=tag, bits=bits).wait()
            sent[way].append(peers.to)
            shards[way] = torch.cat(outs)
    to = {way: n09_nodes.fewest(measured) for way, measured in sent.items()}
    across = {way: sum(b for peer, b in to[way].items() if peer // NODE != rank // NODE)
              for way in WAYS}
    error = {way: (shards[way] - shards["fp32"]).abs().max().item() for way in WAYS}
    bound = {way: rounding_bound(largest.item(), bits) if bits else 0.0
             for way, bits in WAYS.items()}
    return Gradients(to, across, error, bound, shards["fp32"].abs().max().item())


def formula_across(way: str, world_size: int = 4, node_size: int = NODE) -> int:
    """Bytes one rank sends to the other nodes for one step's gradients (MODEL's units)."""
    numels, bits = n09_nodes.unit_numels(n09_nodes.MODEL, world_size), WAYS[way]
    if bits is None:  # a chunk of 4p/N to each of the N - k ranks of other nodes
        return sum((world_size - node_size) * 4 * p // world_size for p in numels.values())
    return sum(theory.qgz_sent_bytes(p, world_size, node_size, bits)[1] for p in numels.values())


@dataclass
class QgzLesson:
    """What the 4-rank launch measures, on one rank."""

    gradients: Gradients
    traffic: dict[str, n09_nodes.Traffic]  # per n09_nodes.QGZ_VARIANTS: one training step
    curves: dict[str, list[float]]  # way -> this rank's loss at every step


def qgz_lesson(curve_steps: int = n09_nodes.CURVE_STEPS) -> QgzLesson:
    """The gradients each way, a step of each of QGZ_VARIANTS, then ZeRO-3 trained
    `curve_steps` steps with each way."""
    measured = gradients()
    traffic = {v: n09_nodes.measure_traffic(v) for v in n09_nodes.QGZ_VARIANTS}
    curves = {way: n09_nodes.loss_curve(False, curve_steps, **(
        {"quantize_grads": f"int{bits}", "node_size": NODE} if bits else {}))
        for way, bits in WAYS.items()}
    return QgzLesson(measured, traffic, curves)


def bytes_table(runs: list[QgzLesson]) -> list[str]:
    """Per way, bytes a rank sends to the other node for one step's gradients (mean over the
    ranks): the formula, the measurement, and both as a fraction of fp32's, beside the paper's."""
    measured = {way: sum(r.gradients.across[way] for r in runs) / len(runs) for way in WAYS}
    rows = [f"{'':9}{'formula':>12}{'measured':>12}{'- formula':>11}"
            f"{'x fp32':>8}{'paper':>7}"]
    for way in WAYS:
        formula = formula_across(way, len(runs))
        paper = f"{PAPER[way]:7.3f}" if way in PAPER else f"{'-':>7}"
        rows.append(f"{way:9}{formula:>10,} B{measured[way]:>10,.0f} B"
                    f"{measured[way] - formula:>9,.0f} B{measured[way] / measured['fp32']:8.3f}"
                    f"{paper}")
    return rows


def final_losses(runs: list[QgzLesson], last: int = LAST) -> dict[str, float]:
    """Per way: the loss on the global batch, averaged over the last `last` steps."""
    curves = {way: n09_nodes.mean_curve([r.curves[way] for r in runs]) for way in WAYS}
    return {way: sum(curve[-last:]) / len(curve[-last:]) for way, curve in curves.items()}


def drift_table(runs: list[QgzLesson], last: int = LAST) -> list[str]:
    """Per way: steps, the final loss (`final_losses`), and its drift from fp32's, in %."""
    final, steps = final_losses(runs, last), len(runs[0].curves["fp32"])
    rows = [f"{'':9}{'steps':>6}{f'final loss (last {last})':>24}{'drift':>9}"]
    for way, loss in final.items():
        rows.append(f"{way:9}{steps:>6}{loss:>24.4f}"
                    f"{100 * (loss - final['fp32']) / final['fp32']:>+8.2f}%")
    return rows


# ---- notebook 09: one launch, and the tables that join qgZ's steps to the other variants -------


def notebook_lesson(curve_steps: int = n09_nodes.CURVE_STEPS
                    ) -> tuple[n09_nodes.NodesLesson, QgzLesson, schematics.Mesh]:
    """Notebook 09's one 4-rank launch: n09_nodes.nodes_lesson and qgz_lesson, each as it
    measures alone, except that ZeRO-3's fp32 loss curve is trained once for both (the same
    run, deterministic on a CPU): four curves of `curve_steps` steps instead of five. And the
    groups of one HSDP step, for the notebook's figure (schematics.hsdp_mesh)."""
    mesh = schematics.hsdp_mesh(NODE)
    nodes = n09_nodes.nodes_lesson(curve_steps=0)
    qgz = qgz_lesson(curve_steps)
    nodes.curves = {"fp32": qgz.curves["fp32"], "int8": n09_nodes.loss_curve(True, curve_steps)}
    return nodes, qgz, mesh


def formula_inside(way: str, world_size: int = 4, node_size: int = NODE) -> int:
    """Bytes one rank sends inside its node for one step's gradients (MODEL's units)."""
    numels, bits = n09_nodes.unit_numels(n09_nodes.MODEL, world_size), WAYS[way]
    if bits is None:  # a chunk of 4p/N to each of the k - 1 other ranks of its node
        return sum((node_size - 1) * 4 * p // world_size for p in numels.values())
    return sum(theory.qgz_sent_bytes(p, world_size, node_size, bits)[0] for p in numels.values())


def peer_table(runs: list[QgzLesson], rank: int = 0) -> list[str]:
    """One rank, one backward's gradients each way: bytes to each peer (* = another node), and
    its totals inside its node and to the other node against their formulas."""
    sent, world_size = runs[rank].gradients.to, len(runs)
    peers = [p for p in range(world_size) if p != rank]
    mark = {p: "*" if p // NODE != rank // NODE else " " for p in peers}
    rows = [f"{'':9}" + "".join(f"{mark[p] + 'to ' + str(p):>9}" for p in peers)
            + f" |{'inside':>9}{'formula':>9} |{'across':>9}{'formula':>9}"]
    for way in WAYS:
        to = sent[way]
        inside = sum(b for p, b in to.items() if mark[p] == " ")
        rows.append(f"{way:9}" + "".join(f"{to.get(p, 0):>9,}" for p in peers)
                    + f" |{inside:>9,}{formula_inside(way, world_size):>9,}"
                    f" |{runs[rank].gradients.across[way]:>9,}"
                    f"{formula_across(way, world_size):>9,}")
    return rows


# The paper's cross-node count per step (M = Ψ 16-bit values) by phase, qgZ alone included.
PAPER_STEPS = {**n09_nodes.PAPER, "qgZ": (1.0, 1.0, 0.25)}
STEP_VARIANTS = [*n09_nodes.VARIANTS, *n09_nodes.QGZ_VARIANTS]  # every measured step


@dataclass
class Steps:
    """One rank's measured training steps, every variant of STEP_VARIANTS."""

    traffic: dict[str, n09_nodes.Traffic]


def all_steps(runs: list[n09_nodes.NodesLesson], qgz_runs: list[QgzLesson]) -> list[Steps]:
    """Per rank, the steps nodes_lesson measured and qgz_lesson's, in one table's input."""
    return [Steps({**n.traffic, **q.traffic}) for n, q in zip(runs, qgz_runs)]


def traffic_table(steps: list[Steps]) -> list[str]:
    """n09_nodes.traffic_table over every variant, qgZ alone and ZeRO++ whole included."""
    return n09_nodes.traffic_table(steps, STEP_VARIANTS, PAPER_STEPS)


def curve_drift(curves: dict[str, list[float]], last: int = LAST) -> list[str]:
    """Per named loss curve (the first is the reference): steps, the mean loss over the last
    `last` steps, its drift from the reference's in %, and the largest difference at any step.
    Rounded to what reads the same on any machine: the ranks' torch threads follow the cores,
    and a curve's steps carry a different summation order into the third decimal."""
    reference = next(iter(curves.values()))
    ref_end = sum(reference[-last:]) / len(reference[-last:])
    rows = [f"{'':22}{'steps':>6}{f'final (last {last})':>18}{'drift':>8}{'max |diff|':>12}"]
    for name, curve in curves.items():
        end = sum(curve[-last:]) / len(curve[-last:])
        worst = max(abs(a - b) for a, b in zip(curve, reference))
        rows.append(f"{name:22}{len(curve):>6}{end:>18.2f}{100 * (end - ref_end) / ref_end:>+7.1f}%"
                    f"{worst:>12.2f}")
    return rows
