"""Notebook 12's 2x2 mesh: Megatron's split of the course's blocks (zerolab.tp), FSDP x TP on 4
ranks against one process, the bytes per axis against their formulas, and the crossovers."""

from __future__ import annotations

import pytest
import torch

import zerolab
from zerolab import harness, tp
from zerolab.lessons import n12_meshes as lesson
from zerolab.models import GPT, GPTConfig

SMALL = GPTConfig(n_layer=2, n_embd=32, n_head=4)


def test_local_heads_block_is_the_course_block():
    x, _ = GPT(SMALL).make_batch(3, 0)
    assert torch.equal(tp.local_heads(GPT(SMALL))(x), GPT(SMALL)(x))


def test_interleaved_qkv_slices_hold_whole_heads_and_come_back():
    model = tp.local_heads(GPT(SMALL))
    tp.interleave_qkv(model, 2)
    h = SMALL.n_embd
    q, k, v = GPT(SMALL).blocks[0].qkv.weight.detach().split(h)
    first = model.blocks[0].qkv.weight.detach()[:3 * h // 2]  # TP rank 0's rows
    assert torch.equal(first, torch.cat([q[:h // 2], k[:h // 2], v[:h // 2]]))
    back = tp.deinterleave_qkv(dict(model.named_parameters()), h, 2)
    assert harness.max_diff(back, dict(GPT(SMALL).named_parameters())) == 0.0


def test_heads_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="4 heads do not split over 3 tensor-parallel ranks"):
        tp.interleave_qkv(GPT(SMALL), 3)


def test_crossovers():
    # equal links, 2 x 2: FSDP 3 · 1/2 · 12h²/2 = 9h² values, TP 4 · 1 · T·h: T = 2.25 h
    assert lesson.crossover_tokens(64, 2, 2) == pytest.approx(144)
    assert lesson.crossover_tokens(64, 2, 2, w_dp=1, w_tp=9) == pytest.approx(9 * 144)
    # TP bytes 100 per sequence from 0; DP 950: more than DP from 10 sequences on
    assert lesson.crossover_seqs({4: 400, 12: 1200}, 950) == 10
    assert lesson.crossover_seqs({4: 400, 12: 1200}, 1000) == 11  # equal is not more


@pytest.fixture(scope="module")
def runs() -> list[lesson.MeshRun]:
    return zerolab.launch(lesson.mesh_lesson, 4, timeout=600)


def test_fsdp_x_tp_trains_as_one_process(runs):
    losses, weights = lesson.reference()
    for run in runs:
        assert harness.max_diff(run.full, weights) < 1e-6
    dp_mean = [(a + b) / 2 for a, b in zip(runs[0].losses, runs[2].losses)]
    assert dp_mean == pytest.approx(losses, abs=1e-6)


def test_each_axis_carries_its_formula(runs):
    for run in runs:
        expected = lesson.formula(run.local_numel)
        for phase, to in run.sent.items():
            measured = run.axis(to)
            assert measured["neither"] == 0, (run.rank, phase)
            for axis in ("tp", "dp"):  # the wire adds message headers, never less
                want = expected[axis][phase]
                assert want <= measured[axis] <= want * 1.04 + 2048, (run.rank, phase, axis)


def test_the_predictions_formulas_score_right_and_misses_wrong(runs):
    from zerolab.lessons.predictions import PREDICTIONS

    r0 = runs[0]
    formula = lesson.formula(r0.local_numel)
    tp_step = sum(formula["tp"].values())  # 16 all-reduces of 4·b·s·h bytes, at n = 2
    p1 = PREDICTIONS["12.p1"]
    assert p1.score(tp_step, r0.step_bytes()["tp"]).ok
    assert not p1.score(tp_step / 2, r0.step_bytes()["tp"]).ok  # forward only
    per_seq = sum(lesson.formula(r0.local_numel, seqs=1)["tp"].values())
    dp_step = sum(formula["dp"].values())
    measured = lesson.crossover_seqs({lesson.SEQS: r0.step_bytes()["tp"],
                                      lesson.SEQS_LARGER: r0.axis(r0.sent_larger)["tp"]},
                                     r0.step_bytes()["dp"])
    p2 = PREDICTIONS["12.p2"]
    assert p2.score(int(dp_step // per_seq) + 1, measured).ok
    ring = sum(lesson.formula(r0.local_numel, reduce_scatter_factor=1)["dp"].values())
    assert not p2.score(int(ring // per_seq) + 1, measured).ok  # gloo's reduce-scatter missed


def test_a_prediction_without_a_measurement_here_is_refused():
    with pytest.raises(ValueError, match="no measurement for prediction '09.p1' here"):
        lesson.measured_for("09.p1")
