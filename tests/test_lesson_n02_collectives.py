"""Notebook 02's measurements (zerolab.lessons.n02_collectives) on 4 ranks: the article's
reduce-scatter example, the ring all-gather step by step, and the bytes of every collective at
N = 2, 3 and 4 against the ring formulas and against what gloo ran.

The ranks' results come from a launch shared with lessons 00 and 03's tests (conftest.py:
lessons_00_03_at_4).
"""

from __future__ import annotations

import pytest
from workers.lessons import BYTES_NUMEL


def test_the_articles_reduce_scatter_example_is_exact(lessons_00_03_at_4):
    examples = [r["tour"].example for r in lessons_00_03_at_4[:3]]
    assert lessons_00_03_at_4[3]["tour"].example is None
    assert [s.reduce_scatter for s in examples] == [[6, 12], [14, 56], [36, 288]]
    assert examples[1].input_chunks == [[2, 4], [4, 16], [8, 64]]
    for s in examples:
        assert s.all_gather == s.all_reduce == [6, 12, 14, 56, 36, 288]
        assert s.rs_then_ag_equals_ar and s.ring_equals_torch
        assert s.ring_snapshots[-1] == [6, 12, 14, 56, 36, 288]


def test_ring_all_gather_fills_one_shard_per_step_from_the_left(lessons_00_03_at_4):
    examples = [r["tour"].example for r in lessons_00_03_at_4[:3]]
    for rank, s in enumerate(examples):
        for step, snapshot in enumerate(s.ring_snapshots):
            held = {j for j in range(3) if snapshot[2 * j] is not None}
            assert held == {(rank - i) % 3 for i in range(step + 1)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_per_rank_match_the_ring_formulas(lessons_00_03_at_4, n):
    s = 4 * BYTES_NUMEL
    passes = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "rs+ag": 2,
              "ring all_gather": 1}
    ranks = [r for r in lessons_00_03_at_4 if n in r["tour"].bytes]
    assert len(ranks) == n
    for r in ranks:
        logs = r["tour"].bytes[n]
        assert logs["all_reduce"].events[0].nbytes == s
        for op, k in passes.items():
            assert logs[op].total_ring_bytes() == k * (n - 1) * s // n, op
        ring = logs["ring all_gather"]
        assert [e.op for e in ring.events] == ["send", "recv"] * (n - 1) or \
            [e.op for e in ring.events] == ["recv", "send"] * (n - 1)
        assert sum(e.nbytes for e in ring.events if e.op == "send") == (n - 1) * s // n


@pytest.mark.parametrize("n", [2, 3, 4])
def test_wire_bytes_match_what_ran(lessons_00_03_at_4, n):
    s = 4 * BYTES_NUMEL
    ran_as = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "rs+ag": 2,
              "ring all_gather": 1}  # zerolab's reduce-scatter: N-1 send/recv pairs
    pairs = "1 send/recv pair" if n == 2 else f"{n - 1} send/recv pairs"
    for r in (r for r in lessons_00_03_at_4 if n in r["tour"].bytes):
        logs = r["tour"].bytes[n]
        assert {e.impl for e in logs["reduce_scatter"].events} == {
            f"reduce_scatter as {pairs} (gloo)"}
        assert {e.impl for e in logs["all_gather"].events} == {
            f"all_gather as {n} broadcasts (gloo)"}
        for op, k in ran_as.items():
            assert 1 <= logs[op].total_wire_bytes() / (k * (n - 1) * s / n) < 1.03, op
        # torch's own gloo reduce-scatter all-reduces a copy: twice the ring figure
        assert 1 <= r["tour"].torch_reduce_scatter[n] / (2 * (n - 1) * s / n) < 1.03


def test_reduce_scatters_are_timed_in_turns(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        times = r["tour"].reduce_scatter_s
        assert sorted(times) == ["torch", "zerolab"]
        assert all(len(ts) == 10 and all(t > 0 for t in ts) for ts in times.values())


def test_timeline_log_has_three_phases_and_every_call(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        log = r["tour"].timeline
        assert [sp.name for sp in log.spans] == [
            "phase 1: all-reduce", "phase 2: RS + AG", "phase 3: ring AG"]
        assert len(log.events) == 3 + 2 * 3
        assert all(e.end is not None and e.end >= e.start for e in log.events)
