"""zerolab/launcher/pool.py: zygotes shared by a process tree. Processes that inherit the pool's
folder fork their ranks from its zygotes, each served as its own zygote would serve it; a
caller that dies takes only its own ranks along; a caller the pool cannot serve starts its own."""

import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from workers import launch as launch_workers

import zerolab
from zerolab.launcher import pool, zygote

TESTS = Path(__file__).resolve().parent
pytestmark = pytest.mark.usefixtures("no_pool")  # this file's own pool, not the session's


@pytest.fixture(scope="module")
def shared(no_pool):
    """A pool of two rank zygotes and one of a fixed seed, named in this process's environment."""
    with pool.Pool(ranks=2, seeds=(7,)) as p:
        yield p
        zygote.Zygote.close_all()


def pids_of(p: pool.Pool) -> list[int]:
    return [z.process.pid for z in p.zygotes]


def caller_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from workers import launch as launch_workers
        import zerolab
        from zerolab.launcher import zygote

        if __name__ == "__main__":
    """) + textwrap.indent(textwrap.dedent(body), "    "))
    return script


def wait_until(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ranks_of_this_process_and_of_a_child_fork_from_the_pool(shared, tmp_path):
    ranks = pids_of(shared)[:2]
    seen = zerolab.launch(launch_workers.where_am_i, 2, args=("workers",))
    assert [rank["ppid"] for rank in seen] == ranks
    assert [z.process.pid for z in zygote.Zygote.for_ranks(2)] == ranks
    # A child process inherits the pool: its rank 0 and 1 come from the pool's zygotes (the
    # same seeds, so the same string order), its rank 2 from a zygote of its own.
    script = caller_script(tmp_path, """
        seen = zerolab.launch(launch_workers.where_am_i, 3, args=("workers",))
        order = zerolab.launch(launch_workers.set_order, 3)
        own = zygote.Zygote.for_ranks(3)[2].process.pid
        print([rank["ppid"] for rank in seen], own, order[0] == order[1], sep="|")
    """)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ppids, own, same = out.stdout.strip().split("|")
    assert eval(ppids) == [*ranks, int(own)] and int(own) not in pids_of(shared)
    assert same == "False"  # rank 0 and rank 1 hash strings differently, as under torchrun
    again = zerolab.launch(launch_workers.set_order, 2)  # the pool's seeds stay: the same order
    assert zerolab.launch(launch_workers.set_order, 2) == again


def test_a_caller_killed_takes_its_ranks_and_folder_not_anothers(shared, tmp_path):
    script = caller_script(tmp_path, f"""
        zerolab.launch(launch_workers.sleep_and_note_pid, 2, args=({str(tmp_path)!r},),
                       timeout=600)
    """)
    caller = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        assert wait_until(lambda: all((tmp_path / f"rank-{r}").exists() for r in (0, 1))), \
            "the ranks did not start"
        ranks = [int((tmp_path / f"rank-{r}").read_text()) for r in (0, 1)]
        assert [psutil.Process(pid).ppid() for pid in ranks] == pids_of(shared)[:2]
        # The launch's folder: the one whose owner file names the caller (leftovers.py).
        [workdir] = [path for path in Path(tempfile.gettempdir()).glob("zerolab-launch-*")
                     if (path / "owner").read_text().startswith(f"{caller.pid}.")]
        caller.kill()
        caller.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in ranks), timeout=30)
        assert wait_until(lambda: not workdir.exists(), timeout=30)
        # The pool's zygotes serve on: this process's launches, and a fresh connection's.
        assert all(alive(pid) for pid in pids_of(shared))
        assert zerolab.launch(launch_workers.all_reduce_rank, 2)[0].item() == 3.0
    finally:
        caller.kill()


def test_ranks_running_are_ours_only(shared, tmp_path):
    zerolab.launch(launch_workers.rank_and_size, 1)  # connected to the pool's rank-0 zygote
    script = caller_script(tmp_path, f"""
        zerolab.launch(launch_workers.sleep_and_note_pid, 1, args=({str(tmp_path)!r},),
                       timeout=600)
    """)
    caller = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        assert wait_until(lambda: (tmp_path / "rank-0").exists()), "the rank did not start"
        theirs = int((tmp_path / "rank-0").read_text())
        assert psutil.Process(theirs).ppid() == pids_of(shared)[0]
        assert theirs not in zerolab.launcher.local.running_ranks()
    finally:
        caller.kill()


def test_a_caller_the_pool_cannot_serve_starts_its_own(shared, tmp_path):
    # A fixed PYTHONHASHSEED (the pool's zygotes have seeds of their own), and another copy of
    # zerolab than the pool imported: each starts its own zygote.
    script = caller_script(tmp_path, """
        print(zerolab.launch(launch_workers.where_am_i, 1, args=("workers",))[0]["ppid"])
    """)
    copy = tmp_path / "copy"
    (copy / "zerolab").mkdir(parents=True)
    for path in (TESTS.parent / "zerolab").rglob("*.py"):
        target = copy / "zerolab" / path.relative_to(TESTS.parent / "zerolab")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    for env in ({**os.environ, "PYTHONHASHSEED": "5"},
                {**os.environ, "PYTHONPATH": str(copy)}):
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) not in pids_of(shared)
    # A seed the pool was started with is served to whoever asks for it (the grader's hosts).
    fixed = zygote.Zygote(hash_seed=7)
    fixed._wait_ready()
    assert fixed.process.pid == pids_of(shared)[2]
    fixed.close()
    assert alive(pids_of(shared)[2])


def test_a_closed_pool_ends_its_zygotes_and_folder(no_pool):
    p = pool.Pool(ranks=1)
    assert os.environ[pool.POOL_ENV] == p.folder
    zygotes = pids_of(p)
    p.close()
    assert pool.POOL_ENV not in os.environ and not os.path.exists(p.folder)
    assert wait_until(lambda: not any(alive(pid) for pid in zygotes), timeout=30)
