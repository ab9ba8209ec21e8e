"""Helpers for test_launch.py: scripts run as a learner runs them, a rank made slow, and the
ranks this process has running.

The slow rank stands in for a busy machine, where one rank can be descheduled for a long
moment while its peers run on: `slow_rank_worker` replaces zerolab.launch's own `_worker` (the
test patches it in) and makes rank 1 take SLOW seconds longer to set up its process group and
to run the function. Each rank writes when it passed each point to files in $ZEROLAB_TEST_TIMES.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import torch.distributed as dist

from zerolab.launcher import local, pool, zygote

SLOW = 2.0  # seconds: far above the scheduling noise of a loaded machine, short for a test


def note(point: str) -> None:
    """Record, in $ZEROLAB_TEST_TIMES, when this rank passed `point`."""
    path = Path(os.environ["ZEROLAB_TEST_TIMES"]) / f"{point}-{os.environ['RANK']}"
    path.write_text(repr(time.time()))


def times(folder: Path, point: str, world_size: int) -> list[float]:
    return [float((folder / f"{point}-{r}").read_text()) for r in range(world_size)]


def slow_rank_worker(*args) -> None:
    """zerolab.launch's worker, with rank 1 slow to finish setting up its group."""
    rank = args[1]
    init, destroy = dist.init_process_group, dist.destroy_process_group

    def init_slowly(*a, **k):
        init(*a, **k)
        if rank == 1:
            time.sleep(SLOW)
        note("group_up")

    def destroy_noted():
        note("teardown")
        destroy()

    dist.init_process_group, dist.destroy_process_group = init_slowly, destroy_noted
    local._worker(*args)


def noted_function() -> int:
    """The function the ranks run: rank 1 is slow here too."""
    note("fn_start")
    if dist.get_rank() == 1:
        time.sleep(SLOW)
    note("fn_end")
    return dist.get_rank()


def run_script(folder: Path, source: str, env: dict, *, stdin: bool = False,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `source` as a learner would: `python script.py`, or piped into `python -`."""
    source = textwrap.dedent(source)
    script = folder / "script.py"
    script.write_text(source)
    command = [sys.executable, "-"] if stdin else [sys.executable, str(script)]
    return subprocess.run(command, input=source if stdin else None, capture_output=True,
                          text=True, env=env, cwd=folder, timeout=timeout)


def is_zygote(process: psutil.Process) -> bool:
    return any("zerolab.launcher.zygote" in part for part in process.cmdline())


def spawned_children() -> list[psutil.Process]:
    """This process's living ranks: forked by its zygote, or spawned (the zygote itself, which
    stays for the next launch, and multiprocessing's resource tracker are not ranks)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if (any("spawn_main" in part for part in child.cmdline())
                    or (is_zygote(child.parent()) and not is_zygote(child))):
                out.append(child)
        except psutil.ZombieProcess:
            out.append(child)  # exited but never reaped: left behind as well
        except psutil.NoSuchProcess:
            pass  # gone between listing and looking
    # Ranks that a pool's zygote forked for this process (zerolab/launcher/pool.py): the pool's
    # children, not ours.
    for forker in zygote.Zygote.running():
        if isinstance(forker.process, pool.PoolZygote):
            for pid in forker.ranks_running():
                with contextlib.suppress(psutil.NoSuchProcess):
                    out.append(psutil.Process(pid))
    return out


# The same scripts where no zygote can run (not Linux): the ranks are spawned, fresh Pythons.
SPAWNED = """\
from zerolab.launcher import zygote


def no_zygote(world_size):
    raise zygote.ZygoteUnavailable("spawned ranks, for this test")


zygote.Zygote.for_ranks = no_zygote
"""


# --- callers that get killed, and what they leave (test_launch_cleanup.py) ---------------------

CALLER = """\
import faulthandler
import signal
import sys
faulthandler.register(signal.SIGUSR2, all_threads=True)  # where it is, should a test time out
# Ctrl-C as a terminal delivers it: a shell without job control starts a background job
# (`make test &`) with SIGINT ignored, every process below inherits that, and Python keeps it.
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, {tests!r})
from workers import launch as launch_workers
import zerolab

if __name__ == "__main__":
    zerolab.launch(launch_workers.start_children, 2, args=({notes!r}, {then!r}), timeout=600)
"""


def start_caller(folder: Path, notes: Path, tmpdir: Path, then: str = "sleep",
                 new_session: bool = False) -> subprocess.Popen:
    """A script that launches 2 ranks which start children and then `then` (see
    workers.launch.start_children), its temporary files in `tmpdir`."""
    script = folder / "caller.py"
    script.write_text(CALLER.format(tests=str(Path(__file__).parent), notes=str(notes),
                                    then=then))
    env = dict(os.environ, TMPDIR=str(tmpdir))
    return subprocess.Popen([sys.executable, str(script)], cwd=folder, env=env,
                            start_new_session=new_session, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def where_stuck(caller: subprocess.Popen) -> str:
    """A caller that did not exit in time: its signal masks, what it waits in, its Python
    stacks (faulthandler, on SIGUSR2), and what it printed; it is killed."""
    try:
        with open(f"/proc/{caller.pid}/status") as f:
            masks = "".join(line for line in f if line.startswith(("State", "Sig", "Threads")))
        with open(f"/proc/{caller.pid}/wchan") as f:
            masks += f"wchan: {f.read()}\n"
    except OSError as e:
        masks = f"no /proc entry: {e}\n"
    try:
        children = [f"{c.pid} {c.status()} {' '.join(c.cmdline())[:80]}"
                    for c in psutil.Process(caller.pid).children(recursive=True)]
    except psutil.Error as e:  # it exited, or a child did, while we looked
        children = [f"could not list them: {e!r}"]
    caller.send_signal(signal.SIGUSR2)
    time.sleep(1)
    caller.kill()
    out, _ = caller.communicate()
    return masks + "children:\n  " + "\n  ".join(children) + "\noutput:\n" + (out or "")


def wait_until(condition, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def started(notes: Path, world_size: int = 2) -> dict[str, list[int]]:
    """Once every rank has noted its pid and its children's: {"ranks": [...], "kids": [...]}."""
    assert wait_until(lambda: all((notes / f"kids-{r}").exists() for r in range(world_size))), \
        "the ranks did not start"
    return {"ranks": [int((notes / f"rank-{r}").read_text()) for r in range(world_size)],
            "kids": [int(p) for r in range(world_size)
                     for p in (notes / f"kids-{r}").read_text().split()]}


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
