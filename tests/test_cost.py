"""zerolab.cost: the link model's formulas, its fit, and its predictions against real ranks;
the prediction exercises' scoring (zerolab.lessons.predictions); the cluster model's parts."""

from __future__ import annotations

import importlib
import math
import random

import pytest
import torch.distributed as dist
from workers import cost as cost_workers

import zerolab
from zerolab import cost, theory
from zerolab.comm import CommEvent
from zerolab.lessons import n10_cluster, n10_time, predictions
from zerolab.wire.messages import messages

MiB = 1 << 20
ALPHA, BETA = 300e-6, 1.2e-9  # a made-up link: 300 µs a message, 1.2 ns a byte


def synthetic(n: int, alpha: dict | float = ALPHA, beta: dict | float = BETA,
              noise: float = 0.0, seed: int = 0, repeats: int = 5) -> cost.Sweep:
    """A Sweep whose times follow the model exactly (noise=0), or times a random factor in
    [1 - noise, 1 + noise] for each repeat. alpha/beta: one value, or one per op."""
    rng = random.Random(seed)
    timings = []
    for op in cost.OPS:
        a = alpha[op] if isinstance(alpha, dict) else alpha
        b = beta[op] if isinstance(beta, dict) else beta
        for s in cost.SIZES:
            nbytes = s // 4 // n * n * 4
            m = messages(op, nbytes, n)
            t = a * m.count + b * m.nbytes
            seconds = tuple(t * (1 + rng.uniform(-noise, noise)) for _ in range(repeats))
            timings.append(cost.Timing(op, nbytes, n, "gloo", seconds, None, "synthetic"))
    return cost.Sweep(n, "gloo", tuple(timings))


# --- the model's parts ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_messages_follow_what_runs_on_gloo(n):
    s = 12 * n * 1024
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        m = messages(op, s, n)  # zerolab's plans send the ring's bytes, in the ring's steps
        assert m.nbytes == pytest.approx(theory.ring_sent_bytes(op, s, n))
        assert m.count == (2 if op == "all_reduce" else 1) * (n - 1)
    tree = messages("broadcast", s, n)  # binomial tree: the root sends S to each child
    assert tree.count == math.ceil(math.log2(n)) and tree.nbytes == tree.count * s
    assert messages("broadcast", s, n, "nccl").nbytes == s  # a pipelined ring forwards S
    assert messages("all_reduce", s, 1).count == 0 and messages("all_reduce", s, 1).nbytes == 0


def test_messages_refuse_what_they_do_not_know():
    with pytest.raises(ValueError, match="unknown collective 'alltoall'"):
        messages("alltoall", 1, 2)
    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        messages("all_reduce", 1, 2, "mpi")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bandwidths_as_nccl_tests_define_them(n):
    s, t = 256e6, 2e-3
    assert cost.algbw(s, t) == s / t
    assert cost.busbw("all_reduce", s, t, n) == pytest.approx(s / t * 2 * (n - 1) / n)
    for op in ("reduce_scatter", "all_gather"):
        assert cost.busbw(op, s, t, n) == pytest.approx(s / t * (n - 1) / n)
    assert cost.busbw("broadcast", s, t, n) == s / t
    with pytest.raises(ValueError, match="unknown collective"):
        cost.bus_factor("gather", n)


def test_predict_is_alpha_per_message_plus_beta_per_byte():
    link = cost.Link(ALPHA, BETA, 4, "gloo")
    s = 4 * MiB
    assert link.predict("all_reduce", s) == pytest.approx(ALPHA * 6 + BETA * 1.5 * s)
    assert link.predict("reduce_scatter", s, 2) == pytest.approx(ALPHA + BETA * s / 2)
    assert link.predict("all_gather", s, 1) == 0.0
    events = [CommEvent("all_reduce", "t", s, group_ranks=(0, 1)),
              CommEvent("barrier", "t", 0, group_ranks=(0, 1)),
              CommEvent("all_gather", "t", s, group_ranks=(0, 1, 2, 3))]
    assert link.predict_events(events) == pytest.approx(
        link.predict("all_reduce", s, 2) + link.predict("all_gather", s, 4))
    nvlink = cost.Link.from_figures(5e-6, 450e9)
    assert nvlink.beta == 1 / 450e9 and nvlink.backend == "nccl" and nvlink.bandwidth == 450e9


# --- the fit ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4])
def test_fit_recovers_alpha_and_beta_from_exact_timings(n):
    link = cost.fit(synthetic(n))
    assert link.alpha == pytest.approx(ALPHA, rel=1e-9)
    assert link.beta == pytest.approx(BETA, rel=1e-9)
    assert link.shared.r2 == pytest.approx(1.0) and link.shared.rms_error < 1e-9
    assert link.shared.ops == cost.SHARED_OPS  # broadcast has its own fit
    for fit in link.per_op.values():
        assert fit.alpha == pytest.approx(ALPHA, rel=1e-6)
        assert fit.beta == pytest.approx(BETA, rel=1e-6)
    assert link.world_size == n and link.backend == "gloo"


def test_fit_recovers_them_from_noisy_timings_within_its_error():
    # ±30% on each repeat: the medians scatter by about ±10%, over six sizes per op
    link = cost.fit(synthetic(3, noise=0.3, seed=1))
    shared = link.shared
    assert abs(link.alpha - ALPHA) <= 4 * shared.alpha_se
    assert abs(link.beta - BETA) <= 4 * shared.beta_se
    assert 0 < shared.beta_se < 0.1 * BETA  # the error is real, and small next to beta
    assert link.beta == pytest.approx(BETA, rel=0.1)
    assert link.alpha == pytest.approx(ALPHA, rel=0.3)
    assert 0 < shared.rms_error < 0.2 and shared.r2 > 0.95
    assert len(shared.errors) == 3 * len(cost.SIZES)


def test_the_data_choose_shared_or_per_op():
    # all-reduce moving bytes twice as slowly: one beta cannot fit all three
    betas = {"all_reduce": 2 * BETA, "reduce_scatter": BETA, "all_gather": BETA,
             "broadcast": BETA}
    split = cost.fit(synthetic(2, beta=betas, noise=0.05))
    assert split.model == "per op"
    assert split.per_op["all_reduce"].held_out < cost.PER_OP_MARGIN * split.shared.held_out
    assert split.predict("all_reduce", 8 * MiB) == pytest.approx(
        split.per_op["all_reduce"].seconds(messages("all_reduce", 8 * MiB, 2)))
    same = cost.fit(synthetic(2, noise=0.05, seed=3))
    assert same.model == "shared"
    assert same.predict("all_gather", 8 * MiB) == pytest.approx(
        same.alpha + same.beta * 4 * MiB)
    # broadcast always from its own fit: a rank sends or receives, not both
    assert same.alpha_beta("broadcast") == (same.per_op["broadcast"].alpha,
                                            same.per_op["broadcast"].beta)


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="one rank sends nothing"):
        cost.fit(synthetic(1))
    one_size = synthetic(2).only([cost.SIZES[0]])
    with pytest.raises(ValueError, match="the sizes must differ"):
        cost.fit(one_size)
    only_broadcast = cost.Sweep(2, "gloo", tuple(synthetic(2).of("broadcast")))
    with pytest.raises(ValueError, match="at least one of"):
        cost.fit(only_broadcast)


def test_measure_needs_ranks():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="inside zerolab.launch"):
        cost.measure()


# --- on real ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live():
    """One launch of 3 ranks: a sweep on ranks 0-1, its fit, a DDP step (a few seconds)."""
    return zerolab.launch(cost_workers.live, 3, timeout=300)


def test_measure_returns_the_same_sweep_on_every_rank(live):
    sweeps = [r["sweep"] for r in live]
    assert sweeps[0] == sweeps[1] == sweeps[2]  # rank 2 did not take part, and got it too
    sweep = sweeps[0]
    assert sweep.world_size == 2 and sweep.backend == "gloo"
    sizes = cost_workers.FIT + cost_workers.CHECK
    assert len(sweep.timings) == len(cost.OPS) * len(sizes)
    for t in sweep.timings:
        assert len(t.seconds) == 7 and all(s > 0 for s in t.seconds)
        assert t.nbytes % 8 == 0 and t.algbw > 0 and t.busbw <= t.algbw * 2


def test_a_burst_holds_burst_calls_unless_capped_by_burst_bytes(live):
    assert {t.calls for t in live[0]["sweep"].timings} == {2}  # burst=2, no cap
    capped = live[0]["capped"]
    assert [(t.nbytes, t.calls) for t in capped.timings] == [(64 << 10, 4), (1 << 20, 1)]
    assert all(len(t.seconds) == 1 for t in capped.timings)


def test_the_bytes_the_model_prices_are_the_bytes_on_the_wire(live):
    """Measure, do not assume: the busiest rank's measured wire bytes are the model's bytes,
    plus gloo's headers, for every op (gloo's broadcast tree included)."""
    for t in live[0]["sweep"].timings:
        model = t.messages.nbytes
        assert model <= t.wire_bytes <= model * 1.01 + 4096, (t.op, t.nbytes, t.wire_bytes)


def test_predictions_at_unseen_sizes_within_the_fits_band(live):
    """At sizes the fit never saw, measured in the same rounds, the median miss of the
    collectives the engines run is within the band the fit's held-out errors give."""
    errors = live[0]["errors"]
    shared = sorted(abs(e) for (op, _), e in errors.items() if op in cost.SHARED_OPS)
    assert shared[len(shared) // 2] <= live[0]["link"].band, (errors, live[0]["attempts"])


def test_a_steps_prediction_sums_its_collectives(live):
    ddp = live[0]["ddp"]
    assert {op for op, _, _ in ddp["ops"]} == {"all_reduce"}  # DDP's buckets
    assert all(size == 2 for _, _, size in ddp["ops"])
    assert sum(nbytes for _, nbytes, _ in ddp["ops"]) >= 4 * ddp["psi"]  # every gradient
    assert ddp["predicted"] == pytest.approx(ddp["by_hand"]) and ddp["predicted"] > 0


# --- prediction exercises ------------------------------------------------------------------------


def test_a_right_time_passes_and_says_so():
    s = predictions.score(0.012, 0.010, "seconds", band=0.35)
    assert s.ok and s.message.startswith("right") and s.ratio == pytest.approx(1.2)


@pytest.mark.parametrize("predicted, way, size", [(0.020, "too high", "2.00x"),
                                                  (0.005, "too low", "0.50x")])
def test_a_wrong_time_says_which_way_and_by_how_much(predicted, way, size):
    s = predictions.score(predicted, 0.010, "seconds", band=0.35)
    assert not s.ok
    assert s.message.startswith(way) and size in s.message
    assert ("+100%" if way == "too high" else "-50%") in s.message and "±35%" in s.message


def test_bytes_are_exact_or_within_the_stated_rounding():
    assert predictions.score(4_194_304, 4_194_304, "bytes").message == (
        "right: predicted 4,194,304 B, measured 4,194,304 B")
    near = predictions.score(4_194_304, 4_194_880, "bytes", rounding=4096)
    assert near.ok and "too low by 576 B" in near.message
    exact = predictions.score(4_194_304, 4_194_880, "bytes")
    assert not exact.ok and exact.message.startswith("too low by 576 B")
    assert "beyond exact" in exact.message
    off = predictions.score(2 * 4_194_304, 4_194_880, "bytes", rounding=4096)
    assert not off.ok and off.message.startswith("too high by 4,193,728 B (+100.0%)")


def test_counts_are_exact_and_nothing_written_is_not_attempted():
    assert predictions.score(9, 9, "count").ok
    assert predictions.score(8, 9, "count").message.startswith("too low by 1 (-11.1%)")
    blank = predictions.score(None, 0.01, "seconds")
    assert not blank.ok and blank.message.startswith("not attempted") and blank.ratio is None
    with pytest.raises(ValueError, match="unknown kind 'ms'"):
        predictions.score(1, 1, "ms")


def test_peak_bytes_by_category_are_scored_one_by_one():
    measured = {"params": 1000, "grads": 1000, "optimizer": 2000}
    scores = predictions.score_each({"params": 1000, "grads": 500}, measured, "bytes")
    assert scores["params"].ok
    assert scores["grads"].message.startswith("too low by 500 B (-50.0%)")
    assert scores["optimizer"].message.startswith("not attempted")
    with pytest.raises(ValueError, match="does not measure"):
        predictions.score_each({"activations": 1}, measured, "bytes")


def test_notebook_10_asks_five_predictions_the_grader_can_measure():
    ps = [p for p in predictions.PREDICTIONS.values() if p.notebook == "10_bytes_to_seconds"]
    assert [p.id for p in ps] == ["10.1", "10.2", "10.3", "10.4", "10.5"]
    assert len({p.name for p in ps}) == 5 and all(p.kind in predictions.KINDS for p in ps)
    for p in ps:
        module, _, fn = p.measure.partition(":")
        assert callable(getattr(importlib.import_module(module), fn))
    assert ps[0].score(4_194_304, 4_194_880).ok  # the ring's bytes, to the nearest 4 KiB


# --- the cluster model -----------------------------------------------------------------------


def test_cluster_link_is_nvlink_in_a_node_and_eight_nics_beyond():
    h = n10_cluster.H100
    assert h.link(8).bandwidth == h.nvlink
    assert h.link(16).bandwidth == min(h.nvlink, 8 * h.nic)
    assert n10_cluster.H100_ETHERNET.link(64).bandwidth == 12.5e9  # 100 Gb/s per node


def test_cluster_steps_follow_the_stages_traffic():
    w = n10_cluster.WORKLOADS[1]  # 7B
    steps = {s: n10_cluster.step_model(w, s, 512) for s in theory.STAGES}
    assert not steps["DDP"].fits and steps["ZeRO-3"].fits  # 16Ψ does not fit 80 GB
    # ZeRO-3 moves 2 + 2 + 4 bytes a parameter, ZeRO-1/2 2 + 4: 8/6 the transfer
    assert steps["ZeRO-3"].transfer == pytest.approx(steps["ZeRO-2"].transfer * 8 / 6)
    s = steps["ZeRO-3"]
    assert s.tokens_per_s(w.tokens_per_gpu, True) >= s.tokens_per_s(w.tokens_per_gpu, False)
    assert n10_cluster.step_model(w, "ZeRO-3", 8).compute == pytest.approx(
        w.tokens_per_gpu / w.rate)


def test_nccls_all_reduce_is_the_faster_of_ring_and_tree():
    link = cost.Link.from_figures(1e-5, 1e11)
    s = 256e6
    ring = link.predict("all_reduce", s, 512)  # alpha·2·511
    tree = n10_cluster.all_reduce_seconds(link, s, 512)
    assert tree == pytest.approx(ring - 1e-5 * 2 * 511 + 1e-5 * 2 * 9)  # ceil(log2 512) = 9
    assert n10_cluster.all_reduce_seconds(link, s, 2) == link.predict("all_reduce", s, 2)


def test_published_runs_are_predicted_past_their_threshold():
    text = n10_cluster.format_predicted().splitlines()
    assert len(text) == 1 + len(n10_cluster.PUBLISHED)
    for line, ((name, n), (published, _)) in zip(text[1:], n10_cluster.PUBLISHED.items()):
        w = next(w for w in n10_cluster.WORKLOADS if w.name == name)
        assert n10_cluster.threshold_tokens(w, n) < w.tokens_per_gpu  # past T*: it hides
        assert f"{w.rate:,}" in line  # so the prediction is the rate at 8 GPUs
        assert f"{w.rate / published - 1:+.1%}" in line


# --- notebook 10's tables, on made-up runs --------------------------------------------------------


def made_up_run(n: int = 2) -> n10_time.Run:
    """A Run whose measurements are the link's own predictions, except ZeRO-1's, twice."""
    sweep = synthetic(n, noise=0.1)  # noise: the fit's held-out misses give a band of some %
    link = cost.fit(sweep)
    wide = cost.Sweep(n, "gloo", tuple(
        cost.Timing(op, s // 4 // n * n * 4, n, "gloo",
                    (link.predict(op, s // 4 // n * n * 4),) * 3, None, "made up")
        for op in cost.SHARED_OPS for s in n10_time.CHECK_SIZES))
    run = n10_time.Run(n, 1000, wide, link)
    for name, factor in (("DDP", 1.0), ("ZeRO-1", 2.0)):
        ops = [("all_reduce", 4 * MiB)] * 3
        comm_s = sum(link.predict(op, s) for op, s in ops)
        run.stages[name] = n10_time.StageTime(
            name, n, ops, comm_s, [[factor * link.predict(op, s) for op, s in ops]] * 3,
            {"forward": [0.01] * 3, "backward": [0.02] * 3, "step": [0.005] * 3},
            {"forward": [0.012] * 3, "backward": [0.03] * 3, "step": [0.006] * 3,
             "after": [0.0] * 3, "total": [0.048] * 3})
    return run


def test_the_check_table_counts_what_falls_within_the_band():
    run = made_up_run()
    text = n10_time.format_check({2: run})
    band = run.link.band
    assert text.endswith("16 of 17 predictions within their band")
    assert "ZeRO-1 step" in text and f"-50%  OUTSIDE {band:.0%}" in text
    only = n10_time.format_check({2: made_up_run()}, collectives=False)
    assert only.endswith("1 of 2 predictions within their band")
    assert f"band ±{band:.0%}: the largest miss of the shared fit on each of its 18 points" in text


def test_the_band_is_the_fits_worst_held_out_miss():
    exact = cost.fit(synthetic(2))
    assert exact.band == pytest.approx(0, abs=1e-9)  # a model that fits exactly: no slack
    noisy = cost.fit(synthetic(2, noise=0.3, seed=3))
    errors = noisy.shared.held_out_errors
    assert len(errors) == 3 * len(cost.SIZES) and noisy.model == "shared"
    assert noisy.band == max(abs(e) for e in errors) > noisy.shared.held_out  # worst > RMS
    with pytest.raises(ValueError, match="no held-out errors"):
        _ = cost.Link.from_figures(1e-5, 1e11).band


def test_a_stage_splits_its_step_into_compute_exposed_and_hidden():
    s = made_up_run().stages["DDP"]
    assert s.median("compute") == pytest.approx(0.035)
    assert s.exposed == pytest.approx(0.013)  # 48 ms step - 35 ms compute
    assert s.exposed_by_phase() == pytest.approx(
        {"forward": 0.002, "backward": 0.01, "step": 0.001, "after": 0.0})
    assert n10_time.breakdown(s)["predicted"] == pytest.approx(0.035 + s.predicted_comm)
    assert "DDP, N = 2" in n10_time.format_steps({2: made_up_run()})




def test_per_call_table_averages_each_ops_calls():
    """format_per_call: each call's median over the replays, averaged over the op's calls, with
    the messages the model charges one call (an all-reduce at N = 2: two)."""
    run = made_up_run()
    s = run.stages["ZeRO-1"]
    s.collectives = [("reduce_scatter", 2 * MiB), ("all_gather", 2 * MiB), ("all_gather", 4 * MiB)]
    s.comm_alone = [[0.001, 0.002, 0.004], [0.003, 0.002, 0.006], [0.002, 0.009, 0.005]]
    # medians per call: 2, 2 and 5 ms; the all-gathers' mean: 3.5 ms
    lines = n10_time.format_per_call({2: run}).splitlines()
    assert lines[0] == (f"N = 2, DDP:    3 all_reduce of 4.00 MiB, 2 message(s): "
                        f"{run.link.predict('all_reduce', 4 * MiB) * 1e3:.2f} ms a call")
    assert lines[1] == ("N = 2, ZeRO-1: 1 reduce_scatter of 2.00 MiB, 1 message(s): 2.00 ms a "
                        "call; 2 all_gather of 3.00 MiB, 1 message(s): 3.50 ms a call")
    assert n10_time.format_per_call({2: run}, stages=("ZeRO-3",)) == ""
