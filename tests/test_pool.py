"""zerolab/launcher/pool.py: zygotes shared by a process tree. Processes that inherit the pool's
folder fork their ranks from its zygotes, each served as its own zygote would serve it; a
caller that dies takes only its own ranks along; a caller the pool cannot serve starts its own."""

import os
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from launch_helpers import alive, wait_until
from workers import launch as launch_workers

import zerolab
from zerolab.grading.defaults import HASH_SEEDS
from zerolab.launcher import pool, zygote

TESTS = Path(__file__).resolve().parent


@dataclass
class Shared:
    rank_pids: list[int]  # the pool's zygotes of ranks 0 and 1
    seed: int  # a fixed seed the pool serves (the grader's hosts ask for theirs)
    seed_pid: int  # its zygote


@pytest.fixture(scope="module")
def shared():
    """A pool named in this process's environment: `make test`'s own (xdist), else one of this
    module's, with two rank zygotes and one of a fixed seed."""
    own = None
    if not pool.seeds():
        own = pool.Pool(ranks=2, seeds=(HASH_SEEDS[0],))
    zygote.Zygote.close_all()  # connect anew, to the pool
    rank_pids = [z.process.pid for z in zygote.Zygote.for_ranks(2)]
    fixed = zygote.Zygote(hash_seed=HASH_SEEDS[0])
    yield Shared(rank_pids, HASH_SEEDS[0], fixed.process.pid)
    fixed.close()
    if own is not None:
        zygote.Zygote.close_all()
        own.close()


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


def test_ranks_of_this_process_and_of_a_child_fork_from_the_pool(shared, tmp_path):
    ranks = shared.rank_pids
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
    assert eval(ppids) == [*ranks, int(own)] and int(own) not in [*ranks, shared.seed_pid]
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
        assert [psutil.Process(pid).ppid() for pid in ranks] == shared.rank_pids
        # The launch's folder: the one whose owner file names the caller (leftovers.py).
        [workdir] = [path for path in Path(tempfile.gettempdir()).glob("zerolab-launch-*")
                     if (path / "owner").read_text().startswith(f"{caller.pid}.")]
        caller.kill()
        caller.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in ranks), timeout=30)
        assert wait_until(lambda: not workdir.exists(), timeout=30)
        # The pool's zygotes serve on: this process's launches, and a fresh connection's.
        assert all(alive(pid) for pid in [*shared.rank_pids, shared.seed_pid])
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
        assert psutil.Process(theirs).ppid() == shared.rank_pids[0]
        assert theirs not in zerolab.launcher.local.running_ranks()
    finally:
        caller.kill()


def test_a_caller_the_pool_cannot_serve_starts_its_own(shared, tmp_path):
    # A fixed PYTHONHASHSEED (the pool's zygotes have seeds of their own), another copy of
    # zerolab than the pool imported, a pool that has gone: each starts its own zygote.
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
                {**os.environ, "PYTHONPATH": str(copy)},
                {**os.environ, pool.POOL_ENV: str(tmp_path / "a pool that has gone")}):
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) not in [*shared.rank_pids, shared.seed_pid]
    # A seed the pool was started with is served to whoever asks for it (the grader's hosts).
    fixed = zygote.Zygote(hash_seed=shared.seed)
    fixed._wait_ready()
    assert fixed.process.pid == shared.seed_pid
    fixed.close()
    assert alive(shared.seed_pid)


def test_a_closed_pool_ends_its_zygotes_and_folder(no_pool):
    p = pool.Pool(ranks=1)
    assert os.environ[pool.POOL_ENV] == p.folder
    zygotes = [z.process.pid for z in p.zygotes]
    p.close()
    assert pool.POOL_ENV not in os.environ and not os.path.exists(p.folder)
    assert wait_until(lambda: not any(alive(pid) for pid in zygotes), timeout=30)
