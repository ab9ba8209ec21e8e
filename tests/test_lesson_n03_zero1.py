"""Notebook 03's measurements (zerolab.lessons.n03_zero1) on 4 ranks: ZeRO-1 and its all-reduce
variant against DDP (the same model, 8Ψ/N optimizer bytes, 2Ψ or 3Ψ sent), their schedules,
and gradient accumulation.

The ranks' results come from a launch shared with lessons 00 and 02's tests (conftest.py:
lessons_00_03_at_4).
"""

from __future__ import annotations

from zerolab import theory
from zerolab.harness import max_diff
from zerolab.lessons import n03_zero1

PSI = 28_032  # zerolab.models.GPT(): Ψ, every parameter trainable, one tied weight
PARAM_TENSORS = 28
STAGES = n03_zero1.COMPARED  # harness names; theory reads them as its stage names


def test_zero1_lesson_compares_ddp_zero1_and_the_naive_version():
    assert [theory.stage_name(s) for s in STAGES] == ["DDP", "ZeRO-1", theory.ALL_REDUCE_ZERO1]


def test_zero1_and_naive_train_the_same_model_as_ddp(lessons_00_03_at_4):
    single = lessons_00_03_at_4[0]["zero1"].stages[1]["ddp"].state
    for r in lessons_00_03_at_4:
        rank = r["first"].rank
        for n in (1, 2, 4):
            runs = r["zero1"].stages[n]
            assert list(runs) == list(STAGES)
            for stage in STAGES:
                assert runs[stage].group == list(range(rank // n * n, rank // n * n + n))
                # the same sums in the same order, but ZeRO-1's reduce-scatter at N = 4 (it
                # adds the ranks' chunks in another order than DDP's ring all-reduce)
                exact = n <= 2 or stage != "zero1"
                diff = max_diff(runs[stage].state, runs["ddp"].state)
                assert diff == 0 if exact else 0 < diff <= 1e-5, (n, stage, diff)
                assert max_diff(runs[stage].state, single) <= 1e-5, (n, stage)


def test_zero1_optimizer_bytes_are_8_psi_over_n(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        for n in (1, 2, 4):
            runs = r["zero1"].stages[n]
            assert runs["ddp"].held == {"params": 4 * PSI, "grads": 4 * PSI,
                                        "optimizer": 8 * PSI + 4 * PARAM_TENSORS}
            for stage in ("zero1", "zero1_all_reduce"):
                assert runs[stage].layouts == [(PSI, PSI)]  # one bucket, no padding
                assert runs[stage].held == {"params": 4 * PSI, "grads": 4 * PSI,
                                            "optimizer": 8 * PSI // n + 4}
                total = sum(runs[stage].held.values())
                assert total - 4 == theory.model_state_memory(PSI, n, "ZeRO-1").total


def test_zero1_sends_2_psi_and_the_naive_version_3_psi(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        for n in (1, 2, 4):
            runs = r["zero1"].stages[n]
            for stage in STAGES:
                expected = theory.comm_volume(PSI, n, stage).ring_sent_bytes
                assert runs[stage].log.total_ring_bytes() == expected, (n, stage)
            ops = {s: set(runs[s].log.bytes_by_op()) for s in STAGES}
            if n > 1:
                assert ops == {"ddp": {"all_reduce"},
                               "zero1": {"reduce_scatter", "all_gather"},
                               "zero1_all_reduce": {"all_reduce", "all_gather"}}
        runs = r["zero1"].stages[4]
        all_reduce, zero1 = runs["zero1_all_reduce"].log, runs["zero1"].log
        assert all_reduce.total_ring_bytes() * 2 == zero1.total_ring_bytes() * 3


def _spans(log, name):
    return [s for s in log.spans if s.name == name]


def test_paper_schedule_runs_both_collectives_inside_step(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        run = r["zero1"].schedules["zero1_after_backward"]
        backwards, steps = _spans(run.log, "backward"), _spans(run.log, "step")
        assert len(steps) == 2 and run.buckets == 4
        assert [e.op for e in run.log.events] == (
            ["reduce_scatter"] * 4 + ["all_gather"] * 4) * 2
        for k, events in enumerate((run.log.events[:8], run.log.events[8:])):
            assert all(backwards[k].end <= e.start and e.end <= steps[k].end for e in events)


def test_zero1_reduces_during_backward_and_gathers_into_the_next_forward(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        run = r["zero1"].schedules["zero1"]
        backwards, forwards = _spans(run.log, "backward"), _spans(run.log, "forward")
        first = run.log.events[:8]  # the first recorded step's 4 reduce-scatters, 4 gathers
        assert [e.op for e in first] == ["reduce_scatter"] * 4 + ["all_gather"] * 4
        assert all(e.start < backwards[0].end for e in first[:4])
        assert all(forwards[1].start <= e.end <= forwards[1].end for e in first[4:])


def test_both_schedules_send_the_same_bytes(lessons_00_03_at_4):
    q = 4 * PSI * 3 // 4  # one pass over the model at N = 4, ring model
    for r in lessons_00_03_at_4:
        logs = [r["zero1"].schedules[name].log for name in n03_zero1.SCHEDULES]
        assert logs[0].bytes_by_op() == logs[1].bytes_by_op() == {
            "reduce_scatter": 2 * q, "all_gather": 2 * q}  # two steps


def test_accumulation_trades_bytes_against_gradient_memory(lessons_00_03_at_4):
    q, m = 4 * PSI * 3 // 4, n03_zero1.MICRO_BATCHES  # one pass over the model at N = 4
    for r in lessons_00_03_at_4:
        runs = {(a.engine, a.no_sync): a for a in r["zero1"].accumulation}
        assert list(runs) == list(n03_zero1.ACCUMULATION)
        assert runs["zero1", True].log.total_ring_bytes() == 2 * q
        assert runs["zero2", True].log.total_ring_bytes() == 2 * q
        assert runs["zero2", False].log.bytes_by_op() == {"reduce_scatter": m * q,
                                                         "all_gather": q}
        assert runs["zero1", True].peak_grads == 4 * PSI
        assert runs["zero2", True].peak_grads == 4 * PSI + PSI  # full grads + the 4Ψ/N shard
        assert PSI < runs["zero2", False].peak_grads < 4 * PSI
        assert runs["zero2", False].held["grads"] == PSI
        for a in runs.values():
            assert max_diff(a.state, runs["zero1", True].state) <= 1e-5
            # zerolab's reduce-scatter and all-gather send the ring figure, plus headers
            ring = a.log.total_ring_bytes()
            assert ring <= a.log.total_wire_bytes() <= 1.05 * ring


def test_zero1_wire_bytes_are_the_ring_figures(lessons_00_03_at_4):
    for r in lessons_00_03_at_4:
        log = r["zero1"].stages[4]["zero1"].log
        wire, ring = log.wire_bytes_by_op(), log.bytes_by_op()
        assert 1 <= wire["reduce_scatter"] / ring["reduce_scatter"] < 1.03
        assert 1 <= wire["all_gather"] / ring["all_gather"] < 1.03
