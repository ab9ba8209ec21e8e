"""Notebook 11's "Optimizers on shards" (zerolab.lessons.n11_optimizers) on 3 ranks: flat and
dim-0 shards step Adafactor and Muon wrong, whole matrices right (bit for bit: the same
gradient, moved, not summed), and each design's bytes are its formula's."""

from __future__ import annotations

import pytest
import torch

import zerolab
from zerolab.lessons import n11_optimizers as lesson
from zerolab.parts.whole_params import outside_numel
from zerolab.sharding import FlatLayout

WORLD = 3  # at 2 ranks the owner and the all-gather move the same bytes; at 3 they part
FAR = 0.05  # a wrong design's update is at least this far off (relative); measured: 0.3 to 1
HEADERS = 256  # at most, gloo's own bytes per message on top of the payload (measured 144)


@pytest.fixture(scope="module")
def result() -> lesson.OptimizersOnShards:
    results = zerolab.launch(lesson.optimizers_on_shards, WORLD, timeout=240)
    assert all(r == results[0] for r in results[1:])  # sums over the ranks: the same everywhere
    return results[0]


@pytest.mark.parametrize("optimizer", list(lesson.OPTIMIZERS))
def test_whole_matrices_are_right_and_shards_wrong(result, optimizer):
    for design in ("whole, one owner", "whole, on every rank"):
        assert result.row(optimizer, design).max_diff == 0.0, design
    for design in ("flat shards", "dim-0 shards"):
        row = result.row(optimizer, design)
        assert row.update_error > FAR and row.max_diff > 0, (design, row)


@pytest.mark.parametrize("optimizer", list(lesson.OPTIMIZERS))
def test_bytes_are_the_formulas(result, optimizer):
    for design in lesson.DESIGNS:
        row = result.row(optimizer, design)
        assert row.sent_bytes == row.formula_bytes, (design, row)
        if row.wire_bytes is not None:  # gloo on Linux: what the ranks wrote, headers on top
            calls = {"whole, one owner": 2, "whole, on every rank": 1}.get(design, 0)
            messages = result.steps * calls * WORLD * (WORLD - 1)  # per step, call and peer
            assert row.formula_bytes <= row.wire_bytes <= row.formula_bytes + messages * HEADERS
    layout = FlatLayout.of([torch.empty(lesson.SHAPE)], WORLD)
    owner = result.row(optimizer, "whole, one owner").formula_bytes
    everyone = result.row(optimizer, "whole, on every rank").formula_bytes
    assert owner == result.steps * 2 * outside_numel(layout) * 4
    assert everyone == result.steps * (WORLD - 1) * layout.padded_numel * 4
    assert owner < everyone


@pytest.mark.parametrize("optimizer", list(lesson.OPTIMIZERS))
def test_one_owner_keeps_one_copy_of_the_state(result, optimizer):
    one = result.row(optimizer, "whole, one owner").state_bytes
    assert one > 0
    assert result.row(optimizer, "whole, on every rank").state_bytes == WORLD * one


def test_adafactor_factors_and_muon_does_not(result):
    """Adafactor keeps a row and a column moment of the matrix: rows + cols floats; on a flat
    shard it keeps one per element. Muon's momentum is the matrix's size."""
    rows, cols = lesson.SHAPE
    assert result.row("Adafactor", "whole, one owner").state_bytes == (rows + cols) * 4
    assert result.row("Adafactor", "flat shards").state_bytes >= rows * cols * 4
    assert result.row("Muon", "whole, one owner").state_bytes == rows * cols * 4


def test_orthogonalize_is_torchs_muon_update():
    torch.manual_seed(0)
    w, g = torch.randn(7, 5), torch.randn(7, 5)
    p = torch.nn.Parameter(w.clone())
    p.grad = g.clone()
    torch.optim.Muon([p], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0).step()
    scale = (7 / 5) ** 0.5  # torch's lr adjustment, sqrt(max(1, rows / cols))
    assert torch.allclose((w - p.detach()) / scale, lesson.orthogonalize(g), atol=1e-6)
