"""Notebook 04's measurements (zerolab.lessons.n04_zero2) on 2 ranks, against the formulas:
ZeRO-2 hooked, ZeRO-2 reducing after backward, and ZeRO-1; memory at rest and at its peak,
buckets, bytes on the ring and on the wire, accumulation and prefetch.

The ranks' results come from a launch shared with lessons 05-07's tests (conftest.py:
lessons_04_07_at_2), on a smaller model than the notebook uses.
"""

from __future__ import annotations

from workers.lessons import BUCKET_BYTES, GPT04, hand_made_log, psi
from workers.lessons import WORLD_04_07 as N

from zerolab import theory
from zerolab.comm import CommEvent, CommLog, Span
from zerolab.lessons import n04_zero2

NAMES04 = ("zero1", "zero2_after_backward", "zero2")


def test_zero2_at_rest_is_the_formula_plus_one_step_counter_per_bucket(lessons_04_07_at_2):
    p = psi(GPT04)
    for r in lessons_04_07_at_2:
        r04 = r["n04"]
        assert r04.num_params == p and r04.full_grad_bytes == 4 * p
        n_buckets = len(r04.runs["zero2"].bucket_bytes)
        assert n_buckets >= 3  # several buckets: the hooked peak is well below the full gradient
        for key in NAMES04:
            stage = "ZeRO-1" if key == "zero1" else "ZeRO-2"
            formula = theory.model_state_memory(r04.runs[key].padded_numel, N, stage)
            held = r04.runs[key].step.held
            assert held["grads"] == formula.grads
            assert held["optimizer"] == formula.optimizer + 4 * n_buckets
            assert sum(held.values()) == formula.total + 4 * n_buckets


def test_zero2_peak_gradient_naive_holds_everything_hooked_one_bucket(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        r04 = r["n04"]
        full, shards = r04.full_grad_bytes, r04.runs["zero2"].grad_shard_bytes
        largest = max(r04.runs["zero2"].bucket_bytes)
        peaks = {k: run.step.memory.max_by_category["grads"] for k, run in r04.runs.items()}
        assert peaks["zero1"] == full
        assert peaks["zero2_after_backward"] == full + shards
        hooked = peaks["zero2"]
        assert shards < hooked <= shards + 2 * largest
        assert hooked < full


def test_zero2_variants_take_the_same_step(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        assert len({r["n04"].runs[k].loss_after for k in NAMES04}) == 1


def test_zero2_reduce_scatters_during_backward_only_when_hooked(lessons_04_07_at_2):
    runs = lessons_04_07_at_2[0]["n04"].runs
    n_buckets = len(runs["zero2"].bucket_bytes)
    hooked = n04_zero2.ops_by_phase(runs["zero2"].step.log)
    naive = n04_zero2.ops_by_phase(runs["zero2_after_backward"].step.log)
    assert hooked["backward"] == {"reduce_scatter": n_buckets}
    assert hooked["step"] == {"all_gather": n_buckets}
    assert naive["backward"] == {}
    assert naive["step"] == {"reduce_scatter": n_buckets, "all_gather": n_buckets}


def test_zero2_sends_2psi_and_phases_are_on_the_trace_clock(lessons_04_07_at_2):
    runs = lessons_04_07_at_2[0]["n04"].runs
    expected = theory.comm_volume(runs["zero2"].padded_numel, N, "ZeRO-2").ring_sent_bytes
    for key in NAMES04:
        assert runs[key].step.log.total_ring_bytes() == expected
        trace = runs[key].step.memory
        phases = runs[key].step.phases()
        assert [s.name for s in phases] == ["forward", "backward", "step"]
        starts_ends = [t for s in phases for t in (s.start, s.end)]
        assert starts_ends == sorted(starts_ends)
        last_sample = trace.samples[-1][0] - trace.samples[0][0]
        assert 0 <= starts_ends[0] and starts_ends[-1] <= last_sample + 0.05


def test_zero2_hooked_holds_about_two_buckets_of_full_gradient(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        run = r["n04"].runs["zero2"]
        largest = max(run.bucket_bytes)
        peak = run.step.memory.max_by_category
        assert 0 < peak["comm"] <= largest  # one flattened bucket in flight at a time
        assert peak["grads"] + peak["comm"] <= run.grad_shard_bytes + 2 * largest


def test_zero2_buckets_close_once_they_reach_bucket_bytes(lessons_04_07_at_2):
    run = lessons_04_07_at_2[0]["n04"].runs["zero2"]
    assert [sum(sizes) for sizes in run.param_bytes] == run.bucket_bytes  # no padding at N=2
    for sizes in run.param_bytes:
        assert sum(sizes[:-1]) < BUCKET_BYTES  # still open when its last parameter came
    assert all(b >= BUCKET_BYTES for b in run.bucket_bytes[:-1])  # closed: reached the cap
    assert max(run.bucket_bytes) > BUCKET_BYTES  # a soft cap


def test_zero2_wire_bytes_are_what_gloo_ran(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        for key in NAMES04:
            log = r["n04"].runs[key].step.log
            ring, wire = log.bytes_by_op(), log.wire_bytes_by_op()
            impl = {e.op: e.impl for e in log.events}
            assert "send/recv pair" in impl["reduce_scatter"]
            assert f"as {N} broadcasts" in impl["all_gather"]
            n_events = len(log.events) // 2  # one reduce-scatter, one all-gather per bucket
            assert_wire(wire["reduce_scatter"], ring["reduce_scatter"], n_events)
            assert_wire(wire["all_gather"], ring["all_gather"], n_events)
            assert 2 * ring["all_gather"] <= log.total_wire_bytes()


def assert_wire(wire: int, expected: int, n_events: int) -> None:
    """Measured bytes: `expected` plus message headers (under 1 KiB per call). Overlapping calls
    share their bytes out in proportion, so a per-op figure may also fall a little short."""
    assert expected * 0.98 <= wire <= expected + 1024 * n_events


def test_zero2_accumulation_reduces_every_micro_batch_and_adds_up(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        n_buckets = len(r["n04"].runs["zero2"].bucket_bytes)
        acc = r["n04"].accumulation
        assert acc.reduce_scatters == [n_buckets, 2 * n_buckets]
        assert acc.max_diff < 1e-6


def test_zero2_prefetch_finishes_the_gathers_in_the_next_forward(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        n_buckets = len(r["n04"].runs["zero2"].bucket_bytes)
        steps = r["n04"].two_steps
        assert [s.name for s in steps[True].spans] == ["forward", "backward", "step"] * 2
        assert n04_zero2.gathers_finished_in(steps[False], "step") == n_buckets
        assert n04_zero2.gathers_finished_in(steps[False], "forward") == 0
        assert n04_zero2.gathers_finished_in(steps[True], "step") == 0
        assert n04_zero2.gathers_finished_in(steps[True], "forward") == n_buckets


def test_gathers_finished_in_counts_the_first_steps_gathers_by_span():
    def gather(start, end):
        return CommEvent("all_gather", "zero2/step/b", 8, 4, start=start, end=end)

    log = CommLog(rank=0, world_size=2, events=[gather(1.0, 2.5), gather(1.1, 1.5),
                                                 gather(5.0, 5.5), gather(5.1, 9.0)],
                  spans=[Span("step", 1.0, 1.6), Span("forward", 2.0, 3.0),
                         Span("step", 5.0, 5.2)])
    assert n04_zero2.gathers_finished_in(log, "step") == 1
    assert n04_zero2.gathers_finished_in(log, "forward") == 1


def test_ops_by_phase_assigns_each_event_to_the_span_it_was_issued_in():
    log = hand_made_log(
        [("reduce_scatter", "z/bwd/b0", 1.5, 2.5, True),
         ("all_gather", "z/step/b0", 3.5, 3.6, False),
         ("broadcast", "z/init/w", 0.1, 0.2, False)],  # outside every span: not counted
        [("forward", 0.5, 1.0), ("backward", 1.0, 3.0), ("step", 3.0, 4.0)])
    assert n04_zero2.ops_by_phase(log) == {"forward": {}, "backward": {"reduce_scatter": 1},
                                           "step": {"all_gather": 1}}
