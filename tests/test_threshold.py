"""zerolab.threshold: the tokens per rank from which a unit's gather (a bucket's all-reduce)
hides behind its compute; and notebook 10's measurement of it (lessons/n10_threshold.py),
against its formula. Single-process except `live`, which reads test_cost.py's launch."""

from __future__ import annotations

import pytest

from zerolab import cost, threshold
from zerolab.lessons import n10_cluster, n10_threshold

ALPHA, BETA = 300e-6, 1.2e-9  # a made-up link
LINK = cost.Link(ALPHA, BETA, 2, "gloo")
C = 40e9  # a made-up rate, FLOP/s


def test_the_rate_is_the_slope_of_the_forwards_time():
    p, tokens = 400_000, [8, 16, 64, 256]
    times = [50e-6 + 2 * p * t / C for t in tokens]
    rate = threshold.fit_rate(p, tokens, times)
    assert rate.flops_per_s == pytest.approx(C) and rate.overhead == pytest.approx(50e-6)
    assert rate.rms_error == pytest.approx(0, abs=1e-9)


def test_the_rate_refuses_times_that_do_not_grow():
    with pytest.raises(ValueError, match="does not grow with the tokens"):
        threshold.fit_rate(1000, [8, 16], [2e-3, 1e-3])
    with pytest.raises(ValueError, match="need two or more"):
        threshold.fit_rate(1000, [8], [1e-3])


@pytest.mark.parametrize("stage", threshold.STAGES)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_at_the_threshold_compute_equals_communication(stage, n):
    p = 500_000
    t_star = threshold.tokens_to_hide(stage, C, LINK, p, n)
    assert threshold.compute_seconds(stage, C, p, t_star) == pytest.approx(
        threshold.comm_seconds(stage, LINK, p, n))
    # the closed form of the module's docstring, the same for both stages (b = g = 4)
    assert t_star == pytest.approx(C * ALPHA * (n - 1) / (2 * p) + C * BETA * 4 * (n - 1) / (2 * n))


def test_a_large_unit_tends_to_c_over_w():
    h100 = threshold.Machine("H100", threshold.H100_FLOPS, n10_cluster.H100.link(512), 512, 2)
    assert h100.link.bandwidth == 400e9  # 8 NICs of 50 GB/s: the ring's share per GPU
    assert h100.limit == pytest.approx(989e12 / 400e9 * 511 / 512)  # C/W: about 2,500
    assert h100.threshold("ZeRO-3", 10**14) == pytest.approx(h100.limit, rel=1e-3)
    assert h100.threshold("ZeRO-3", 10**6) > h100.limit  # alpha adds for a small unit
    text = threshold.format_machines([h100], {"1M": 10**6})
    assert "H100" in text and f"{h100.limit:,.0f}" in text


def test_an_overhead_a_call_hides_communication_too():
    p, t0 = 500_000, 1e-3
    plain = threshold.tokens_to_hide("ZeRO-3", C, LINK, p, 2)
    less = threshold.tokens_to_hide("ZeRO-3", C, LINK, p, 2, overhead=t0)
    assert less == pytest.approx(plain - C * t0 / (2 * p))
    assert threshold.compute_seconds("ZeRO-3", C, p, less, t0) == pytest.approx(
        threshold.comm_seconds("ZeRO-3", LINK, p, 2))
    assert threshold.tokens_to_hide("ZeRO-3", C, LINK, p, 2, overhead=1.0) == 0.0


def test_shares_hidden_follow_the_times():
    assert threshold.hidden_share(compute=1.0, comm=2.0) == 0.5
    assert threshold.hidden_share(compute=3.0, comm=2.0) == 1.0
    assert threshold.measured_share(comm=1.0, compute=2.0, together=2.0) == 1.0  # all hid
    assert threshold.measured_share(comm=1.0, compute=2.0, together=3.0) == 0.0  # in turn
    assert threshold.measured_share(comm=1.0, compute=2.0, together=3.5) == -0.5  # slowed


def test_the_measured_crossing_is_interpolated_or_none():
    assert threshold.crossing([8, 16, 32], [1.0, 2.0, 4.0], 3.0) == 24.0
    assert threshold.crossing([8, 16], [1.0, 2.0], 5.0) is None
    with pytest.raises(ValueError, match="unknown stage 'ZeRO-2'"):
        threshold.tokens_to_hide("ZeRO-2", C, LINK, 10, 2)


def made_up_threshold() -> n10_threshold.Threshold:
    """Times that follow the formulas: the forward at C, the gather as LINK predicts, busy as
    one after the other (nothing hid), idle as perfect overlap."""
    p, tokens = 442_944, (8, 16, 32, 64, 128, 256)
    gather = threshold.comm_seconds("ZeRO-3", LINK, p, 2)
    forward = [threshold.compute_seconds("ZeRO-3", C, p, t) for t in tokens]
    busy, idle = [gather + f for f in forward], [max(gather, f) for f in forward]
    shares = {how: [threshold.measured_share(gather, f, t) for f, t in zip(forward, times)]
              for how, times in (("busy", busy), ("idle", idle))}
    return n10_threshold.Threshold(2, p, tokens, gather, forward, busy, idle, shares, 1, 2)


def test_the_lessons_table_reads_its_formulas():
    th = made_up_threshold()
    assert th.rate.flops_per_s == pytest.approx(C)
    assert th.measured() == pytest.approx(th.predicted(LINK))  # linear: exact interpolation
    assert th.hidden("busy") == pytest.approx([0.0] * 6, abs=1e-9)
    assert th.hidden("idle") == pytest.approx(th.hidden_predicted(LINK, list(th.tokens)))
    text = n10_threshold.format_threshold(th, LINK)
    assert f"T* predicted {th.predicted(LINK):,.0f} tokens per rank" in text
    assert "C = 40.0 GFLOP/s" in text and "t0 = 0.00 ms" in text
    assert n10_threshold.figure(th, LINK) is not None  # draws from the same numbers


def test_the_sweep_measures_what_the_formula_prices(threshold_live):
    """On 2 real ranks (tests/workers/cost.py): the forward grows with T, so a rate fits, and
    the unit's gather and the shares are measured at each T. (How much hides depends on the
    machine's load: notebook 10 shows it; a test here would fail on a busy machine.)"""
    th = threshold_live
    assert th.world_size == 2 and th.tokens == (8, 256) and th.params % 2 == 0
    assert th.forward[1] > th.forward[0] and th.gather > 0 and th.rate.flops_per_s > 1e8
    assert all(len(th.hidden(how)) == 2 for how in ("busy", "idle"))
    assert th.predicted(cost.Link(1e-4, 1e-9, 2, "gloo")) >= 0


@pytest.fixture(scope="module")
def threshold_live():
    from workers import cost as cost_workers

    import zerolab

    return zerolab.launch(cost_workers.threshold_pair, 2, timeout=120)[0]
