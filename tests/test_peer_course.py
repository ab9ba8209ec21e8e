"""A peer course's DDP and sharded-optimizer tests, in their shape, through thin adapters over
zerolab's public API (workers/peer_course.py): a torch user's harness, unchanged, must pass on
zerolab as it passes on torch's own DDP and ZeroRedundancyOptimizer.

One launch at 2 ranks runs every case; the assertions are the harness's own: after every step
the wrapped model equals one process on the whole batch (allclose's default tolerance; on rank
0, whose single process starts from the same weights), the ranks hold one model, rank 0's
weights were broadcast, the frozen parameter never moved.
"""

from __future__ import annotations

import pytest
import torch
from workers import peer_course as P

import zerolab


@pytest.fixture(scope="module")
def results():
    return zerolab.launch(P.run_all, 2, timeout=300)


def _allclose(diff: float) -> bool:
    # torch.allclose's defaults (rtol 1e-5, atol 1e-8) on weights of order 0.1-1
    return diff <= 1e-5


@pytest.mark.parametrize("case", [c for c in P.CASES if "ddp" in c])
def test_peer_ddp_matches_one_process_after_every_step(results, case):
    """zerolab's DDP, and torch's (the yardstick: "torch ddp ...")."""
    got = results[0][case]  # rank 1's single-process model started from its own seed
    assert all(_allclose(d) for d in got["diffs"]), (case, got["diffs"])
    for a, b in zip(got["final"], results[1][case]["final"]):
        assert torch.equal(a, b), case  # the ranks hold one model
    for rank, r in enumerate(results):
        assert r[case]["frozen"] == [2.0, 2.0]
        for name in r[case]["differs_at_start"]:
            # rank 1 started from its own seed: the wrapper replaced it with rank 0's weights
            expected = rank != 0 and not name.endswith("frozen")
            assert r[case]["differs_at_start"][name] == expected, (case, rank, name)


@pytest.mark.parametrize("case", [c for c in P.CASES if "sharded" in c])
def test_peer_sharded_optimizer_matches_adamw(results, case):
    for rank, r in enumerate(results):
        assert all(_allclose(d) for d in r[case]["diffs"]), (case, rank, r[case]["diffs"])
        assert r[case]["frozen"] == [2.0, 2.0]
    # each rank holds part of the state, the ranks all of it (zerolab pads its shards)
    full = results[0][case]["full_state_numel"]
    held = [r[case]["state_numel"] for r in results]
    assert max(held) <= 0.75 * full and sum(held) >= full, (case, held, full)


def test_the_tied_weight_is_one_parameter():
    """named_parameters() lists a tied weight once, as torch does: the harness zips the wrapped
    model's parameters with the plain model's, so a second entry would misalign every one."""
    model = P.TiedToyModel()
    assert len(list(model.parameters())) == 8
    assert sum(1 for n, _ in model.named_parameters() if "weight" in n) == 3
    assert model.fc4.weight is model.fc2.weight
    assert isinstance(model.frozen, torch.nn.Parameter) and not model.frozen.requires_grad
