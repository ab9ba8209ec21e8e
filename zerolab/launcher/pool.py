"""Zygotes shared by a whole process tree: the test suite's workers, notebook kernels, grader and
scripts fork their ranks from one set of zygotes instead of a set each.

    with Pool(ranks=4, seeds=(1, 2, 4)):   # sets POOL_ENV; children inherit it
        ...                                 # every launch below forks from the pool's zygotes

Note: why a pool. A zygote (zygote.py) imports torch, torch._dynamo and zerolab once, about
5 s of CPU, so that a launch forks ranks in milliseconds. Every process that launches starts
one per rank index: the test suite did that about a hundred times (each notebook's kernel,
each test worker, each grader process, each script a test runs), minutes of its 2 cores. A
Pool starts one zygote per hash seed, each listening on a socket in the pool's folder, and
names the folder in the environment. A process that inherits it connects to the pool's zygote
of the seed it wants (rank r's seed, from the folder's `ranks` file; the grader asks for its
fixed seeds) instead of starting one, where the pool's zygote imported the same torch and
zerolab files it did (else it starts its own, as it would with no pool).

A pool's zygote serves each connection as its own zygote serves a caller: the ranks it forks
see the caller's environment, working directory, sys.path and main script; a connection that
closes (the caller exited or was killed) takes its ranks and its launches' folders along; the
other connections' ranks run on. The pool's rank seeds are drawn once: every launch in the tree
hashes rank r's strings alike, and rank r's unlike rank s's, as under torchrun. A caller that
fixed PYTHONHASHSEED starts its own zygotes (a pool's cannot have its seed). The zygotes end
when the pool closes, or when its owner dies (their socket to it closes).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterable

from zerolab.launcher import leftovers

POOL_ENV = "ZEROLAB_ZYGOTE_POOL"  # the pool's folder: <seed>.sock per zygote, and RANKS
RANKS = "ranks"  # in the pool's folder: the hash seeds of ranks 0, 1, ... one per line


class Pool:
    """The owner's end: zygotes for `ranks` rank indexes (random seeds) and for `seeds`."""

    def __init__(self, ranks: int = 4, seeds: Iterable[int] = ()) -> None:
        from zerolab.launcher.zygote import Zygote, hash_seeds  # zygote.py imports this file

        self.folder = tempfile.mkdtemp(prefix=f"{leftovers.POOL_PREFIX}{leftovers.owner_id()}-")
        wanted = list(dict.fromkeys(seeds))
        # A caller's fixed PYTHONHASHSEED: no rank zygotes to share (pool.seeds() says none).
        rank_seeds = [] if "PYTHONHASHSEED" in os.environ else hash_seeds(ranks, set(wanted))
        self.zygotes = [Zygote(seed, listen=os.path.join(self.folder, f"{seed}.sock"))
                        for seed in [*rank_seeds, *wanted]]  # importing, side by side
        for zygote in self.zygotes:
            zygote._wait_ready()
        with open(os.path.join(self.folder, RANKS), "w") as f:
            f.write("".join(f"{seed}\n" for seed in rank_seeds))
        os.environ[POOL_ENV] = self.folder

    def close(self) -> None:
        """End the zygotes (and every rank still running from them) and remove the folder."""
        if os.environ.get(POOL_ENV) == self.folder:
            del os.environ[POOL_ENV]
        for zygote in self.zygotes:
            zygote.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolZygote:
    """A pool's zygote process, as much of subprocess.Popen as its callers use: it is not theirs
    to wait for or kill (closing their socket ends their ranks)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None if alive(self.pid) else -signal.SIGKILL

    def kill(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> int | None:
        return self.poll()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        pass
    return True


def seeds() -> list[int]:
    """The hash seeds of ranks 0, 1, ... of the pool our environment names ([]: no pool, or
    the caller fixed PYTHONHASHSEED)."""
    folder = os.environ.get(POOL_ENV)
    if not folder or "PYTHONHASHSEED" in os.environ:
        return []
    try:
        with open(os.path.join(folder, RANKS)) as f:
            return [int(line) for line in f.read().split()]
    except (OSError, ValueError):
        return []


def connect(hash_seed: int | str, imported: tuple) -> tuple[socket.socket, int] | None:
    """A connection to the pool's zygote with this seed, and its pid, if our environment names
    a pool that has one and it imported the files `imported` names (torch and zerolab, as we
    did). None: start a zygote of our own."""
    folder = os.environ.get(POOL_ENV)
    if not folder or "PYTHONHASHSEED" in os.environ:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(60)  # it answers at once: it was ready before the pool was named
        sock.connect(os.path.join(folder, f"{hash_seed}.sock"))
        *theirs, pid = pickle.loads(sock.recv(4096))
        sock.settimeout(None)
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):  # no such seed, or gone
        sock.close()
        return None
    if tuple(theirs) != tuple(imported):  # another copy of zerolab (or torch) than ours
        sock.close()
        return None
    return sock, pid
