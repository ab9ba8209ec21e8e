"""Checkpoints (zerolab.checkpoint), every stage: resumed exactly at the same world size, resharded
to another world size and into another stage (HSDP too), consolidated into a plain state_dict,
and a save that crashed half-way refused or left behind.

(Notebook 09's checkpoints, what it prints about them, are tested in test_lesson_n09_nodes.py.)
"""

from __future__ import annotations

import os

import pytest
import torch
from workers import engines as W
from workers import features as F
from workers import nodes
from workers.features import KIND, STAGES

import zerolab
from zerolab import checkpoint
from zerolab.harness import max_diff


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of every stage after 2 steps at N=2, with the uninterrupted 5-step runs."""
    root = str(tmp_path_factory.mktemp("checkpoints"))
    return root, zerolab.launch(F.save_train_resume, 2, args=(STAGES, KIND, root), timeout=300)


def test_checkpoint_resumes_exactly_at_the_same_world_size(saved):
    root, results = saved
    for engine_key in STAGES:
        assert os.path.exists(os.path.join(checkpoint.latest(os.path.join(root, engine_key)),
                                           "manifest.json"))
        for res in results:
            straight, resumed = res[engine_key]["straight"], res[engine_key]["resumed"]
            assert all(torch.equal(resumed[k], straight[k]) for k in straight), engine_key


@pytest.mark.parametrize("n", [1, 3])
def test_checkpoint_reshards_to_another_world_size(saved, n):
    root, results = saved
    resumed = zerolab.launch(F.resume_all, n, args=(STAGES, KIND, root), timeout=300)
    for engine_key in STAGES:
        straight = results[0][engine_key]["straight"]
        yardstick = max_diff(straight, W.reference_run(KIND))
        for res in resumed:  # equal up to reduction order
            assert max_diff(res[engine_key], straight) <= W.YARDSTICK_MULTIPLE * yardstick, (
                engine_key, n)


def test_checkpoint_loads_into_another_stage(saved):
    """ZeRO-3 at 2 ranks -> ZeRO-1 at 3 ranks: checkpoints do not depend on the layout."""
    root, results = saved
    resumed = zerolab.launch(F.resume_all, 3, args=(["zero3"], KIND, root, "zero1"))[0]
    assert max_diff(resumed["zero3"], results[0]["zero3"]["straight"]) < 1e-4


def test_consolidated_checkpoint_is_a_plain_state_dict(saved):
    root, _ = saved
    full = checkpoint.consolidate(os.path.join(root, "zero3"))
    model = W.build_model(KIND, seed=5)
    model.load_state_dict(full["model"])  # strict: every key, tied aliases included
    params = dict(model.named_parameters())
    assert sorted(full["optimizer"]) == sorted(params)
    for name, state in full["optimizer"].items():
        assert state["exp_avg"].shape == params[name].shape
        assert int(state["step"]) == 2


def test_a_save_killed_half_way_is_refused(tmp_path):
    folder = str(tmp_path / "ckpt")
    with pytest.raises(zerolab.WorkerError):
        zerolab.launch(F.save_killed_half_way, 2, args=("zero2", KIND, folder), timeout=60)
    # A partial version is left (rank 1 wrote its file), and refused.
    assert os.path.exists(os.path.join(folder, "save-000001", "rank1.pt"))
    with pytest.raises(checkpoint.CheckpointError,
                       match="save-000001 did not finish"):
        checkpoint.consolidate(folder)


def test_a_save_killed_over_a_good_checkpoint_leaves_the_good_one_loadable(tmp_path):
    folder = str(tmp_path / "ckpt")
    zerolab.launch(F.save_after, 2, args=("zero2", KIND, folder, 1))
    good = checkpoint.consolidate(folder)
    with pytest.raises(zerolab.WorkerError):
        zerolab.launch(F.save_killed_half_way, 2, args=("zero2", KIND, folder), timeout=60)
    assert os.path.exists(os.path.join(folder, "save-000002", "rank1.pt"))  # the crashed one
    after = checkpoint.consolidate(folder)  # still the first save, whole
    assert max_diff(after["model"], good["model"]) == 0
    # The next save goes past the crashed version, and replaces both.
    zerolab.launch(F.save_after, 2, args=("zero2", KIND, folder, 2))
    assert sorted(os.listdir(folder)) == ["LATEST", "save-000003"]
    assert max_diff(checkpoint.consolidate(folder)["model"], good["model"]) > 0


def test_a_missing_rank_file_is_refused(tmp_path):
    folder = str(tmp_path / "ckpt")
    zerolab.launch(F.save_after, 2, args=("zero1", KIND, folder, 1))
    os.remove(os.path.join(checkpoint.latest(folder), "rank1.pt"))
    with pytest.raises(checkpoint.CheckpointError, match="rank1.pt is missing"):
        checkpoint.consolidate(folder)


def test_checkpoints_move_between_world_sizes_and_stages(tmp_path):
    """Save at 4 ranks (ZeRO-3, HSDP); resume at 2 with ZeRO-2 and at 3 with HSDP: the run
    continues as if nothing happened."""
    straight = zerolab.launch(nodes.save_at_4, 4, args=(str(tmp_path),), timeout=600)[0]
    resumed = {
        "zero3 at 4 -> zero2 at 2": zerolab.launch(nodes.resume, 2, args=(
            "zero2", f"{tmp_path}/zero3"), timeout=600),
        "zero3 at 4 -> hsdp (3 per node) at 3": zerolab.launch(nodes.resume_hsdp, 3, args=(
            f"{tmp_path}/zero3", 3), timeout=600),
        "hsdp at 4 -> zero3 at 2": zerolab.launch(nodes.resume, 2, args=(
            "zero3", f"{tmp_path}/hsdp"), timeout=600),
    }
    for what, states in resumed.items():
        for state in states:
            assert max_diff(state, straight) < 1e-5, what
