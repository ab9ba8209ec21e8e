"""Notebook 09's measurements (zerolab.lessons.n09_nodes) against their formulas.

One launch of 4 ranks as 2 "nodes" of 2 runs the lesson with short loss curves: the bytes each
variant sends to the other node against `lesson.formula` (and HSDP's against 2(R-1)/R · 4Ψ/k),
which links a world-wide collective uses, HSDP's memory and its distance to DDP, hpZ's secondary
shards, the construction of a model born sharded, and a checkpoint saved for the resumes. The
resume at 2 ranks and the crash mid-save have a launch each; the rest runs in this process.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import zerolab
from zerolab import checkpoint, theory
from zerolab.grading.check import _load_module
from zerolab.grading.defaults import SOLUTIONS_DIR
from zerolab.harness import max_diff
from zerolab.lessons import n09_nodes as lesson
from zerolab.models import GPT, num_params

N, K = 4, lesson.NODE
PSI = num_params(GPT(lesson.MODEL))
CURVE_STEPS = 12
GLOO_HEADERS = 1024  # at most, per collective that crosses: gloo's own bytes (measured ~600)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpt") / "ckpt")


@pytest.fixture(scope="module")
def runs(folder) -> list[lesson.NodesLesson]:
    return zerolab.launch(lesson.nodes_lesson, N, args=(folder, CURVE_STEPS), timeout=900)


@pytest.fixture(scope="module")
def solutions():
    return _load_module(SOLUTIONS_DIR / "ex09_nodes.py")


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


def test_born_sharded_peaks_at_the_kept_shards_plus_one_unit(runs):
    for built in [r.construction for r in runs] + [lesson.construction()]:  # N = 4, and 1 here
        kept = sum(built.kept.values())
        assert built.same
        assert kept == 8 * PSI // built.world_size  # param and grad shards (no padding here)
        assert built.peak_meta <= kept + built.largest_unit_bytes
        assert built.peak_full >= built.full_model_bytes + built.largest_unit_bytes
        if built.world_size > 2:
            assert built.peak_meta < built.full_model_bytes < built.peak_full


def test_loss_curves_start_equal_and_go_down(runs):
    fp32 = lesson.mean_curve([r.curves["fp32"] for r in runs])
    int8 = lesson.mean_curve([r.curves["int8"] for r in runs])
    assert len(fp32) == len(int8) == CURVE_STEPS
    assert fp32[0] == pytest.approx(int8[0], abs=1e-3)  # int8 weights: a tiny change
    assert fp32[-1] < fp32[0] - 0.3 and int8[-1] < int8[0] - 0.3


def test_the_checkpoint_holds_a_quarter_of_each_unit_per_rank(runs, folder):
    """Each rank's DCP file holds rectangles of the model's tensors: a quarter of each unit's
    elements, and as many of SGD's momentum."""
    from zerolab.units import make_units

    model = GPT(lesson.MODEL)
    names = {p: n for n, p in model.named_parameters()}
    units = {u.name: [names[p] for p in u.params] for u in make_units(model)}
    numels = lesson.unit_numels()
    for rank in range(N):
        chunks = lesson.chunks_in(folder, rank)
        for unit, params in units.items():
            for prefix, suffix in (("model.", ""), ("optimizer.state.", ".momentum_buffer")):
                held = sum(math.prod(c.sizes) for c in chunks
                           if c.key in {f"{prefix}{n}{suffix}" for n in params})
                assert held == numels[unit] // N, (rank, unit, prefix)


def test_resumed_at_2_with_zero2_continues_as_if_uninterrupted(runs, folder):
    resumed = zerolab.launch(lesson.resumed_lesson, 2, args=(folder, "zero2"), timeout=900)
    for r in resumed:
        assert max_diff(r.state, runs[0].straight) < 1e-6
        assert r.construction.same and r.refused == ""


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    folder = str(tmp_path / "ckpt")
    zerolab.launch(lesson.sgd_run, 1, args=("ZeRO-3", range(1), None, folder), timeout=300)
    crash = lesson.crash_mid_save(folder)
    assert "exited with code 1" in crash.error
    assert crash.after == ["LATEST", "LOCK", "save-000001", "save-000002"]
    assert crash.crashed_files == ["__0_0.distcp"] and crash.latest == "save-000001"
    assert crash.same_as_before
    assert os.path.basename(checkpoint.latest(folder)) == "save-000001"


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
