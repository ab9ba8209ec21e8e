"""Verdicts the notebooks print instead of narrating a noisy timing (notebook 05's prefetch)."""

from __future__ import annotations

from types import SimpleNamespace

from zerolab.lessons import n05_zero3


def log(*durations_ms: float, name: str = "forward"):
    """A CommLog-shaped object with one span per block, of the given lengths."""
    spans, t = [], 0.0
    for d in durations_ms:
        spans.append(SimpleNamespace(name=name, start=t, end=t + d / 1e3))
        t += d / 1e3 + 0.001
    spans.append(SimpleNamespace(name="backward", start=t, end=t + 1.0))  # not a block
    return SimpleNamespace(spans=spans)


def test_a_clear_difference_gets_a_verdict():
    off = [log(1.0, 1.1, 1.2), log(1.05, 1.15)]
    on = [log(2.0, 2.1, 2.2), log(2.05, 2.3)]
    v = n05_zero3.compute_beside_gathers(off, on)
    assert v.verdict == "slower beside a gather" and v.slower_share == 1.0
    assert len(v.alone_ms) == 5 and len(v.beside_ms) == 5  # every rank's blocks, no backward
    assert v.alone_ms[0] == 1.0
    assert n05_zero3.compute_beside_gathers(on, off).verdict == "faster beside a gather"


def test_overlapping_samples_are_within_noise():
    off = [log(1.0, 2.0, 3.0, 4.0)]
    on = [log(1.5, 2.5, 3.5, 0.5)]
    v = n05_zero3.compute_beside_gathers(off, on)
    assert 0.1 < v.slower_share < 0.9 and v.verdict == "within noise"
    # ties count half: identical samples are neither slower nor faster
    assert n05_zero3.compute_beside_gathers(off, off).slower_share == 0.5
