"""Nothing left behind (zerolab/launcher/leftovers.py): no rank, no child of a rank, no folder,
no zygote log, however a launch ends: success, failure, a hang, Ctrl-C, SIGTERM or SIGKILL of
the caller, caller and zygote killed together (cleaned by the next launch), arguments that
cannot be sent. Each caller that gets killed is a real process, killed with a real signal."""

import contextlib
import os
import signal
import subprocess
import tempfile
import time

import launch_helpers as helpers
import pytest
from workers import launch as launch_workers

import zerolab
from zerolab.launcher import leftovers

# Zygotes of this process's own: the pool of `make test` would hide what these tests check.
pytestmark = pytest.mark.usefixtures("no_pool")


@pytest.fixture
def tmpdir_here(tmp_path, monkeypatch):
    """This process's temporary files go to a folder of the test's own (others' launches run
    beside ours on this machine)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def all_gone(pids: list[int], timeout: float = 30) -> list[int]:
    """The pids still alive after waiting up to `timeout` for them to go."""
    helpers.wait_until(lambda: not any(helpers.alive(p) for p in pids), timeout)
    return [p for p in pids if helpers.alive(p)]


def launch_folders(tmpdir) -> list[str]:
    return [n for n in os.listdir(tmpdir) if n.startswith("zerolab-launch-")]


def left_in(tmpdir) -> list[str]:
    """What is in a temporary folder but torch's own compile cache (`torchinductor_<user>`,
    which torch makes whenever an optimizer is built, and keeps, as it does without zerolab)."""
    return [n for n in os.listdir(tmpdir) if not n.startswith("torchinductor_")]


@pytest.mark.parametrize("then, error", [("return", None), ("raise", zerolab.WorkerError),
                                         ("hang", zerolab.LaunchTimeout)])
def test_a_launch_ends_its_ranks_their_children_and_its_folder(then, error, tmp_path,
                                                               tmpdir_here):
    """Whether it succeeds, fails or hangs: each rank started a child in its process group
    and one in a session of its own (which a process-group kill misses: its mark finds it)."""
    if error is None:
        assert zerolab.launch(launch_workers.start_children, 2, args=(str(tmp_path), then)) \
            == [0, 1]
    else:
        with pytest.raises(error):
            zerolab.launch(launch_workers.start_children, 2, args=(str(tmp_path), then),
                           timeout=2)
    pids = helpers.started(tmp_path)
    assert all_gone(pids["ranks"] + pids["kids"], timeout=5) == []
    assert launch_folders(tmpdir_here) == []


def test_unpicklable_arguments_leave_nothing(tmpdir_here):
    with pytest.raises(ValueError, match=r"args\[0\] \(Unpicklable\) cannot be sent"):
        zerolab.launch(launch_workers.rank_and_size, 1, args=(launch_workers.Unpicklable(),))
    assert os.listdir(tmpdir_here) == []


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_caller_stopped_by_a_signal_leaves_nothing(how, tmp_path):
    """Ctrl-C: launch's own clean-up runs. SIGTERM, SIGKILL: no Python runs in the caller; its
    zygote sees it gone and cleans up for it (ranks, children, folders, its own log)."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    caller = helpers.start_caller(tmp_path, tmp_path, tmpdir)
    try:
        pids = helpers.started(tmp_path)
        zygote = [c.pid for c in helpers.psutil.Process(caller.pid).children()]
        caller.send_signal(getattr(signal, how))
        try:
            out, _ = caller.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the caller did not exit within 60 s of {how}:\n"
                        + helpers.where_stuck(caller))
        if how == "SIGINT":
            assert "KeyboardInterrupt" in out, out
        assert all_gone(pids["ranks"] + pids["kids"] + zygote) == []
        assert helpers.wait_until(lambda: left_in(tmpdir) == [], 30), left_in(tmpdir)
    finally:
        caller.kill()


def test_a_caller_that_does_not_exit_is_reported_with_where_it_waits(tmp_path):
    """The report the signal test fails with (helpers.where_stuck), on a caller still waiting
    for its ranks: its signal masks, its children, its Python stack; then it is gone."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    caller = helpers.start_caller(tmp_path, tmp_path, tmpdir)
    try:
        pids = helpers.started(tmp_path)
        report = helpers.where_stuck(caller)
        assert "SigIgn:" in report and "wchan:" in report, report
        assert all(str(p) in report for p in pids["kids"]), report  # its grandchildren listed
        assert "in _reap" in report and "in launch" in report, report  # faulthandler's stack
        assert caller.poll() is not None  # killed
        assert all_gone(pids["ranks"] + pids["kids"]) == []  # its zygote cleaned up after it
    finally:
        caller.kill()


def test_what_a_caller_killed_with_its_zygote_left_is_cleaned_by_the_next_launch(
        tmp_path, tmpdir_here):
    """The caller's whole process group killed (caller and zygote at once): the ranks die with
    the zygote, but their children, the launch's folder and the zygote's log stay, until the
    next launch on this machine finds that their owner is dead."""
    notes = tmp_path / "notes"
    notes.mkdir()
    caller = helpers.start_caller(tmp_path, notes, tmpdir_here, new_session=True)
    try:
        pids = helpers.started(notes)
        os.killpg(caller.pid, signal.SIGKILL)
        caller.wait(timeout=30)
        assert all_gone(pids["ranks"]) == []
        time.sleep(0.5)
        assert all(helpers.alive(p) for p in pids["kids"])  # orphans, for now
        left = sorted(left_in(tmpdir_here))
        assert len(launch_folders(tmpdir_here)) == 1 and any(
            n.startswith("zerolab-zygote-") for n in left), left
        assert zerolab.launch(launch_workers.rank_and_size, 1, threads=1) == [(0, 1, 1)]
        assert all_gone(pids["kids"], timeout=10) == []
        assert not any(n in os.listdir(tmpdir_here) for n in left)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(caller.pid, signal.SIGKILL)


def test_stale_leftovers_are_those_of_dead_owners_only(tmpdir_here):
    """A live owner's launch folder and zygote log are kept; a dead one's go; a folder of an
    older zerolab (no owner file) goes once it is a day old; one whose owner lives in another
    pid namespace (a container sharing /tmp) stays."""
    me = leftovers.owner_id()
    dead = "999999999.1." + me.split(".")[2]  # in this pid namespace: surely dead
    elsewhere = "999999999.1.1"  # another namespace's: not ours to judge
    for name, owner in [("zerolab-launch-mine", me), ("zerolab-launch-dead", dead),
                        ("zerolab-launch-elsewhere", elsewhere),
                        ("zerolab-launch-old", None), ("zerolab-launch-new", None)]:
        (tmpdir_here / name).mkdir()
        if owner:
            (tmpdir_here / name / "owner").write_text(owner)
    old = time.time() - 2 * leftovers.UNOWNED_AGE_S
    os.utime(tmpdir_here / "zerolab-launch-old", (old, old))
    for name in [f"zerolab-zygote-{me}-a.log", f"zerolab-zygote-{dead}-b.log",
                 "zerolab-zygote-c1x2.log", f"zerolab-progress-{dead}-d.jsonl", "other.txt"]:
        (tmpdir_here / name).write_text("")
    removed = leftovers.clean_stale()
    assert sorted(os.path.basename(p) for p in removed) == sorted([
        "zerolab-launch-dead", "zerolab-launch-old", f"zerolab-progress-{dead}-d.jsonl",
        f"zerolab-zygote-{dead}-b.log"])
    assert sorted(os.listdir(tmpdir_here)) == sorted([
        "other.txt", "zerolab-launch-elsewhere", "zerolab-launch-mine", "zerolab-launch-new",
        "zerolab-zygote-c1x2.log",
        f"zerolab-zygote-{me}-a.log"])
