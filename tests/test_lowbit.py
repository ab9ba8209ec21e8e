"""Fewer bits on the wire (zerolab.lowbit, zerolab.parts.float8): float8 and bf16 round trips
within their bounds, and ZeRO-3 gathering in bf16 and float8 and reducing in bf16 on 2 ranks:
the bytes measured on the wire against the formula, the weights a gather delivers and the
gradient against the exact wire's, within the formats' bounds."""

from __future__ import annotations

import pytest
import torch
from workers import lowbit as W

import zerolab
from zerolab.lessons import n11_offload as offload
from zerolab.lessons import n11_precision as lesson
from zerolab.lessons.predictions import PREDICTIONS
from zerolab.lowbit import LowBitZeRO3
from zerolab.models import GPT
from zerolab.parts import float8

HEADERS = 640  # at most, gloo's own bytes per call on top of the payload (all-reduce: 576)


# ---- float8 alone ---------------------------------------------------------------------------


def sample(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.logspace(-6, 1, n)[torch.randperm(n, generator=gen)]
    x[n // 3] = 0.0
    return x


@pytest.mark.parametrize("n, block", [(1, 128), (127, 128), (129, 128), (5000, 128), (4097, 7)])
def test_float8_per_block_round_trip_is_within_its_bound(n, block):
    x = sample(n, n + block)
    scales = float8.block_scales(x, block)
    assert scales.shape == (-(-n // block),)
    each = float8.per_element(scales, block, n)
    codes = float8.quantize(x, each)
    assert codes.dtype == torch.uint8 and codes.shape == (n,)  # one byte an element
    error = (float8.dequantize(codes, each) - x).abs()
    bound = float8.error_bound(x, each)
    assert (error <= bound * (1 + 1e-6)).all()
    if n > 100:  # the bound is reached, not loose: a coarser format would break it
        assert (error / bound).max() > 0.5
    assert float8.dequantize(codes, each)[n // 3] == 0


def test_float8_per_tensor_scale_keeps_the_largest_value_and_its_sign():
    x = sample(1000, 1)
    scale = float8.scale_of(x.abs().max())
    back = float8.dequantize(float8.quantize(x, scale), scale)
    i = x.abs().argmax()
    assert back[i] == pytest.approx(x[i].item(), rel=1e-6)  # 448 is a code: exact
    assert ((back - x).abs() <= float8.error_bound(x, scale) * (1 + 1e-6)).all()
    assert (torch.sign(back) == torch.sign(x))[back != 0].all()
    tiny = torch.full((4,), 1e-9)  # far below amax: rounds to 0, within the subnormal bound
    assert (float8.dequantize(float8.quantize(tiny, scale), scale) - tiny).abs().max() <= (
        scale * float8.SUBNORMAL_ERROR)


def test_bf16_round_trip_bound():
    x = sample(5000, 2)
    error = (x.to(torch.bfloat16).float() - x).abs()
    assert (error <= x.abs() * float8.BF16_RELATIVE_ERROR).all()
    assert (error / (x.abs() * float8.BF16_RELATIVE_ERROR)).nan_to_num().max() > 0.5


def test_tensor_amax_and_scales_follow_the_flat_layout():
    # tensors of 3, 4 and 2 elements, a shard covering flat elements [2, 7)
    flat = torch.tensor([1.0, -9.0, 2.0, 3.0, -4.0, 0.5, 6.0, 7.0, -8.0])
    offsets, numels = (0, 3, 7), (3, 4, 2)
    amax = float8.tensor_amax(flat[2:7], offsets, numels, start=2)
    assert amax.tolist() == [2.0, 6.0, 0.0]  # the third tensor has nothing here
    scales = float8.tensor_scales(torch.tensor([1.0, 2.0, 3.0]), offsets, numels, 2, 11)
    assert scales.tolist() == [1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 1.0, 1.0]  # padding: 1


def test_block_must_be_positive():
    with pytest.raises(ValueError, match="block must be a positive number of elements, got 0"):
        float8.block_scales(torch.ones(4), 0)


# ---- the engine's arguments ----------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"gather": "fp8"}, r"gather='fp8': expected one of \('fp32', 'bf16', 'float8'\)"),
    ({"reduce": "float8"}, r"reduce='float8': expected one of \('fp32', 'bf16'\)"),
    ({"gather": "bf16", "float8_block": 128}, "float8_block=128 scales float8 gathers, and "
                                              "gather='bf16'"),
    ({"gather": "float8", "float8_block": 0}, "float8_block=0: a positive number"),
    ({"param_dtype": torch.bfloat16}, "keeps fp32 shards and rounds only what travels"),
])
def test_nonsense_is_refused_before_anything_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LowBitZeRO3(GPT(lesson.config()), torch.optim.AdamW, **kwargs)


# ---- on 2 ranks ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    return zerolab.launch(W.everything, 2, timeout=300)


@pytest.mark.parametrize("label", lesson.VARIANTS)
def test_bytes_on_the_wire_are_the_formula(runs, label):
    """The ring model == the formula, per kind; bytes written to the sockets: the formula plus
    at most HEADERS a call, for the step's total and for one gather alone, kind by kind."""
    units = lesson.unit_sizes()
    formula, one = lesson.formula_bytes(label, units), lesson.gather_bytes(label, units[0])
    for rank in (0, 1):
        wire = runs[rank][label]["wire"]
        for what in ("gathers", "scales", "reduce"):
            assert wire.total(what) == pytest.approx(formula[what], abs=1), (label, what)
        for what in ("gathers", "scales"):
            calls = sum(e[0] == what for e in wire.gather)
            measured = wire.total(what, "wire", gather=True)
            assert 0 <= measured - one[what] <= HEADERS * calls, (label, what, measured)
        extra = wire.total(column="wire") - sum(formula.values())
        assert 0 <= extra <= HEADERS * len(wire.events), (label, extra)


def test_float8_gathers_half_of_bf16_and_a_quarter_of_fp32(runs):
    alone = {label: runs[0][label]["wire"].total("gathers", "wire", gather=True)
             for label in W.LABELS[:4]}
    fp32, bf16, tensor, block = alone.values()
    assert bf16 / fp32 == pytest.approx(0.5, abs=0.01)
    assert tensor / bf16 == pytest.approx(0.5, abs=0.01) and block == tensor
    formula = lesson.gather_bytes(W.LABELS[2], lesson.unit_sizes()[0])["gathers"]
    assert tensor - formula < HEADERS  # the codes alone: one byte an element


def test_float8_scales_cost_what_the_formula_says(runs):
    tensor = runs[0]["float8 gather, scale per tensor"]["wire"]
    block = runs[0]["float8 gather, scale per 128"]["wire"]
    assert {e[1] for e in tensor.events if e[0] == "scales"} == {"all_reduce"}  # amax, max
    assert {e[1] for e in block.events if e[0] == "scales"} == {"all_gather"}
    assert {e[2] for e in tensor.events if e[0] == "gathers"} == {"uint8"}  # bytes on gloo
    assert 0 < tensor.total("scales") < block.total("scales") < block.total("gathers") / 30


@pytest.mark.parametrize("label", W.LABELS[1:4])
def test_gathered_weights_are_rounded_within_the_format(runs, label):
    worst = 0.0
    for full, rounded in runs[0][label]["weights"]:
        error = (rounded - full).abs()
        if label == "bf16 gather":
            bound = full.abs() * float8.BF16_RELATIVE_ERROR
        else:  # a scale per block is never larger than one per tensor
            bound = float8.error_bound(full, float8.scale_of(full.abs().max()))
        assert (error <= bound * (1 + 1e-5) + 1e-12).all(), label
        worst = max(worst, (error / bound.clamp(min=1e-30)).max().item())
    assert worst > 0.2, label  # rounded, not sent exactly
    assert all(torch.equal(a[1], b[1]) for a, b in zip(runs[0][label]["weights"],
                                                       runs[1][label]["weights"]))


def test_exact_wire_is_fp32_and_the_low_bits_move_the_gradient(runs):
    error = {label: ((r["low"] - r["exact"]).norm() / r["exact"].norm()).item()
             for label, r in runs[0].items() if label in W.LABELS}
    assert error["fp32"] == 0.0
    assert 0 < error["bf16 reduce"] < 2 ** -7  # one bf16 rounding of each summand and sum
    assert 0 < error["bf16 gather"] < error["float8 gather, scale per tensor"] < 0.5


def test_accumulation_reduces_once_and_keeps_the_whole_gradient(runs):
    """Reducing after the last micro-batch only: MICRO times fewer reduce-scatters, the same
    gathers, and before the last micro-batch the full gradient (4Ψ) beside the shards (4Ψ/N):
    prediction 11.p2's formula."""
    every, last = runs[0]["accumulation"][True], runs[0]["accumulation"][False]
    psi = sum(u.padded for u in lesson.unit_sizes())  # no padding at N = 2 here
    assert every.collectives["gathers"] == last.collectives["gathers"]
    calls, nbytes = every.collectives["reduce"]
    assert (calls, nbytes) == (lesson.MICRO * last.collectives["reduce"][0],
                               lesson.MICRO * last.collectives["reduce"][1])
    assert every.grads_before_last == 4 * psi // 2
    p2 = PREDICTIONS["11.p2"]
    assert p2.score(4 * psi + 4 * psi / 2, last.grads_before_last).ok
    assert not p2.score(4 * psi / 2, last.grads_before_last).ok  # the sharded answer misses


def test_prediction_11_p1_is_the_formula(runs):
    p1, units = PREDICTIONS["11.p1"], lesson.unit_sizes()
    measured = runs[0]["float8 gather, scale per tensor"]["wire"].total("gathers")
    formula = sum(u.padded * (1 if u.root else 2) for u in units) / 2  # (N-1)/N·1 B·P, fwd+bwd
    assert p1.score(formula, measured).ok
    assert not p1.score(formula + sum(u.padded for u in units if u.root) / 2, measured).ok


# ---- section 3: offload's arithmetic (one process) ---------------------------------------------


def test_every_adamw_way_steps_and_the_fused_one_is_timed():
    seconds = offload.throughput(numel=1 << 12, repeats=1)
    assert list(seconds) == list(offload.WAYS)
    assert all(isinstance(s, float) and s > 0 for s in seconds.values()), seconds
    with pytest.raises(KeyError):
        offload.adamw_seconds("AdamW, by hand", numel=8)


def test_break_even_is_the_slower_of_the_cpu_and_the_link():
    w = offload.WORKLOADS[1]  # 7B on H100s: PCIe Gen5
    (slow,) = offload.break_even(1e9, (w,))  # a CPU step of Ψ / 1e9 s, longer than PCIe's
    assert slow.cpu_step == pytest.approx(w.params / 1e9)
    assert slow.pcie == pytest.approx(2 * w.params / 64e9)
    assert slow.tokens == pytest.approx(w.rate * slow.cpu_step)
    (fast,) = offload.break_even(1e12, (w,))  # a CPU this fast waits on the link instead
    assert fast.tokens == pytest.approx(w.rate * fast.pcie)
    assert offload.pcie_of(offload.WORKLOADS[0]) == 32e9  # the A100 run: Gen4


def test_an_unknown_prediction_is_refused_before_any_launch():
    with pytest.raises(ValueError, match="no measurement for prediction '11.p9'"):
        lesson.measured_for("11.p9")
