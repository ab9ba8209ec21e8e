"""Notebook 06's measurements (zerolab.lessons.n06_fsdp2) on 2 ranks: zerolab's engines beside
torch's DDP, ZeroRedundancyOptimizer and FSDP2, bitwise equal, holding and sending what the
formulas say.

The ranks' results come from a launch shared with lessons 04, 05 and 07's tests (conftest.py:
lessons_04_07_at_2), on a smaller model than the notebook uses.
"""

from __future__ import annotations

import pytest
import torch
from workers.lessons import GPT06, STEPS06, psi, root_numel
from workers.lessons import WORLD_04_07 as N

from zerolab import engines, theory
from zerolab.lessons import n06_fsdp2
from zerolab.models import GPT

STAGE_OF = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
            "torch_ddp": "DDP", "torch_ddp_zero": "ZeRO-1", "torch_fsdp2": "ZeRO-3"}


def test_every_variant_ends_bitwise_equal_to_torch_ddp(lessons_04_07_at_2):
    for r in lessons_04_07_at_2:
        variants = r["n06"].variants
        assert tuple(variants) == tuple(STAGE_OF) == n06_fsdp2.VARIANTS
        reference = variants["torch_ddp"].full
        for name in STAGE_OF:
            full = variants[name].full
            assert set(reference) == set(full), name  # state_dicts: the tied head is named too
            assert all(torch.equal(full[k], reference[k]) for k in reference), name


def test_model_states_match_the_formulas_within_step_counters(lessons_04_07_at_2):
    p = psi(GPT06)
    tensors = len(list(GPT(GPT06).parameters()))
    for r in lessons_04_07_at_2:
        r06 = r["n06"]
        assert r06.num_params == p
        for name, stage in STAGE_OF.items():
            held = sum(r06.variants[name].held.values())
            extra = held - theory.model_state_memory(p, N, stage).total
            assert 0 < extra <= 4 * tensors, (name, extra)  # AdamW's 4-byte step counters
        zero_ro = r06.variants["torch_ddp_zero"]
        assert zero_ro.held["optimizer"] == 8 * zero_ro.owned["numel"] + 4 * zero_ro.owned[
            "tensors"]
    owned = [r["n06"].variants["torch_ddp_zero"].owned for r in lessons_04_07_at_2]
    assert sum(o["numel"] for o in owned) == p and sum(o["tensors"] for o in owned) == tensors


def test_collectives_counted_and_recorded(lessons_04_07_at_2):
    variants = lessons_04_07_at_2[0]["n06"].variants
    units = GPT06.n_layer + 1
    assert variants["torch_ddp"].calls == {"all_reduce": 1}
    # parameters_as_bucket_view=True: each rank broadcasts the parameters it owns as one bucket.
    assert variants["torch_ddp_zero"].calls == {"all_reduce": 1, "broadcast": N}
    # FSDP2 keeps the root gathered from forward into backward: units + blocks all-gathers.
    assert variants["torch_fsdp2"].calls == {"all_gather": units + GPT06.n_layer,
                                             "reduce_scatter": units}
    for name in engines.STAGE_ENGINES:
        stage = STAGE_OF[name]
        expected = theory.comm_volume(psi(GPT06), N, stage,
                                      root_numel=root_numel(GPT06, stage)).ring_sent_bytes
        assert sum(variants[name].sent.values()) == expected, name
    shapes = variants["torch_fsdp2"].shapes
    assert shapes["wte.weight"] == ((GPT06.vocab_size, GPT06.n_embd),
                                    (GPT06.vocab_size // N, GPT06.n_embd))


def test_torch_traffic_counted_is_the_ring_formula(lessons_04_07_at_2):
    p = psi(GPT06)
    model = GPT(GPT06)
    root = sum(q.numel() for n, q in model.named_parameters() if not n.startswith("blocks."))
    all_reduce = theory.ring_sent_bytes("all_reduce", 4 * p, N)
    for r in lessons_04_07_at_2:
        variants = r["n06"].variants
        assert variants["torch_ddp"].sent == {"all_reduce": all_reduce}
        zero_ro = variants["torch_ddp_zero"]  # at N = 2 the owner sends its bucket, once
        assert zero_ro.sent == {"all_reduce": all_reduce, "broadcast": 4 * zero_ro.owned["numel"]}
        fsdp2 = sum(variants["torch_fsdp2"].sent.values())  # the root is gathered once
        assert fsdp2 == theory.ring_sent_bytes("all_gather", 4 * (3 * p - root), N)


def test_step_times_are_recorded(lessons_04_07_at_2):
    for name in STAGE_OF:
        times = lessons_04_07_at_2[0]["n06"].variants[name].times
        assert len(times) == STEPS06 and all(t > 0 for t in times)
        assert n06_fsdp2.median_ms(times) > 0


def test_median_ms_leaves_out_warmup_and_the_measured_last_step():
    times = [9.0] * n06_fsdp2.WARMUP + [0.001, 0.003, 0.002] + [9.0]
    assert n06_fsdp2.median_ms(times) == pytest.approx(2.0)
