"""Notebook 05's measurements (zerolab.lessons.n05_zero3) on 2 ranks, against the formulas:
ZeRO-3 with and without prefetch, its parameter peaks, the bytes it sends against ZeRO-2's,
and a working set that does not grow with depth.

The ranks' results come from a launch shared with lessons 04, 06 and 07's tests (conftest.py:
lessons_04_07_at_2), on a smaller model than the notebook uses.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from workers.lessons import GPT05, hand_made_log, psi
from workers.lessons import WORLD_04_07 as N

from zerolab import theory
from zerolab.comm import CommLog, Span
from zerolab.lessons import n05_zero3


def test_zero3_at_rest_is_16psi_over_n_plus_step_counters(lessons_04_07_at_2):
    p = psi(GPT05)
    for r in lessons_04_07_at_2:
        run = r["n05"].no_prefetch
        assert r["n05"].num_params == p and run.full_param_bytes == 4 * p
        n_units = len(run.unit_bytes)
        assert n_units == GPT05.n_layer + 1 and list(run.unit_bytes)[-1] == "root"
        formula = theory.model_state_memory(run.padded_numel, N, "ZeRO-3")
        assert run.shard_bytes == formula.params
        assert sum(run.step.held.values()) == formula.total + 4 * n_units


def test_zero3_parameter_peaks_stay_within_shards_plus_units(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        on, off = r["n05"].prefetch, r["n05"].no_prefetch
        shards, root = off.shard_bytes, off.unit_bytes["root"]
        block = max(b for name, b in off.unit_bytes.items() if name != "root")
        peak_on = on.step.memory.max_by_category["params"]
        assert off.step.memory.max_by_category["params"] == shards + root + block
        assert shards + root + block <= peak_on <= shards + root + 2 * block
        assert peak_on < on.full_param_bytes
        assert r["n05"].same_weights


def test_zero3_gathers_twice_and_sends_3psi_against_zero2s_2psi(lessons_04_07_at_2):
    """3Ψ less the root's backward gather: the root stays gathered from forward to backward."""
    r05 = lessons_04_07_at_2[0]["n05"]
    off = r05.no_prefetch
    padded, root = off.padded_numel, off.unit_bytes["root"] // 4
    one_pass = theory.ring_sent_bytes("all_gather", 4 * padded, N)
    assert n05_zero3.bytes_by_phase(off.step.log) == {
        "fwd all_gather": one_pass,
        "bwd all_gather": theory.ring_sent_bytes("all_gather", 4 * (padded - root), N),
        "bwd reduce_scatter": one_pass}
    assert off.step.log.total_ring_bytes() == theory.comm_volume(
        padded, N, "ZeRO-3", root_numel=root).ring_sent_bytes
    assert r05.zero2_log.total_ring_bytes() == theory.comm_volume(padded, N, "ZeRO-2"
                                                                  ).ring_sent_bytes
    blocks = [f"blocks.{i}" for i in range(GPT05.n_layer)]
    assert n05_zero3.gathers_by_phase(off.step.log) == {
        "fwd": ["root", *blocks], "bwd": list(reversed(blocks))}


def test_zero3_prefetch_issues_gathers_ahead_and_overlaps_compute(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        on, off = r["n05"].prefetch, r["n05"].no_prefetch
        assert n05_zero3.issued_ahead(on.step.log) == 2 * GPT05.n_layer
        assert n05_zero3.issued_ahead(off.step.log) == 0
        assert n05_zero3.overlapped_gathers(on.timeline) == GPT05.n_layer - 1
        assert n05_zero3.overlapped_gathers(off.timeline) == 0
        window = n05_zero3.forward_window(on.timeline)
        assert len(window.spans) == GPT05.n_layer  # one compute span per block
        assert all("/fwd/" in e.tag for e in window.events) and window.events


def test_zero3_working_set_does_not_grow_with_depth(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        r05 = r["n05"]
        off = r05.no_prefetch
        root = off.unit_bytes["root"]
        block = max(b for name, b in off.unit_bytes.items() if name != "root")
        assert [d.n_layer for d in r05.depths] == sorted((*n05_zero3.DEPTHS, GPT05.n_layer))
        for d in r05.depths:
            config = dataclasses.replace(GPT05, n_layer=d.n_layer)
            assert d.full_param_bytes == 4 * psi(config)
            assert d.shard_bytes * N >= d.full_param_bytes  # 4Ψ/N, + padding
            assert d.peak_param_bytes - d.shard_bytes == root + 2 * block
        ratios = [d.peak_param_bytes / d.full_param_bytes for d in r05.depths]
        assert ratios == sorted(ratios, reverse=True) and ratios[0] > 1 > ratios[-1]
        assert r05.cpu_cores >= 1 and r05.compute_threads >= 1


def test_zero3_and_zero2_wire_bytes_are_ring_times_what_gloo_ran(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        r05 = r["n05"]
        for log in (r05.no_prefetch.step.log, r05.zero2_log):
            ring = log.bytes_by_op()
            gloo = ring["all_gather"] + ring["reduce_scatter"]  # N broadcasts; send/recv pairs
            assert gloo <= log.total_wire_bytes() <= gloo + 1024 * len(log.events)  # headers


def test_block_compute_ms_is_the_median_forward_span():
    log = CommLog(rank=0, world_size=2, spans=[
        Span("forward", 0.0, 0.002), Span("forward", 0.01, 0.014), Span("forward", 0.02, 0.03),
        Span("backward", 0.03, 1.0)])
    assert n05_zero3.block_compute_ms(log) == pytest.approx(4.0)


def test_overlapped_gathers_needs_the_gather_to_span_the_previous_block():
    spans = [("forward", 1.0, 2.0), ("forward", 3.0, 4.0), ("forward", 5.0, 6.0)]
    ahead = hand_made_log([("all_gather", "zero3/fwd/blocks.1", 0.9, 2.5, True),
                           ("all_gather", "zero3/fwd/blocks.2", 2.9, 4.5, True)], spans)
    serial = hand_made_log([("all_gather", "zero3/fwd/blocks.1", 2.1, 2.9, False),
                            ("all_gather", "zero3/fwd/blocks.2", 4.1, 4.9, False)], spans)
    assert n05_zero3.overlapped_gathers(ahead) == 2
    assert n05_zero3.overlapped_gathers(serial) == 0
    assert n05_zero3.issued_ahead(ahead) == 2 and n05_zero3.issued_ahead(serial) == 0


# ---- the prefetch verdict the notebook prints instead of narrating a noisy timing ----------


def span_log(*durations_ms: float, name: str = "forward"):
    """A CommLog-shaped object with one span per block, of the given lengths."""
    spans, t = [], 0.0
    for d in durations_ms:
        spans.append(SimpleNamespace(name=name, start=t, end=t + d / 1e3))
        t += d / 1e3 + 0.001
    spans.append(SimpleNamespace(name="backward", start=t, end=t + 1.0))  # not a block
    return SimpleNamespace(spans=spans)


def test_a_clear_difference_gets_a_verdict():
    off = [span_log(1.0, 1.1, 1.2), span_log(1.05, 1.15)]
    on = [span_log(2.0, 2.1, 2.2), span_log(2.05, 2.3)]
    v = n05_zero3.compute_beside_gathers(off, on)
    assert v.verdict == "slower beside a gather" and v.slower_share == 1.0
    assert len(v.alone_ms) == 5 and len(v.beside_ms) == 5  # every rank's blocks, no backward
    assert v.alone_ms[0] == 1.0
    assert n05_zero3.compute_beside_gathers(on, off).verdict == "faster beside a gather"


def test_overlapping_samples_are_within_noise():
    off = [span_log(1.0, 2.0, 3.0, 4.0)]
    on = [span_log(1.5, 2.5, 3.5, 0.5)]
    v = n05_zero3.compute_beside_gathers(off, on)
    assert 0.1 < v.slower_share < 0.9 and v.verdict == "within noise"
    # ties count half: identical samples are neither slower nor faster
    assert n05_zero3.compute_beside_gathers(off, off).slower_share == 0.5
