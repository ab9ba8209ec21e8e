"""zerolab/launcher/zygote.py: ranks forked by a helper that has imported torch, as a spawned rank
would
be in all that a learner can see; the helper and its ranks die with their caller."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import launch_helpers
import psutil
import pytest
from launch_helpers import alive, wait_until
from workers import launch as launch_workers

import zerolab
from zerolab.launcher import local, zygote

# Zygotes of this process's own: the pool of `make test` would hide what these tests check.
pytestmark = pytest.mark.usefixtures("no_pool")

TESTS = Path(__file__).resolve().parent


def zygotes_of(process: psutil.Process, count: int) -> list[psutil.Process]:
    """The caller's zygotes (one per rank index it launched)."""
    found = [c for c in process.children() if launch_helpers.is_zygote(c)]
    assert len(found) == count, found
    return found


def test_a_rank_sees_the_callers_environment_directory_and_path_as_they_are_now(
        tmp_path, monkeypatch):
    zerolab.launch(launch_workers.rank_and_size, 1)  # the zygote is up before anything changes
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")  # created after the zygote started
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZEROLAB_PROBE", "set after the zygote started")
    seen = zerolab.launch(launch_workers.where_am_i, 2, args=("probe_module",))
    forkers = zygote.Zygote.for_ranks(2)
    for rank, forker in zip(seen, forkers):
        assert rank["probe"] == "set after the zygote started"
        assert rank["cwd"] == str(tmp_path)
        assert rank["module"] == str(tmp_path / "probe_module.py")
        assert rank["ppid"] == forker.process.pid  # forked by its zygote, not spawned by us
    assert len({rank["pid"] for rank in seen}) == 2


def test_where_no_zygote_can_run_ranks_are_spawned(monkeypatch):
    def unavailable(world_size):
        raise zygote.ZygoteUnavailable("not here")

    monkeypatch.setattr(zygote.Zygote, "for_ranks", unavailable)
    seen = zerolab.launch(launch_workers.where_am_i, 2, args=("workers",))
    assert [rank["ppid"] for rank in seen] == [os.getpid()] * 2


def test_a_dead_zygote_is_replaced_and_a_rank_it_took_along_is_reported():
    zerolab.launch(launch_workers.rank_and_size, 1)
    first = zygote.Zygote.for_this_process()
    first.process.kill()
    first.process.wait()
    assert zerolab.launch(launch_workers.rank_and_size, 2) == [(0, 2, 1), (1, 2, 1)]
    second = zygote.Zygote.for_this_process()
    assert second is not first and second.process.poll() is None
    assert not os.path.exists(first._log_path)  # the dead one's log went with it


def test_the_zygote_and_its_ranks_die_with_their_caller(tmp_path):
    """The caller is killed outright (no clean-up of its own): the zygote sees its socket close
    and kills the ranks; were the zygote killed, its ranks would get SIGKILL from the kernel."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from workers import launch as launch_workers
        import zerolab

        if __name__ == "__main__":
            zerolab.launch(launch_workers.sleep_and_note_pid, 2, args=({str(tmp_path)!r},),
                           timeout=600)
    """))
    caller = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        assert wait_until(lambda: all((tmp_path / f"rank-{r}").exists() for r in (0, 1))), \
            "the ranks did not start"
        ranks = [int((tmp_path / f"rank-{r}").read_text()) for r in (0, 1)]
        helpers = [z.pid for z in zygotes_of(psutil.Process(caller.pid), 2)]
        assert sorted(psutil.Process(pid).ppid() for pid in ranks) == sorted(helpers)
        caller.kill()
        caller.wait()
        gone = [*helpers, *ranks]
        assert wait_until(lambda: not any(alive(pid) for pid in gone), timeout=30), \
            [pid for pid in gone if alive(pid)]
    finally:
        caller.kill()


def test_a_killed_zygote_takes_its_ranks_along(tmp_path):
    """Parent-death signal: ranks do not outlive the zygote that forked them."""
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from workers import launch as launch_workers
        import zerolab

        if __name__ == "__main__":
            try:
                zerolab.launch(launch_workers.sleep_and_note_pid, 2, args=({str(tmp_path)!r},),
                               timeout=600)
            except zerolab.WorkerError as e:
                print(str(e).splitlines()[0])
    """))
    caller = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: all((tmp_path / f"rank-{r}").exists() for r in (0, 1))), \
            "the ranks did not start"
        ranks = [int((tmp_path / f"rank-{r}").read_text()) for r in (0, 1)]
        zygotes_of(psutil.Process(caller.pid), 2)
        os.kill(psutil.Process(ranks[0]).ppid(), signal.SIGKILL)  # rank 0's zygote
        out, _ = caller.communicate(timeout=60)
        assert not any(alive(pid) for pid in ranks)
        assert "was killed by SIGKILL" in out, out
    finally:
        caller.kill()


def test_the_zygote_runs_a_single_thread_when_it_forks():
    """The fork is safe because the zygote has one thread. numpy's BLAS would start one at
    import (it stops it around a fork, but nothing else need be that careful)."""
    helper = zygote.Zygote()  # a new one, which has imported everything and forked nothing
    helper._wait_ready()
    try:
        assert psutil.Process(helper.process.pid).num_threads() == 1
    finally:
        helper.close()


def test_unseeded_random_numbers_differ_between_ranks_and_launches_as_in_new_processes():
    """Forked ranks would all inherit the zygote's generators; each draws its own seeds, as a
    spawned rank does (a lesson whose ranks build models without seeding relies on it)."""
    first = zerolab.launch(launch_workers.unseeded_draws, 2)
    second = zerolab.launch(launch_workers.unseeded_draws, 2)
    for generator in range(3):  # torch, numpy, random
        draws = [tuple(rank[generator]) for rank in (*first, *second)]
        assert len(set(draws)) == 4, (generator, draws)


def test_running_ranks_lists_the_ranks_of_a_launch_under_way_and_none_after(tmp_path):
    errors: list[BaseException] = []

    def run():
        try:
            zerolab.launch(launch_workers.sleep_and_note_pid, 2, args=(str(tmp_path),), timeout=8)
        except BaseException as e:  # the timeout, expected below
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: all((tmp_path / f"rank-{r}").exists() for r in (0, 1)))
    ranks = {int((tmp_path / f"rank-{r}").read_text()) for r in (0, 1)}
    assert ranks <= set(local.running_ranks())
    thread.join(timeout=120)
    assert len(errors) == 1 and isinstance(errors[0], zerolab.LaunchTimeout), errors
    assert local.running_ranks() == []


def test_a_process_forked_from_the_caller_gets_a_zygote_of_its_own(tmp_path):
    """Requests from two processes on one socket would mix: a child forked from a caller that
    has a zygote (a DataLoader worker, a user's own fork) starts its own."""
    zerolab.launch(launch_workers.rank_and_size, 1)
    ours = zygote.Zygote.for_this_process().process.pid
    out = tmp_path / "child"
    pid = os.fork()
    if pid == 0:  # the child: launch, say which zygote forked its ranks, leave at once
        code = 1
        try:
            seen = zerolab.launch(launch_workers.where_am_i, 1, args=("workers",))
            out.write_text(f"{seen[0]['ppid']} {zygote.Zygote.for_this_process().process.pid}")
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    rank_parent, its_zygote = map(int, out.read_text().split())
    assert rank_parent == its_zygote != ours
    assert zygote.Zygote.for_this_process().process.pid == ours  # ours is still ours


def test_ranks_hash_strings_as_separately_started_pythons_do(monkeypatch):
    """torchrun's ranks are new Pythons, each with its own string-hash seed: a set of names
    iterates in a different order on each, and collectives issued in that order hang. Ranks
    forked from one zygote would share its seed and agree; zerolab forks rank r from zygote r,
    each with a seed of its own, unless the caller fixed PYTHONHASHSEED (torchrun's ranks
    would inherit that one too)."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    orders = zerolab.launch(launch_workers.set_order, 4)
    assert len(set(orders)) > 1, orders  # 4 ranks agreeing by chance: 1 in ~(8!)**3
    seeds = {z.hash_seed for z in zygote.Zygote.for_ranks(4)}
    assert len(seeds) == 4  # one per rank index
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    for z in zygote.Zygote.running():
        z.close()  # new zygotes, started under the caller's fixed seed
    orders = zerolab.launch(launch_workers.set_order, 3)
    assert len(set(orders)) == 1, orders
    assert {z.hash_seed for z in zygote.Zygote.running()} == {"123"}
    for z in zygote.Zygote.running():
        z.close()  # the other tests' zygotes: random seeds again
