"""Start ranks as fresh Python processes: multiprocessing's `spawn`, where no zygote can run.

    rank = spawn_rank(target, args, log_path)   # a multiprocessing.Process, started

The fallback of zerolab.launch where zygote.py cannot fork ranks (not Linux). A spawned rank
is a new Python: it imports torch (2-4 s) and runs the caller's main script again before
`target` runs. Its stdout and stderr are inherited from this process, so they are pointed at the
rank's log for the instant of starting it: the log then holds all the rank prints from its
first instruction, as a forked rank's does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch.multiprocessing as mp

# Two launches from two threads must not start their ranks at the same time: each points this
# process's stdout and stderr at its own rank's log while that rank starts.
_START_LOCK = threading.Lock()


def spawn_rank(target: Callable[..., Any], args: tuple, log_path: str) -> mp.Process:
    """Start a spawned process running target(*args), its stdout and stderr going to log_path."""
    if sys.platform != "win32":
        # The helper process multiprocessing starts on first use must keep our real output.
        from multiprocessing import resource_tracker
        resource_tracker.ensure_running()
    process = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    with _START_LOCK, _output_to(log_path):
        process.start()
    return process


@contextlib.contextmanager
def _output_to(path: str) -> Iterator[None]:
    """Point file descriptors 1 and 2 (stdout, stderr) of this process at `path` for a moment.

    Only for the instant of starting a process: anything else this process writes to them
    meanwhile (another thread's print) would land in the file too. In a notebook the caller's
    prints do not go through these descriptors and are not affected.
    """
    for stream in (sys.stdout, sys.stderr):  # what the caller printed goes where it belongs
        if stream is not None:
            stream.flush()
    log = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(log, 1)
        os.dup2(log, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
