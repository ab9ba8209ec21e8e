"""Checkpoints (zerolab.checkpoint) in torch's DCP format, every engine: resumed exactly at the
same world size, resharded to another world size and into another engine (every engine saves
at 4 ranks and is loaded at 1, 2 and 3), read by a plain single-process model and by FSDP2
(fully_shard), and FSDP2's read by zerolab; a save that crashed half-way refused or left
behind; one writer per folder; every damaged file refused by name.

(Notebook 09b's checkpoints, what it prints about them, are tested in test_lesson_n09_saves.py.)
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket

import pytest
import torch
from workers import checkpoints as C
from workers import engines as W
from workers import features as F
from workers import nodes
from workers.features import KIND, STAGES

import zerolab
from zerolab import checkpoint
from zerolab.harness import max_diff
from zerolab.lessons.n09_dcp import optimizer_diff as _optimizer_diff


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of every stage after 2 steps at N=2, with the uninterrupted 5-step runs."""
    root = str(tmp_path_factory.mktemp("checkpoints"))
    return root, zerolab.launch(F.save_train_resume, 2, args=(STAGES, KIND, root), timeout=300)


def test_checkpoint_resumes_exactly_at_the_same_world_size(saved):
    root, results = saved
    for engine_key in STAGES:
        path = checkpoint.latest(os.path.join(root, engine_key))
        assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
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


# ---- torch's format: a plain model, FSDP2 ----------------------------------------------------


def test_zero3_checkpoint_is_a_plain_models_state_dict(saved, tmp_path):
    """dcp_to_torch_save gives a file whose "model" a plain GPT loads (strict) exactly."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, results = saved
    dcp_to_torch_save(checkpoint.latest(os.path.join(root, "zero3")), tmp_path / "plain.pt")
    full = torch.load(tmp_path / "plain.pt")
    model = W.build_model(KIND, seed=5)
    model.load_state_dict(full["model"])  # strict: every key, the tied head's name included
    assert max_diff(model.state_dict(), results[0]["zero3"]["saved"]) == 0
    params = dict(model.named_parameters())  # a tied weight once: FSDP2's optimizer keys
    assert sorted(full["optimizer"]["state"]) == sorted(params)
    for name, state in full["optimizer"]["state"].items():
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
        assert state["exp_avg"].shape == params[name].shape and int(state["step"]) == 2
    (group,) = full["optimizer"]["param_groups"]
    assert group["lr"] == W.LR and group["weight_decay"] == 0.1
    assert sorted(group["params"]) == sorted(params)
    assert max_diff(checkpoint.consolidate(os.path.join(root, "zero3"))["model"],
                    full["model"]) == 0


@pytest.fixture(scope="module")
def fsdp2(saved, tmp_path_factory):
    """At 2 ranks, FSDP2 loads zerolab's ZeRO-3 checkpoint; then trains and saves its own."""
    root, _ = saved
    folder = str(tmp_path_factory.mktemp("fsdp2") / "dcp")
    return folder, zerolab.launch(C.fsdp2_both_ways, 2, args=(
        os.path.join(root, "zero3"), folder), timeout=300)[0]


def test_zero3_checkpoint_loads_into_fsdp2_exactly(saved, fsdp2):
    root, results = saved
    loaded = fsdp2[1]["loaded"]
    assert max_diff(loaded["model"], results[0]["zero3"]["saved"]) == 0
    saved_state = checkpoint.consolidate(os.path.join(root, "zero3"))["optimizer"]["state"]
    assert _optimizer_diff(loaded["optimizer"], saved_state) == 0


def test_fsdp2_checkpoint_loads_into_zerolab_exactly(fsdp2, tmp_path):
    """FSDP2 at 2 ranks -> ZeRO-3, ZeRO-2, DDP at 3; saved again, the state is FSDP2's."""
    folder, fsdp = fsdp2
    runs = zerolab.launch(C.zerolab_from_fsdp2, 3, args=(folder, str(tmp_path)), timeout=300)
    for key, run in runs[0].items():
        assert max_diff(run["full"], fsdp["saved"]["model"]) == 0, key
        # the param groups' options come back too, as torch's load_state_dict does
        assert run["lr"] == fsdp["saved"]["groups"][0]["lr"] != 1.0
        again = checkpoint.consolidate(os.path.dirname(run["path"]))
        assert _optimizer_diff(again["optimizer"]["state"], fsdp["saved"]["optimizer"]) == 0


# ---- every engine, every world size -----------------------------------------------------------


@pytest.fixture(scope="module")
def every_engine(tmp_path_factory):
    """Every engine saves at 4 ranks; each checkpoint is loaded into another engine at 1, 2
    and 3 ranks (and saved again)."""
    root = str(tmp_path_factory.mktemp("every_engine"))
    savers = zerolab.launch(C.save_every_engine, 4, args=(root,), timeout=600)[0]
    loaders = {n: zerolab.launch(C.load_every_checkpoint, n, args=(root,), timeout=600)
               for n in (1, 2, 3)}
    return root, savers, loaders


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equal, each pair in the lower of their two precisions (a bf16 engine holds its
    frozen parameters and buffers in bf16: no fp32 copy of them exists)."""
    assert sorted(a) == sorted(b)
    return all(torch.equal(a[k].to(_lower(a[k], b[k])), b[k].to(_lower(a[k], b[k]))) for k in a)


def _lower(x: torch.Tensor, y: torch.Tensor) -> torch.dtype:
    return x.dtype if x.element_size() <= y.element_size() else y.dtype


def test_every_engine_saves_what_it_holds(every_engine):
    root, savers, _ = every_engine
    for name, held in savers.items():
        saved = checkpoint.consolidate(os.path.join(root, name))
        assert _same(saved["model"], held), name
        steps = {int(s["step"]) for s in saved["optimizer"]["state"].values()}
        assert steps == {2}, name


@pytest.mark.parametrize("n", [1, 2, 3])
def test_every_engine_loads_into_another_at_every_world_size(every_engine, n):
    root, _, loaders = every_engine
    for name in C.SAVERS:
        saved = checkpoint.consolidate(os.path.join(root, name))
        for rank_result in loaders[n]:
            assert _same(rank_result[name], saved["model"]), (name, n, C.loader_of(name, n))
        again = checkpoint.consolidate(os.path.join(root, f"{name}-at-{n}"))
        assert _same(again["model"], saved["model"]), (name, n)
        assert _optimizer_diff(again["optimizer"]["state"],
                               saved["optimizer"]["state"]) == 0, (name, n)


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


# ---- crashes, other writers, damage ----------------------------------------------------------


def test_a_save_killed_half_way_is_refused(tmp_path):
    folder = str(tmp_path / "ckpt")
    with pytest.raises(zerolab.WorkerError):
        zerolab.launch(F.save_killed_half_way, 2, args=("zero2", KIND, folder), timeout=60)
    # A partial version is left (every rank wrote its file, no manifest), and refused.
    assert sorted(os.listdir(os.path.join(folder, "save-000001"))) == [
        "__0_0.distcp", "__1_0.distcp"]
    with pytest.raises(checkpoint.CheckpointError, match="save-000001 did not finish"):
        checkpoint.consolidate(folder)


def test_a_save_killed_over_a_good_checkpoint_leaves_the_good_one_loadable(tmp_path):
    folder = str(tmp_path / "ckpt")
    zerolab.launch(F.save_after, 2, args=("zero2", KIND, folder, 1))
    good = checkpoint.consolidate(folder)
    with pytest.raises(zerolab.WorkerError):
        zerolab.launch(F.save_killed_half_way, 2, args=("zero2", KIND, folder), timeout=60)
    assert os.path.exists(os.path.join(folder, "save-000002", "__1_0.distcp"))  # the crashed
    after = checkpoint.consolidate(folder)  # still the first save, whole
    assert max_diff(after["model"], good["model"]) == 0
    # The next save goes past the crashed version, and replaces both. (Each launch is a new
    # job: the lock of the one before ended with its process.)
    zerolab.launch(F.save_after, 2, args=("zero2", KIND, folder, 2))
    assert sorted(os.listdir(folder)) == ["LATEST", "LOCK", "save-000003"]
    assert max_diff(checkpoint.consolidate(folder)["model"], good["model"]) > 0


def test_one_writer_per_folder(tmp_path):
    """Another job (here, this test's process) holds the folder: a save is refused on every
    rank, naming that job; once it lets go, the save goes through."""
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    assert checkpoint.lock(folder) is None
    try:
        with pytest.raises(zerolab.WorkerError) as refused:
            zerolab.launch(F.save_after, 2, args=("zero2", KIND, folder, 1), timeout=120)
    finally:
        checkpoint.unlock(folder)
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}, saving here since" in message
    assert "Save into another folder, or wait for that job to end" in message
    assert not [n for n in os.listdir(folder) if n.startswith("save-")]  # nothing written
    zerolab.launch(F.save_after, 2, args=("zero2", KIND, folder, 1), timeout=120)
    assert os.path.exists(os.path.join(folder, "LATEST"))


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _truncate(path: str, keep: float) -> None:
    with open(path, "rb") as f:
        data = f.read()
    _write(path, data[:int(len(data) * keep)])


def _drop_rank_part(version: str, rank_file: str) -> None:
    """Edit the manifest: forget the chunks that `rank_file` holds of the first model tensor
    that two ranks share."""
    path = os.path.join(version, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    files: dict[str, set[str]] = {}
    for i, info in metadata.storage_data.items():
        files.setdefault(i.fqn, set()).add(info.relative_path)
    key = next(k for k, fs in files.items() if k.startswith("model.") and len(fs) == 2)
    md = metadata.state_dict_metadata[key]
    gone = [i for i, info in metadata.storage_data.items()
            if i.fqn == key and info.relative_path == rank_file]
    md.chunks = [c for c in md.chunks if all(c.offsets != i.offset for i in gone)]
    for i in gone:
        del metadata.storage_data[i]
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


AGAIN = "Load an earlier version"
FIX_LATEST = "Write into"
V = "save-000001"
# fault -> (how to do it to a copy of a 2-rank ZeRO-3 checkpoint, what the error must say)
FAULTS = {
    "LATEST names ../": (lambda f: _write(f"{f}/LATEST", b"../zero2/save-000001"),
                         r"LATEST names '\.\./zero2/save-000001', not a version folder of .* "
                         r"LATEST never leaves its own folder", FIX_LATEST),
    "LATEST names an absolute path": (lambda f: _write(f"{f}/LATEST", f"{f}/{V}".encode()),
                                      r"not a version folder", FIX_LATEST),
    "LATEST is garbage": (lambda f: _write(f"{f}/LATEST", b"\x00\x01 hello"),
                          r"not a version folder", FIX_LATEST),
    "LATEST is not UTF-8": (lambda f: _write(f"{f}/LATEST", b"\xff\xfe save"),
                            r"LATEST is damaged: not UTF-8 text", FIX_LATEST),
    "LATEST names a missing version": (lambda f: _write(f"{f}/LATEST", b"save-000009"),
                                       r"names save-000009, which is not in", FIX_LATEST),
    "LATEST is missing": (lambda f: os.remove(f"{f}/LATEST"),
                          rf"LATEST is missing .* yet {V} has a manifest", "write its name"),
    "the manifest is missing": (lambda f: os.remove(f"{f}/{V}/.metadata"),
                                r"\.metadata is missing .* the save did not finish", AGAIN),
    "the manifest is empty": (lambda f: _write(f"{f}/{V}/.metadata", b""),
                              r"\.metadata is empty", AGAIN),
    "the manifest is garbage": (lambda f: _write(f"{f}/{V}/.metadata", b"{not: a manifest}"),
                                r"\.metadata is damaged: not a DCP manifest", AGAIN),
    "the manifest is truncated": (lambda f: _truncate(f"{f}/{V}/.metadata", 0.5),
                                  r"\.metadata is damaged: not a DCP manifest", AGAIN),
    "a rank file is missing": (lambda f: os.remove(f"{f}/{V}/__1_0.distcp"),
                               r"__1_0\.distcp is missing", AGAIN),
    "a rank file is empty": (lambda f: _write(f"{f}/{V}/__1_0.distcp", b""),
                             r"__1_0\.distcp is empty: 0 bytes", AGAIN),
    "a rank file is truncated": (lambda f: _truncate(f"{f}/{V}/__1_0.distcp", 0.9),
                                 r"__1_0\.distcp is truncated", AGAIN),
    "the manifest lacks a rank's part": (
        lambda f: _drop_rank_part(f"{f}/{V}", "__1_0.distcp"),
        r"model\.\S+ is not whole: its chunks cover [\d,]+ of its [\d,]+ "
        r"elements \(a rank's part is missing from the manifest\)", AGAIN),
}


@pytest.fixture
def damaged(saved, tmp_path):
    """A fresh copy of the 2-rank ZeRO-3 checkpoint, for each fault to damage."""
    root, _ = saved
    copy = str(tmp_path / "zero3")
    shutil.copytree(os.path.join(root, "zero3"), copy)
    assert os.path.basename(checkpoint.latest(copy)) == V
    return copy


@pytest.mark.parametrize("fault", FAULTS)
def test_a_damaged_checkpoint_is_refused_by_name(damaged, fault):
    damage, says, what_to_do = FAULTS[fault]
    damage(damaged)
    with pytest.raises(checkpoint.CheckpointError, match=says) as refused:
        checkpoint.consolidate(damaged)
    assert what_to_do in str(refused.value)


def test_every_rank_refuses_a_damaged_checkpoint(damaged):
    """On 2 ranks, every rank raises CheckpointError (none is left waiting in DCP's
    collectives): a truncated rank file."""
    FAULTS["a rank file is truncated"][0](damaged)
    with pytest.raises(zerolab.WorkerError, match=r"CheckpointError.*__1_0\.distcp is truncated"):
        zerolab.launch(C.load_into_zero3, 2, args=(KIND, damaged), timeout=120)
