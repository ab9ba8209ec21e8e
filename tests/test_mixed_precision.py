"""Mixed precision (zerolab/parts/mixed_precision.py) on every stage, at 2 ranks: bf16 training
close to fp32, gradients on the wire in bf16, and the paper's bytes per stage."""

from __future__ import annotations

import pytest
from workers import engines as W
from workers import features as F
from workers.features import KIND, STAGES

import zerolab

# bf16 compute against fp32, after 5 AdamW steps: each loss within 2%, and the parameters
# within 5% in relative L2 distance (Adam's sign-like steps magnify bf16 rounding per element).
LOSS_TOLERANCE = 0.02
PARAM_TOLERANCE = 0.05


def relative_distance(a: dict, b: dict) -> float:
    diff = sum((a[k].float() - b[k].float()).pow(2).sum() for k in b)
    return (diff / sum(b[k].float().pow(2).sum() for k in b)).sqrt().item()


@pytest.fixture(scope="module")
def mixed():
    return 2, zerolab.launch(F.mixed, 2, args=(STAGES, KIND), timeout=300)


def test_mixed_precision_stays_close_to_fp32(mixed):
    _, results = mixed
    losses = F.fp32_losses(KIND)
    reference = W.reference_run(KIND)
    for engine_key in STAGES:
        r = results[0][engine_key]
        assert r["losses"] == pytest.approx(losses, rel=LOSS_TOLERANCE), engine_key
        assert relative_distance(r["state"], reference) < PARAM_TOLERANCE, engine_key
        assert r["wire"] == {"bfloat16"}, engine_key  # gradients travel in bf16


def test_mixed_precision_bytes_follow_the_paper(mixed):
    """2Ψ bf16 params + 2Ψ bf16 grads + 12Ψ fp32 (master, m, v), split per stage."""
    n, results = mixed
    psi = zerolab.models.num_params(W.build_model(KIND))
    paper = {"ddp": (2 * psi, 2 * psi, 12 * psi),
             "zero1": (2 * psi, 2 * psi, 12 * psi / n),
             "zero2": (2 * psi, 2 * psi / n, 12 * psi / n),
             "zero3": (2 * psi / n, 2 * psi / n, 12 * psi / n)}
    for engine_key, (params, grads, optimizer) in paper.items():
        got = results[0][engine_key]["bytes"]
        assert got["params"] == pytest.approx(params, rel=0.01), engine_key
        assert got["grads"] == pytest.approx(grads, rel=0.01), engine_key
        assert got["optimizer"] == pytest.approx(optimizer, rel=0.01), engine_key
