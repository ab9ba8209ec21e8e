"""Notebook 09's measurements (zerolab.lessons.n09_nodes) against their formulas.

One launch of 4 ranks as 2 "nodes" of 2 runs the lesson with short loss curves: the bytes each
variant sends to the other node against `lesson.formula` (and HSDP's against 2(R-1)/R · 4Ψ/k),
which links a world-wide collective uses, HSDP's memory and its distance to DDP, hpZ's secondary
shards, HSDP's refusal of nodes that do not divide the world. (Notebook 09b's models born
sharded and checkpoints: test_lesson_n09_saves.py.)
"""

from __future__ import annotations

import pytest
import torch

import zerolab
from zerolab import theory
from zerolab.grading.check import load_module
from zerolab.grading.defaults import SOLUTIONS_DIR
from zerolab.lessons import n09_nodes as lesson
from zerolab.models import GPT, num_params

N, K = 4, lesson.NODE
PSI = num_params(GPT(lesson.MODEL))
CURVE_STEPS = 12
GLOO_HEADERS = 1024  # at most, per collective that crosses: gloo's own bytes (measured ~600)


@pytest.fixture(scope="module")
def runs() -> list[lesson.NodesLesson]:
    return zerolab.launch(lesson.nodes_lesson, N, args=(CURVE_STEPS,), timeout=900)


@pytest.fixture(scope="module")
def solutions():
    return load_module(SOLUTIONS_DIR / "ex09_nodes.py")


def crossing_calls(run: lesson.NodesLesson, variant: str) -> int:
    """Collectives of the measured step whose group spans both nodes."""
    return sum(1 for e in run.traffic[variant].log.events
               if len({r // K for r in e.group_ranks}) > 1)


def test_every_variant_sends_its_formula_across(runs):
    numels = lesson.unit_numels()
    for variant in lesson.VARIANTS:
        formula = sum(lesson.formula(variant, numels).values())
        measured = lesson.across_mean(runs, variant)
        headers = GLOO_HEADERS * crossing_calls(runs[0], variant)
        assert formula <= measured <= formula + headers, variant


def test_hsdp_sends_only_the_replicas_all_reduce_across(runs):
    formula = theory.ring_sent_bytes("all_reduce", 4 * PSI / K, N // K)  # 2(R-1)/R · 4Ψ/k
    for rank, r in enumerate(runs):
        t = r.traffic["HSDP"]
        crossing = [e for e in t.log.events if len({g // K for g in e.group_ranks}) > 1]
        assert crossing and all(e.tag.endswith(".replicas") for e in crossing)
        assert all(e.group_ranks == (rank % K, rank % K + K) for e in crossing)
        assert formula <= t.across <= formula + GLOO_HEADERS * len(crossing)


def test_world_collectives_cross_as_gloo_routes_them(runs):
    for op, share in (("all_gather", lesson.GATHER_SHARE),
                      ("reduce_scatter", lesson.REDUCE_SCATTER_SHARE),
                      ("all_reduce", lesson.ALL_REDUCE_SHARE)):
        assert lesson.share_across([r.world[op] for r in runs]) == pytest.approx(share, abs=0.01)
    # the reduce-scatter sends every other rank one chunk: the same bytes to each peer
    for r in runs:
        sent = r.world["reduce_scatter"]
        assert len(sent) == N - 1 and max(sent.values()) <= min(sent.values()) * 1.05
    # the all-reduce's ring runs downwards: ranks 0 and 2 send theirs to the other node
    for rank, r in enumerate(runs):
        biggest = max(r.world["all_reduce"], key=r.world["all_reduce"].get)
        assert biggest == (rank - 1) % N


def test_hsdp_holds_16_psi_over_k_and_trains_like_ddp(runs):
    for r in runs:
        held = r.traffic["HSDP"].held
        assert held["params"] == held["grads"] == 4 * PSI // K
        assert 0 <= held["optimizer"] - 8 * PSI // K <= 4 * len(lesson.unit_numels())
        assert r.hsdp_vs_ddp < 1e-6 and r.zero3_vs_ddp < 1e-6


def test_hpz_holds_a_secondary_shard_and_gathers_backward_in_the_node(runs):
    """Of every unit but the root, which stays gathered from forward to backward (zero3.py)."""
    secondary = 4 * (PSI - lesson.unit_numels()["root"]) // K
    for rank, r in enumerate(runs):
        hpz, zero3 = r.traffic["hpZ"], r.traffic["ZeRO-3"]
        assert hpz.secondary_bytes == secondary
        assert hpz.max_params - zero3.max_params == secondary
        backward = [e for e in hpz.log.events if e.op == "all_gather" and "/bwd/" in e.tag]
        node = tuple(range(rank // K * K, rank // K * K + K))
        assert backward and all(e.group_ranks == node for e in backward)


def test_loss_curves_start_equal_and_go_down(runs):
    fp32 = lesson.mean_curve([r.curves["fp32"] for r in runs])
    int8 = lesson.mean_curve([r.curves["int8"] for r in runs])
    assert len(fp32) == len(int8) == CURVE_STEPS
    assert fp32[0] == pytest.approx(int8[0], abs=1e-3)  # int8 weights: a tiny change
    assert fp32[-1] < fp32[0] - 0.3 and int8[-1] < int8[0] - 0.3


def test_hsdp_refuses_a_world_that_does_not_split_into_nodes(runs):
    assert all(r.refused.startswith(f"{N} ranks do not split into nodes of {K + 1}")
               for r in runs)


def test_block_errors_stay_within_max_over_254():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    x[400] = 50.0
    x[768:] = 0.0
    for block in (1, 64, 256, 1000):
        worst, bound = lesson.block_errors(x, block)
        assert (worst <= bound * (1 + 1e-6)).all()
        assert worst.shape == bound.shape == (-(-1000 // block),)
    assert theory.int8_bytes(16384) == 16384 + 4 * 64


def test_solution_9_1_is_the_paper_count_and_hsdp_the_measured(runs, solutions):
    hsdp = solutions.inter_node_bytes(PSI, N, K, "HSDP")
    assert hsdp == theory.ring_sent_bytes("all_reduce", 4 * PSI / K, N // K)
    assert lesson.across_mean(runs, "HSDP") == pytest.approx(hsdp, rel=0.02)
    zero3 = solutions.inter_node_bytes(PSI, N, K, "ZeRO-3")
    assert zero3 == theory.comm_volume(PSI, N, "ZeRO-3").ring_sent_bytes
    assert lesson.across_mean(runs, "ZeRO-3") < zero3  # gloo's routes: only part crosses
    assert solutions.inter_node_bytes(PSI, N, N, "ZeRO-3") == 0.0


def test_solutions_9_2_and_9_3_are_zerolabs_quantiser(solutions):
    from zerolab.parts.quantize import dequantize_int8, quantize_int8

    x = torch.randn(777, generator=torch.Generator().manual_seed(1))
    x[256:512] = 0.0
    for block in (1, 64, 256):
        q, scales = solutions.quantize_int8(x, block)
        ref_q, ref_scales = quantize_int8(x, block)
        assert torch.equal(q, ref_q) and torch.equal(scales, ref_scales)
        assert torch.equal(solutions.dequantize_int8(q, scales, block),
                           dequantize_int8(q, scales, block))
