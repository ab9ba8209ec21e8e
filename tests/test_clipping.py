"""Global-norm clipping (zerolab/parts/clipping.py) on every stage, at 3 ranks: the norm every
rank returns, and the training it leaves, against a single-process reference."""

from __future__ import annotations

import pytest
from workers import engines as W
from workers import features as F
from workers.features import KIND, STAGES

import zerolab
from zerolab.harness import max_diff


@pytest.fixture(scope="module")
def clipping():
    return zerolab.launch(F.clipped, 3, args=(STAGES, KIND), timeout=300)


def test_clip_returns_the_global_norm_on_every_rank(clipping):
    reference = F.reference_clipped(KIND)
    for engine_key in STAGES:
        for res in clipping:
            norms = res[engine_key]["norms"]
            assert norms == pytest.approx(reference["norms"], rel=1e-4), engine_key
    assert all(norm > F.MAX_NORM for norm in reference["norms"])  # so every step clipped


def test_clipped_training_matches_the_reference(clipping):
    reference = F.reference_clipped(KIND)["state"]
    unclipped = W.reference_run(KIND)
    for engine_key in STAGES:
        diff = max_diff(clipping[0][engine_key]["state"], reference)
        assert diff < 5e-5, (engine_key, diff)  # 3 ranks: reduction-order noise, through Adam
        assert max_diff(clipping[0][engine_key]["state"], unclipped) > 20 * diff  # clipping acted
