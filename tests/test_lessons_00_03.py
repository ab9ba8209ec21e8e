"""The measurement functions behind notebooks 00-03 (zerolab.lessons.n00..n03), on real ranks.

Every figure a notebook prints is checked here against its formula, so that a change in the
package that moves a number shows up as a failing test, not as a silently different notebook.
Launching ranks costs seconds: one launch per world size runs every lesson at that size (the
combined workers below; spawned ranks import them from this module).
"""

from __future__ import annotations

import pytest
import torch

import zerolab
from zerolab import theory
from zerolab.harness import max_diff
from zerolab.lessons import n00_launch, n01_memory, n02_collectives, n03_zero1

PSI = 28_032  # zerolab.models.GPT(): Ψ, every parameter trainable, one tied weight
PARAM_TENSORS = 28
BYTES_NUMEL = 12 * 1024  # n02's bytes experiment: S = 4 * BYTES_NUMEL bytes


# ---- workers: everything at one world size, in one launch ---------------------------------------

def lessons_at_2() -> dict:
    return {"first": n00_launch.first_all_reduce(),
            "memory": n01_memory.ddp_memory()}  # the notebook's arguments


def lessons_at_4() -> dict:
    return {"first": n00_launch.first_all_reduce(),
            "groups": n00_launch.process_groups(),
            "tour": n02_collectives.collectives_tour(bytes_numel=BYTES_NUMEL,
                                                     timeline_numel=12 * 64),
            "zero1": n03_zero1.zero1_lesson()}


@pytest.fixture(scope="module")
def at2() -> list[dict]:
    return zerolab.launch(lessons_at_2, world_size=2, timeout=180)


@pytest.fixture(scope="module")
def at4() -> list[dict]:
    return zerolab.launch(lessons_at_4, world_size=4, timeout=240)


# ---- 00: launch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fixture", ["at2", "at4"])
def test_first_all_reduce_sums_and_sends_the_ring_figure(fixture, request):
    results = request.getfixturevalue(fixture)
    n = len(results)
    for rank, r in enumerate(results):
        first = r["first"]
        assert (first.rank, first.world_size) == (rank, n)
        assert first.before == [(rank + 1) * v for v in (1, 10, 100)]
        assert first.after == [n * (n + 1) // 2 * v for v in (1, 10, 100)]
        (event,) = first.log.events
        assert (event.op, event.nbytes) == ("all_reduce", 12)
        assert first.log.total_ring_bytes() == 2 * (n - 1) * 12 // n
    assert len({r["first"].pid for r in results}) == n


def test_process_groups_reduce_within_pairs(at4):
    for rank, r in enumerate(at4):
        groups = r["groups"]
        assert groups.rank == rank
        assert groups.pair == [rank - rank % 2, rank - rank % 2 + 1]
        assert groups.rank_in_pair == rank % 2
        assert groups.world_sum == 1 + 2 + 3 + 4
        assert groups.pair_sum == sum(p + 1 for p in groups.pair)


def test_fail_on_is_reported_by_rank_and_leaves_nothing_running():
    import multiprocessing

    with pytest.raises(zerolab.WorkerError) as info:
        zerolab.launch(n00_launch.fail_on, world_size=3, args=(2,))
    assert info.value.rank == 2
    assert str(info.value).splitlines()[0] == (
        "rank 2 raised ValueError: rank 2 found a NaN in its batch")
    assert multiprocessing.active_children() == []


# ---- 01: DDP memory -----------------------------------------------------------------------------

def test_ddp_model_states_are_16_psi_plus_step_counters_on_every_rank(at2):
    for r in at2:
        m = r["memory"]
        assert (m.psi, m.param_tensors) == (PSI, PARAM_TENSORS)
        assert m.fp32 == {"params": 4 * PSI, "grads": 4 * PSI,
                          "optimizer": 8 * PSI + 4 * PARAM_TENSORS}
        # bf16 mixed precision: 2 + 2 + 12 (fp32 masters, m, v): the same 16Ψ in all
        assert m.mixed == {"params": 2 * PSI, "grads": 2 * PSI,
                           "optimizer": 12 * PSI + 4 * PARAM_TENSORS}
        assert sum(m.fp32.values()) == pytest.approx(
            theory.model_state_memory(PSI, 2, "DDP").total, abs=4 * PARAM_TENSORS)


def test_ddp_ranks_hold_identical_copies(at2):
    a, b = at2[0]["memory"], at2[1]["memory"]
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert torch.equal(a.grads, b.grads)
    assert a.grads.numel() == PSI


def test_ddp_trace_shows_adam_state_born_in_the_first_step(at2):
    trace = at2[0]["memory"].trace
    first, last = trace.samples[0][1], trace.samples[-1][1]
    assert first["params"] == first["grads"] == 4 * PSI
    assert first["optimizer"] == 0
    assert last["optimizer"] == 8 * PSI + 4 * PARAM_TENSORS
    assert trace.max_by_category["other"] > 0  # activations came and went


def test_activations_grow_with_the_batch_and_model_states_do_not(at2):
    peaks = at2[0]["memory"].peaks
    assert list(peaks) == [4, 8, 16]
    states = [{k: v for k, v in p.items() if k != "other"} for p in peaks.values()]
    assert all(s == states[0] for s in states)
    other = [p["other"] for p in peaks.values()]
    # what notebook 01 prints: [1.0, 2.0, 4.0]
    assert [round(o / other[0], 1) for o in other] == [1.0, 2.0, 4.0]


# ---- 02: collectives ----------------------------------------------------------------------------

def test_the_articles_reduce_scatter_example_is_exact(at4):
    examples = [r["tour"].example for r in at4[:3]]
    assert at4[3]["tour"].example is None
    assert [s.reduce_scatter for s in examples] == [[6, 12], [14, 56], [36, 288]]
    assert examples[1].input_chunks == [[2, 4], [4, 16], [8, 64]]
    for s in examples:
        assert s.all_gather == s.all_reduce == [6, 12, 14, 56, 36, 288]
        assert s.rs_then_ag_equals_ar and s.ring_equals_torch
        assert s.ring_snapshots[-1] == [6, 12, 14, 56, 36, 288]


def test_ring_all_gather_fills_one_shard_per_step_from_the_left(at4):
    examples = [r["tour"].example for r in at4[:3]]
    for rank, s in enumerate(examples):
        for step, snapshot in enumerate(s.ring_snapshots):
            held = {j for j in range(3) if snapshot[2 * j] is not None}
            assert held == {(rank - i) % 3 for i in range(step + 1)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_bytes_per_rank_match_the_ring_formulas(at4, n):
    s = 4 * BYTES_NUMEL
    passes = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "rs+ag": 2,
              "ring all_gather": 1}
    ranks = [r for r in at4 if n in r["tour"].bytes]
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
def test_wire_bytes_match_what_ran(at4, n):
    s = 4 * BYTES_NUMEL
    ran_as = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "rs+ag": 2,
              "ring all_gather": 1}  # zerolab's reduce-scatter: N-1 send/recv pairs
    pairs = "1 send/recv pair" if n == 2 else f"{n - 1} send/recv pairs"
    for r in (r for r in at4 if n in r["tour"].bytes):
        logs = r["tour"].bytes[n]
        assert {e.impl for e in logs["reduce_scatter"].events} == {
            f"reduce_scatter as {pairs} (gloo)"}
        assert {e.impl for e in logs["all_gather"].events} == {
            f"all_gather as {n} broadcasts (gloo)"}
        for op, k in ran_as.items():
            assert 1 <= logs[op].total_wire_bytes() / (k * (n - 1) * s / n) < 1.03, op
        # torch's own gloo reduce-scatter all-reduces a copy: twice the ring figure
        assert 1 <= r["tour"].torch_reduce_scatter[n] / (2 * (n - 1) * s / n) < 1.03


def test_reduce_scatters_are_timed_in_turns(at4):
    for r in at4:
        times = r["tour"].reduce_scatter_s
        assert sorted(times) == ["torch", "zerolab"]
        assert all(len(ts) == 10 and all(t > 0 for t in ts) for ts in times.values())


def test_timeline_log_has_three_phases_and_every_call(at4):
    for r in at4:
        log = r["tour"].timeline
        assert [sp.name for sp in log.spans] == [
            "phase 1: all-reduce", "phase 2: RS + AG", "phase 3: ring AG"]
        assert len(log.events) == 3 + 2 * 3
        assert all(e.end is not None and e.end >= e.start for e in log.events)


# ---- 03: ZeRO-1 ---------------------------------------------------------------------------------

STAGES = n03_zero1.COMPARED  # harness names; theory reads them as its stage names


def test_zero1_lesson_compares_ddp_zero1_and_the_naive_version():
    assert [theory.stage_name(s) for s in STAGES] == ["DDP", "ZeRO-1", theory.ALL_REDUCE_ZERO1]


def test_zero1_and_naive_train_the_same_model_as_ddp(at4):
    single = at4[0]["zero1"].stages[1]["ddp"].state
    for r in at4:
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


def test_zero1_optimizer_bytes_are_8_psi_over_n(at4):
    for r in at4:
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


def test_zero1_sends_2_psi_and_the_naive_version_3_psi(at4):
    for r in at4:
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


def test_paper_schedule_runs_both_collectives_inside_step(at4):
    for r in at4:
        run = r["zero1"].schedules["zero1_after_backward"]
        backwards, steps = _spans(run.log, "backward"), _spans(run.log, "step")
        assert len(steps) == 2 and run.buckets == 4
        assert [e.op for e in run.log.events] == (
            ["reduce_scatter"] * 4 + ["all_gather"] * 4) * 2
        for k, events in enumerate((run.log.events[:8], run.log.events[8:])):
            assert all(backwards[k].end <= e.start and e.end <= steps[k].end for e in events)


def test_zero1_reduces_during_backward_and_gathers_into_the_next_forward(at4):
    for r in at4:
        run = r["zero1"].schedules["zero1"]
        backwards, forwards = _spans(run.log, "backward"), _spans(run.log, "forward")
        first = run.log.events[:8]  # the first recorded step's 4 reduce-scatters, 4 gathers
        assert [e.op for e in first] == ["reduce_scatter"] * 4 + ["all_gather"] * 4
        assert all(e.start < backwards[0].end for e in first[:4])
        assert all(forwards[1].start <= e.end <= forwards[1].end for e in first[4:])


def test_both_schedules_send_the_same_bytes(at4):
    q = 4 * PSI * 3 // 4  # one pass over the model at N = 4, ring model
    for r in at4:
        logs = [r["zero1"].schedules[name].log for name in n03_zero1.SCHEDULES]
        assert logs[0].bytes_by_op() == logs[1].bytes_by_op() == {
            "reduce_scatter": 2 * q, "all_gather": 2 * q}  # two steps


def test_accumulation_trades_bytes_against_gradient_memory(at4):
    q, m = 4 * PSI * 3 // 4, n03_zero1.MICRO_BATCHES  # one pass over the model at N = 4
    for r in at4:
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


def test_zero1_wire_bytes_are_the_ring_figures(at4):
    for r in at4:
        log = r["zero1"].stages[4]["zero1"].log
        wire, ring = log.wire_bytes_by_op(), log.bytes_by_op()
        assert 1 <= wire["reduce_scatter"] / ring["reduce_scatter"] < 1.03
        assert 1 <= wire["all_gather"] / ring["all_gather"] < 1.03
