"""Notebook 09b's measurements (zerolab.lessons.n09_saves): models born sharded, checkpoints.

One launch of 4 ranks builds the model in full and born sharded (the construction at N = 4),
saves a ZeRO-3 checkpoint after 2 SGD steps and trains on uninterrupted; a launch of 2 ranks
resumes it with ZeRO-2; a 1-rank launch dies half-way through a save. (The DCP round trips with
torch and FSDP2: test_lesson_n09_dcp.py.)
"""

from __future__ import annotations

import math
import os

import pytest

import zerolab
from zerolab import checkpoint
from zerolab.harness import max_diff
from zerolab.lessons import n09_nodes
from zerolab.lessons import n09_saves as lesson
from zerolab.models import GPT, num_params

N = 4
PSI = num_params(GPT(lesson.MODEL))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("ckpt") / "ckpt")


@pytest.fixture(scope="module")
def runs(folder) -> list[lesson.Saved]:
    return zerolab.launch(lesson.saved_lesson, N, args=(folder,), timeout=900)


def test_born_sharded_peaks_at_the_kept_shards_plus_one_unit(runs):
    for built in [r.construction for r in runs] + [lesson.construction()]:  # N = 4, and 1 here
        kept = sum(built.kept.values())
        assert built.same
        assert kept == 8 * PSI // built.world_size  # param and grad shards (no padding here)
        assert built.peak_meta <= kept + built.largest_unit_bytes
        assert built.peak_full >= built.full_model_bytes + built.largest_unit_bytes
        if built.world_size > 2:
            assert built.peak_meta < built.full_model_bytes < built.peak_full


def test_the_checkpoint_holds_a_quarter_of_each_unit_per_rank(runs, folder):
    """Each rank's DCP file holds rectangles of the model's tensors: a quarter of each unit's
    elements, and as many of SGD's momentum."""
    from zerolab.units import make_units

    model = GPT(lesson.MODEL)
    names = {p: n for n, p in model.named_parameters()}
    units = {u.name: [names[p] for p in u.params] for u in make_units(model)}
    numels = n09_nodes.unit_numels()
    for rank in range(N):
        chunks = lesson.chunks_in(folder, rank)
        for unit, params in units.items():
            for prefix, suffix in (("model.", ""), ("optimizer.state.", ".momentum_buffer")):
                held = sum(math.prod(c.sizes) for c in chunks
                           if c.key in {f"{prefix}{n}{suffix}" for n in params})
                assert held == numels[unit] // N, (rank, unit, prefix)


def test_resumed_at_2_with_zero2_continues_as_if_uninterrupted(runs, folder):
    resumed = zerolab.launch(lesson.resumed_lesson, 2, args=(folder, "zero2"), timeout=900)
    assert runs[0].straight and not runs[1].straight  # rank 0 returns the uninterrupted run
    for r in resumed:
        assert max_diff(r.state, runs[0].straight) < 1e-6
        assert r.construction.same and r.construction.world_size == 2


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path):
    folder = str(tmp_path / "ckpt")
    zerolab.launch(lesson.sgd_run, 1, args=("ZeRO-3", range(1), None, folder), timeout=300)
    crash = lesson.crash_mid_save(folder)
    assert "exited with code 1" in crash.error
    assert crash.after == ["LATEST", "LOCK", "save-000001", "save-000002"]
    assert crash.crashed_files == ["__0_0.distcp"] and crash.latest == "save-000001"
    assert crash.same_as_before
    assert os.path.basename(checkpoint.latest(folder)) == "save-000001"
