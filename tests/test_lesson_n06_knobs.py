"""Notebook 06's FSDP2 knobs beside zerolab's (zerolab.lessons.n06_fsdp2.knobs, 4 ranks as 2
"nodes" of 2, the course GPT), ZeRO-3's reshard_after_forward against the single-process
reference, DDP's gradient buckets as copies or views (16Ψ against 20Ψ), and clipping by global
norm against torch's clip_grad_norm_ (2 ranks)."""

from __future__ import annotations

import statistics

import pytest
import torch
from workers import engines as W
from workers import knobs as K

import zerolab
from zerolab.harness import max_diff
from zerolab.lessons import n06_fsdp2

UNITS = K.KNOB_MODEL.n_layer + 1  # blocks and the root
KIND = "gpt4"  # 4 blocks: at 4 ranks, ZeRO-3 never holds every unit at once


@pytest.fixture(scope="module")
def at4():
    return zerolab.launch(K.knobs_and_reshard, 4, args=(KIND,), timeout=900)


def test_fsdp2_gathers_per_step_follow_its_knobs(at4):
    knobs = at4[0]["knobs"]
    # The root kept gathered (FSDP2's default): every unit in forward, the blocks in backward.
    assert knobs["FSDP2 defaults"].gathers == UNITS + K.KNOB_MODEL.n_layer
    assert knobs["FSDP2 root resharded too"].gathers == 2 * UNITS
    assert knobs["FSDP2 reshard_after_forward=False"].gathers == UNITS
    assert knobs["zerolab ZeRO-3"].gathers == UNITS + K.KNOB_MODEL.n_layer  # root kept, too
    assert knobs["zerolab ZeRO-3 reshard_after_forward=False"].gathers == UNITS


def test_keeping_units_gathered_holds_the_whole_model_at_the_peak(at4):
    model_bytes = 4 * sum(p.numel() for p in W.build_model(KIND).parameters())
    for r in at4:
        knobs = r["knobs"]
        for label in ("FSDP2 reshard_after_forward=False",
                      "zerolab ZeRO-3 reshard_after_forward=False"):
            assert knobs[label].memory["params"] >= model_bytes, label
        assert knobs["zerolab ZeRO-3"].memory["params"] < knobs[
            "zerolab ZeRO-3 reshard_after_forward=False"].memory["params"]


def test_hpz_keeps_the_backward_gathers_inside_the_node(at4):
    across = [sum(r["knobs"][label].across for r in at4) for label in (
        "zerolab ZeRO-3", "zerolab ZeRO++ hpZ (secondary_shard_size=2)")]
    assert across[1] < across[0]


def test_cpu_offload_with_pinned_memory_needs_an_accelerator(at4):
    error = at4[0]["knobs"]["FSDP2 CPUOffloadPolicy()"].error
    # the same words whichever torch build (CPU, or CUDA on a machine without a GPU) ran it
    assert error == ("RuntimeError: Cannot access accelerator device when none is available. "
                     "(no accelerator to pin memory for)")
    table = n06_fsdp2.knob_table([r["knobs"] for r in at4])
    assert any("CPUOffloadPolicy()" in row and "accelerator" in row for row in table)
    assert all(k.ratio is None or k.ratio > 0 for k in at4[0]["knobs"].values())


def test_every_knob_that_runs_is_timed_against_its_default(at4):
    per_rank = [r["knobs"] for r in at4]
    defaults = {"FSDP2 defaults", "zerolab ZeRO-3"}
    for label, k in per_rank[0].items():
        timed = not k.error and label not in defaults
        assert all((r[label].ratio is not None) == timed for r in per_rank), label
    rows = n06_fsdp2.knob_times(per_rank)
    assert len(rows) == 1 + sum(not k.error for k in per_rank[0].values())
    for row in rows[1:]:
        label = row[:46].strip()
        if label in defaults:
            assert row.endswith("(the default)")
            continue
        ratios = sorted(r[label].ratio for r in per_rank)
        expected = (statistics.median(ratios), ratios[0], ratios[-1])  # 4 ranks: 2 middles
        assert row[46:].replace(" to ", " ").split() == [f"{x:.2f}" for x in expected], row
    assert "time" not in n06_fsdp2.knob_table(per_rank)[0]  # the times: knob_times only


def test_reshard_after_forward_false_trains_as_zero3_does(at4):
    reference = W.reference_run(KIND)
    for r in at4:
        default, kept = r["reshard"][True], r["reshard"][False]
        assert all(torch.equal(kept["state"][k], default["state"][k]) for k in default["state"])
        assert max_diff(kept["state"], reference) < 1e-4  # ZeRO-3's own distance (test_engines)
        assert kept["gathers"] == default["units"]  # forward only
        # forward, and again in backward but for the root (kept gathered in between)
        assert default["gathers"] == 2 * default["units"] - 1
        assert kept["max_params"] > default["max_params"]


@pytest.fixture(scope="module")
def at2():
    return zerolab.launch(K.buckets_and_clipping, 2, timeout=600)


def test_ddp_bucket_copies_cost_4_more_bytes_per_parameter(at2):
    for r in at2:
        views = r["buckets"]
        psi = views[True].num_params
        for view, extra in ((False, 4), (True, 0)):
            held = views[view].held
            assert held["params"] == held["grads"] == 4 * psi
            assert 8 * psi < held["optimizer"] <= 8 * psi + 4 * 64  # + step counters
            assert extra * psi <= held["other"] <= extra * psi + 2**12, view  # the buckets
        sizes = views[True].bucket_sizes
        assert sizes[0] == [4 * psi]  # one bucket at first (25 MiB cap)
        rebuilt = views[True].rebuilt_at
        assert rebuilt is not None and sum(sizes[rebuilt]) == 4 * psi
        assert sizes[rebuilt][0] <= 2**20 + 4 * 128 * 128  # DDP's first bucket: 1 MiB cap


def test_clipping_across_shards_matches_torch_clip_grad_norm(at2):
    for r in at2:
        clip = r["clipping"]
        reference = clip.norms["reference"]
        for name, norms in clip.norms.items():
            assert norms == pytest.approx(reference, rel=1e-6), name
            assert max_diff(clip.full[name], clip.full["reference"]) < 1e-5, name
        assert clip.collectives["ddp"] == []  # every rank holds the whole gradient
        for name in ("zero1", "zero2", "zero3"):  # one scalar: the sum of squares
            assert clip.collectives[name] == [("all_reduce", 4)], name


def test_no_accelerator_reads_the_same_in_either_torch_build():
    """torch's CPU build and its CUDA build on a machine without a GPU refuse pinned memory in
    other words; the notebook's compared output must not depend on which build is installed."""
    said = {n06_fsdp2._said(RuntimeError(m + ". Please check ..."))
            for m in n06_fsdp2.NO_ACCELERATOR}
    assert said == {"RuntimeError: Cannot access accelerator device when none is available. "
                    "(no accelerator to pin memory for)"}
    assert n06_fsdp2._said(ValueError("other")) == "ValueError: other"
