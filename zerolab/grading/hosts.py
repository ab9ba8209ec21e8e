"""The processes a learner's code runs in, started from hosts that have imported torch already.

Rank r of every grading run is forked by host r: a zygote (zerolab/launcher/zygote.py) started
with its own string-hashing seed, HASH_SEEDS[r]. A forked process keeps its parent's seed, so
ranks forked from one parent would all iterate a set of names in the same order; processes
started one by one (torchrun, or spawn) do not, and code that issues a collective per name in
set order then fails. Hosts with different seeds give the grader's ranks that difference. A
plain exercise runs in rank 0's process of a run of its own (or of world size 1).

The hosts are started when first needed, one at a time (each imports torch: a few seconds),
and live as long as this process. Where no zygote can run (not Linux), each process is spawned
instead, with its seed in its environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

from zerolab.grading.defaults import HASH_SEEDS
from zerolab.launcher.spawn import spawn_rank
from zerolab.launcher.zygote import ForkedRank, Zygote, ZygoteUnavailable

_HOSTS: dict[int, Zygote | None] = {}  # rank -> its host; None: spawn instead
_LOCK = threading.Lock()  # the environment is changed while a host starts


def hash_seed(rank: int) -> int:
    return HASH_SEEDS[rank] if rank < len(HASH_SEEDS) else rank + 1


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


def _host(rank: int) -> Zygote | None:
    with _LOCK:
        host = _HOSTS.get(rank)
        alive = host is not None and host.process.poll() is None
        if rank not in _HOSTS or (host is not None and not alive):
            try:
                with _environment(PYTHONHASHSEED=str(hash_seed(rank))):
                    _HOSTS[rank] = Zygote()
            except ZygoteUnavailable:
                _HOSTS[rank] = None
        return _HOSTS[rank]


def start(rank: int, target: Callable[..., Any], args: tuple, log_path: str) -> Any:
    """Start rank `rank`'s process running target(*args), its output going to log_path. The
    result has .pid, .join(timeout), .is_alive(), .exitcode (negative: killed by a signal)."""
    host = _host(rank)
    if host is not None:
        try:
            return host.start(target, args, log_path)
        except ZygoteUnavailable:
            pass
    with _LOCK, _environment(PYTHONHASHSEED=str(hash_seed(rank))):
        return spawn_rank(target, args, log_path)


def kill(process: Any) -> None:
    """Kill a process and every process it started (it leads a process group of its own once
    it runs: worker.serve makes it one), from outside: nothing it runs can stop this."""
    pid = process.pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    if isinstance(process, ForkedRank):
        process.kill()
    else:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
