"""Gradient accumulation, global-norm clipping, mixed precision and checkpoints, every stage."""

from __future__ import annotations

import os

import pytest
import torch
from workers import engines as W
from workers import features as F

import zerolab
from zerolab import checkpoint, harness
from zerolab.harness import max_diff

STAGES = ["ddp", "zero1", "zero2", "zero3"]
KIND = "gpt"  # tied weights; the MLP (frozen, tiny, reused) is covered by test_engines




# ---- gradient accumulation ---------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def accumulated(request):
    return request.param, zerolab.launch(F.accumulate, request.param, args=(STAGES, KIND),
                                         timeout=300)


def test_accumulation_equals_one_big_batch(accumulated):
    """4 micro-batches with no_sync() then one synced == one step on the 4x batch."""
    n, results = accumulated
    reference = F.reference_big_batch(KIND)
    yardstick = max_diff(results[0]["torch_ddp"], reference)
    for engine_key in STAGES:
        for rank, res in enumerate(results):
            diff = max_diff(res[engine_key]["state"], reference)
            assert diff <= W.YARDSTICK_MULTIPLE * yardstick, (engine_key, rank, diff, yardstick)
            if n == 2:  # sums of two are exact: bitwise equal to torch's DDP.no_sync()
                assert diff == yardstick, engine_key


def test_no_reduction_inside_no_sync(accumulated):
    _, results = accumulated
    for engine_key in STAGES:
        assert results[0][engine_key]["reductions_inside_no_sync"] == 0, engine_key


# ---- global-norm clipping ----------------------------------------------------------------------

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


# ---- mixed precision ---------------------------------------------------------------------------

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


# ---- checkpoints -------------------------------------------------------------------------------

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


@pytest.mark.parametrize("rows, micro_batches", [(5, 2), (4, 0), (3, 4)])
def test_micro_batches_that_do_not_divide_the_batch_are_refused(rows, micro_batches):
    """Unequal micro-batches, each loss divided by their count, would not give the mean."""
    x = y = torch.zeros(rows, 3)
    with pytest.raises(ValueError, match=f"micro_batches={micro_batches} must divide the "
                                         f"batch's {rows} rows"):
        harness.train_step(None, x, y, torch.nn.functional.mse_loss,
                           micro_batches=micro_batches)
