"""The processes a learner's code runs in, started from hosts that have imported torch already.

Rank r of every grading run is forked by host r: a zygote (zerolab/launcher/zygote.py) started
with its own string-hashing seed, HASH_SEEDS[r]. A forked process keeps its parent's seed, so
ranks forked from one parent would all iterate a set of names in the same order; processes
started one by one (torchrun, or spawn) do not, and code that issues a collective per name in
set order then fails. Hosts with different seeds give the grader's ranks that difference. A
plain exercise runs in rank 0's process of a run of its own (or of world size 1).

The launcher's zygotes (one per rank index) draw random seeds; the grader's are fixed, so that
a verdict does not depend on the draw. The hosts a grading needs are started when it begins,
side by side (each imports torch: a few seconds, while the grader reads the course and runs on
the hosts already up), and live as long as this process. Where no zygote
can run (not Linux), each process is spawned instead, with its seed in its environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from zerolab.grading.defaults import HASH_SEEDS
from zerolab.launcher.spawn import spawn_rank
from zerolab.launcher.zygote import ForkedRank, Zygote, ZygoteUnavailable

_HOSTS: dict[int, Zygote | None] = {}  # rank -> its host; None: spawn instead
_STARTING: dict[int, Zygote] = {}  # rank -> its host, started and still importing
_LOCK = threading.Lock()  # the environment is changed while a host starts


def hash_seed(rank: int) -> int:
    # past the chosen ones, seeds above them: rank + 1 gave rank 3 the seed 4 of rank 2
    return HASH_SEEDS[rank] if rank < len(HASH_SEEDS) else max(HASH_SEEDS) + rank


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """os.environ with `values` set for the block: a process started in it inherits them."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def warm(world_size: int) -> None:
    """Start the hosts of ranks 0..world_size-1 that are missing (or dead), without waiting
    for them: they import torch while the grader does other work (the first run's, the
    references of plain exercises). `prepare` waits for them."""
    with _LOCK:
        for r in range(world_size):
            host = _HOSTS.get(r, False)
            if r in _STARTING or host is None or (host and host.process.poll() is None):
                continue  # starting, spawning instead, or alive
            try:  # the zygote sets its own PYTHONHASHSEED from hash_seed
                _STARTING[r] = Zygote(hash_seed=hash_seed(r))
            except ZygoteUnavailable:
                _HOSTS[r] = None


def prepare(world_size: int) -> None:
    """Start the hosts of ranks 0..world_size-1 that are missing (or dead), side by side, and
    wait until each has imported what ranks need."""
    warm(world_size)
    with _LOCK:
        for r in range(world_size):
            host = _STARTING.pop(r, None)
            if host is None:
                continue
            try:
                host._wait_ready()
                _HOSTS[r] = host
            except ZygoteUnavailable:
                _HOSTS[r] = None


def _host(rank: int) -> Zygote | None:
    prepare(rank + 1)
    return _HOSTS[rank]


def start(rank: int, target: Callable[..., Any], args: tuple, log_path: str,
          workdir: str | None = None) -> Any:
    """Start rank `rank`'s process running target(*args), its output going to log_path. The
    result has .pid, .join(timeout), .is_alive(), .exitcode (negative: killed by a signal).
    workdir: the run's folder, which the host removes if this process dies first.

    The process does not run the caller's main script first, as a launched rank does: the
    grader's target lives in zerolab, and a learner's script that calls grade() at its top
    level, unguarded, would grade again in every process of its grading."""
    host = _host(rank)
    if host is not None:
        try:
            return host.start(target, args, log_path, workdir=workdir, main=False)
        except ZygoteUnavailable:
            pass
    with _LOCK, _environment(PYTHONHASHSEED=str(hash_seed(rank))):
        return spawn_rank(target, args, log_path)


# Note: every descendant reaped. A learner's process may start processes of its own, and one
# started with start_new_session=True leaves the process group that kill() signals. So each
# learner's process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER, Linux): an
# orphan below it is adopted by it, not by init, and stays its descendant; kill() then finds
# every descendant through /proc (parent links) and kills them all, and a process that ends
# by itself kills its own first.

_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphans() -> bool:
    """Make this process a child subreaper (see the Note); False where it cannot be."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc's parent links; [] where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_descendants(pid: int) -> None:
    """SIGKILL every process below `pid` (stopped first, so that none starts another)."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for child in descendants(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, sig)


def kill(process: Any) -> None:
    """Kill a process and every process it started (it leads a process group of its own once
    it runs: worker.serve makes it one), from outside: nothing it runs can stop this."""
    pid = process.pid
    if pid is None:
        return
    kill_descendants(pid)  # new sessions included: they stay below a subreaper
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    if isinstance(process, ForkedRank):
        process.kill()
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
