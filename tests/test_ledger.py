"""The peak ledger (zerolab.ledger, notebook 06's peak_ledgers): at 3 ranks, every byte of
each stage's peak on the course GPT in a row (under 1% unexplained), the model-state rows at
their formulas, torch's MemTracker beside it agreeing where it sees everything, and the padding
row at what the layout says."""

from __future__ import annotations

import pytest
from workers import knobs as K

import zerolab
from zerolab import theory
from zerolab.lessons import n06_fsdp2
from zerolab.models import GPT, num_params

N = 3
PSI = num_params(GPT())
TENSORS = len(list(GPT().parameters()))


@pytest.fixture(scope="module")
def runs():
    return zerolab.launch(K.ledgers_and_padding, N, timeout=600)


def test_every_byte_of_each_peak_is_in_a_row(runs):
    for rank, run in enumerate(runs):
        for key, entry in run["ledgers"].items():
            ledger = entry.ledger
            assert sum(ledger.rows.values()) + ledger.unexplained == ledger.peak_bytes
            assert ledger.unexplained_fraction < 0.01, (rank, key, ledger.table())
            assert ledger.phase == "backward", (key, ledger.phase)  # activations + grads
            assert ledger.rows["activations"] > 0 and ledger.rows["activation grads"] > 0
            assert len(ledger.table()) == len(ledger.rows) + 3


def test_model_state_rows_match_the_formulas(runs):
    """Padding apart: the parameters whole (DDP, ZeRO-1, ZeRO-2), and Adam's m and v at the
    formula over the ranks, plus a 4-byte step counter per tensor stepped."""
    for key in n06_fsdp2.LEDGER_STAGES:
        stage = n06_fsdp2.LEDGER_STAGES[key]
        formula = theory.model_state_memory(PSI, N, stage)
        rows = [run["ledgers"][key].ledger.rows for run in runs]
        assert all(run["ledgers"][key].model_states == formula.total for run in runs)
        shards = 1 if stage == "DDP" else N  # the ranks that together hold one copy
        optimizer = sum(r["optimizer"] for r in rows[:shards])
        assert 0 < optimizer - shards * formula.optimizer <= 4 * TENSORS * shards, key
        if key != "zero3":  # ZeRO-3's parameters at the peak: shards + gathered units
            assert all(r["params"] == 4 * PSI for r in rows), key
    # DDP: the flat gradient buckets, and any parameter's gradient not yet taken into them
    assert all(run["ledgers"]["ddp"].ledger.rows["grads"] >= 4 * PSI for run in runs)


def test_deepspeed_estimates_sit_beside_zero2_and_zero3(runs):
    ledgers = runs[0]["ledgers"]
    assert ledgers["zero2"].deepspeed == theory.deepspeed_zero2_bytes(PSI, N)
    assert ledgers["zero3"].deepspeed > theory.deepspeed_zero3_bytes(PSI, N)  # + the layer
    assert ledgers["ddp"].deepspeed is None and ledgers["zero1"].deepspeed is None


def test_torch_memtracker_runs_beside_and_agrees_where_it_sees_everything(runs):
    """torch.distributed._tools.MemTracker (on a CPU) on the next, identical step: the same
    peak for DDP. For ZeRO-1/2/3 a few bytes more: the tracker asks every module it sees for
    its parameters, the engine too, and a ZeRO engine's are its shards as DTensors (shell.py),
    built on that first call with their DeviceMesh (a tensor of the N ranks); their .grad are
    the gradient shards, which the tracker counts as well."""
    for run in runs:
        ledgers = run["ledgers"]
        assert ledgers["ddp"].torch_peak == ledgers["ddp"].ledger.peak_bytes
        for key in ("zero1", "zero2", "zero3"):
            mesh = ledgers[key].torch_peak - ledgers[key].ledger.peak_bytes
            assert 0 < mesh <= 8 * N, (key, mesh)
        assert set(ledgers["ddp"].torch_tracker) >= {"Parameter", "Gradient", "Optstate"}


def test_padding_row_is_what_the_layout_pads(runs):
    for run in runs:
        mlp, expected = run["mlp"], run["padding"]
        assert mlp.rows["padding"] == sum(expected.values()) > 0
        assert mlp.unexplained_fraction < 0.01
