"""Notebook 01's memory measurements (zerolab.lessons.n01_memory) on 2 ranks, against the
formulas: what DDP holds, on every rank, in fp32 and in bf16 mixed precision.

The ranks' results come from a launch shared with lesson 00's tests (conftest.py:
lessons_00_01_at_2).
"""

from __future__ import annotations

import pytest
import torch

from zerolab import theory

PSI = 28_032  # zerolab.models.GPT(): Ψ, every parameter trainable, one tied weight
PARAM_TENSORS = 28


def test_ddp_model_states_are_16_psi_plus_step_counters_on_every_rank(lessons_00_01_at_2):
    for r in lessons_00_01_at_2:
        m = r["memory"]
        assert (m.psi, m.param_tensors) == (PSI, PARAM_TENSORS)
        assert m.fp32 == {"params": 4 * PSI, "grads": 4 * PSI,
                          "optimizer": 8 * PSI + 4 * PARAM_TENSORS}
        # bf16 mixed precision: 2 + 2 + 12 (fp32 masters, m, v): the same 16Ψ in all
        assert m.mixed == {"params": 2 * PSI, "grads": 2 * PSI,
                           "optimizer": 12 * PSI + 4 * PARAM_TENSORS}
        assert sum(m.fp32.values()) == pytest.approx(
            theory.model_state_memory(PSI, 2, "DDP").total, abs=4 * PARAM_TENSORS)


def test_ddp_ranks_hold_identical_copies(lessons_00_01_at_2):
    a, b = lessons_00_01_at_2[0]["memory"], lessons_00_01_at_2[1]["memory"]
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert torch.equal(a.grads, b.grads)
    assert a.grads.numel() == PSI


def test_ddp_trace_shows_adam_state_born_in_the_first_step(lessons_00_01_at_2):
    trace = lessons_00_01_at_2[0]["memory"].trace
    first, last = trace.samples[0][1], trace.samples[-1][1]
    assert first["params"] == first["grads"] == 4 * PSI
    assert first["optimizer"] == 0
    assert last["optimizer"] == 8 * PSI + 4 * PARAM_TENSORS
    assert trace.max_by_category["other"] > 0  # activations came and went


def test_activations_grow_with_the_batch_and_model_states_do_not(lessons_00_01_at_2):
    peaks = lessons_00_01_at_2[0]["memory"].peaks
    assert list(peaks) == [4, 8, 16]
    states = [{k: v for k, v in p.items() if k != "other"} for p in peaks.values()]
    assert all(s == states[0] for s in states)
    other = [p["other"] for p in peaks.values()]
    # what notebook 01 prints: [1.0, 2.0, 4.0]
    assert [round(o / other[0], 1) for o in other] == [1.0, 2.0, 4.0]
