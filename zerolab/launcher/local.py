"""Run a function on N real processes, from a notebook or a script, or join a torchrun job.

    results = zerolab.launch(fn, world_size=2, args=(x,))   # [fn(x) on rank 0, on rank 1]

Each rank is a new process with the default process group initialised (gloo on CPU, NCCL with
one GPU per rank): forked, in milliseconds, by a helper process that has imported torch already
(zerolab/launcher/zygote.py), or, where that cannot run (not Linux), a fresh `spawn`ed Python. What
`fn` returns comes back to the caller, tensors included. If a rank fails, the caller gets one
`WorkerError` naming the rank, what happened, the likely cause and the rank's own output; the
other ranks are killed; nothing is left running. A rank stuck in a collective is killed at
`timeout` and reported by `LaunchTimeout`.

Under `torchrun`, call `init_from_env()` instead: it reads the environment torchrun sets, so the
same training function runs on one laptop or many nodes.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerolab.launcher import zygote
from zerolab.launcher.allocator import keep_freed_memory
from zerolab.launcher.diagnose import (
    UNGUARDED_IN_A_RANK,
    LaunchError,
    check_importable,
    check_main_script,
    failure,
    timeout_error,
)
from zerolab.launcher.spawn import spawn_rank
from zerolab.launcher.torchrun import all_reach, choose_backend, default_threads


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
           backend: str | None = None, timeout: float = 120.0, *,
           threads: int | None = None, verbose: bool = False) -> list[Any]:
    """Run `fn(*args)` on `world_size` new ranks; return the results ordered by rank.

    backend: None picks NCCL with one GPU per rank (rank r on cuda:r), else gloo on CPU.
    timeout: seconds for the whole run; ranks still running then are killed (LaunchTimeout).
    threads: torch threads per rank (default: the cores divided among the ranks).
    verbose: print what the ranks printed (prefixed by rank); otherwise their stdout and stderr
        (warnings included) are kept out of the caller's output and shown only on failure.
    """
    if zygote.running_main_again:  # in a rank, running the main script again
        raise LaunchError(UNGUARDED_IN_A_RANK)
    backend = choose_backend(world_size, backend)
    check_importable(fn)
    check_main_script()
    threads = threads or default_threads(world_size)
    workdir = tempfile.mkdtemp(prefix="zerolab-launch-")  # the rendezvous, logs and results
    # The function and its arguments travel in a file: each rank unpickles them after its
    # output is redirected (importing fn's module must not print into the caller's output),
    # and the process objects stay small, so that starting one returns at once.
    with open(os.path.join(workdir, "payload"), "wb") as f:
        pickle.dump((fn, tuple(args)), f)
    procs: list = []  # one per rank started so far: all are killed if anything goes wrong
    try:
        _start(procs, workdir, world_size, (backend, threads, timeout))
        _wait_all(procs, workdir, timeout, getattr(fn, "__qualname__", repr(fn)))
        results = [torch.load(_path(workdir, "result", r), weights_only=False)
                   for r in range(world_size)]
        if verbose:
            for r in range(world_size):
                for line in _read(_path(workdir, "log", r)).splitlines():
                    print(f"[rank {r}] {line}")
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:  # started
                p.join(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


def running_ranks() -> list[int]:
    """The pids of the ranks this process started that are still running: none once `launch`
    has returned or raised, which kills whatever is left."""
    forker = zygote.Zygote.current()
    spawned = [p.pid for p in multiprocessing.active_children()]
    return (forker.ranks_running() if forker else []) + spawned


def _path(workdir: str, kind: str, rank: int) -> str:
    return os.path.join(workdir, f"{kind}-{rank}")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _start(procs: list, workdir: str, world_size: int, settings: tuple) -> None:
    """Start the ranks, appending each to `procs`, its output going to its log file from its
    first instruction (the main script run again, a failed import): forked by the zygote, or
    spawned where it cannot run. settings: (backend, threads, timeout) for `_worker`."""
    try:
        forker = zygote.Zygote.for_this_process()
    except zygote.ZygoteUnavailable:
        forker = None
    for rank in range(world_size):
        args, log = (workdir, rank, world_size, *settings), _path(workdir, "log", rank)
        if forker is None:
            procs.append(spawn_rank(_worker, args, log))
            continue
        try:
            procs.append(forker.start(_worker, args, log))
        except zygote.ZygoteUnavailable as e:
            raise LaunchError(f"could not start rank {rank}: {e}") from e


def _wait_all(procs: list, workdir: str, timeout: float, fn_name: str) -> None:
    """Wait for every rank; on the first failure kill the rest and raise."""
    deadline = time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = sorted(running.values())
            done = [r for r in stuck if os.path.exists(_path(workdir, "result", r))]
            raise timeout_error(stuck, done, timeout, fn_name)
        failed = []
        for sentinel in multiprocessing.connection.wait(list(running), timeout=remaining):
            rank = running.pop(sentinel)
            procs[rank].join(timeout=5)  # reap it, so that exitcode is set
            if procs[rank].exitcode != 0 or not os.path.exists(_path(workdir, "result", rank)):
                failed.append(rank)
        if failed:
            # Several ranks can be seen dead at once: the one that failed, and peers whose
            # collective broke when it died (gloo notices within milliseconds). Report the
            # rank that failed first (the cause, not a consequence): when each last wrote its
            # error file, or, without one (killed, aborted), its output.
            first = min(failed, key=lambda r: _last_written(workdir, r))
            raise failure(first, procs[first].exitcode, _read(_path(workdir, "error", first)),
                          _read(_path(workdir, "log", first)), fn_name)


def _last_written(workdir: str, rank: int) -> float:
    for kind in ("error", "log"):
        with contextlib.suppress(FileNotFoundError):
            return os.stat(_path(workdir, kind, rank)).st_mtime_ns
    return float("inf")


# --- in each rank -------------------------------------------------------------------------------


def _worker(workdir: str, rank: int, world_size: int, backend: str, threads: int,
            timeout: float) -> None:
    """One rank: run fn in the process group and leave its result, or its error, in workdir."""
    # stdout and stderr already go to this rank's log (see _start): a line at a time from
    # now on, so that a crash loses none; a crash in native code still shows the Python stack.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=True)
    try:
        with open(os.path.join(workdir, "payload"), "rb") as f:
            fn, args = pickle.load(f)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(threads)
        keep_freed_memory()  # reuse freed host memory step after step (allocator.py)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # Rendezvous through a file in a fresh directory: two launches can never collide.
        store = dist.FileStore(os.path.join(workdir, "rendezvous"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # Setting up the group can end on one rank before it has on another: a fast rank
        # whose function needs no collective could finish and close its connections while a
        # slow rank (a busy machine) is still connecting, which then fails with gloo's
        # "connectFullMesh failed ... Connection closed by peer". So no rank starts until
        # every rank's group is up.
        all_reach(store, "started", rank, world_size, timeout)
        result = fn(*args)
        # torch.save keeps tensors intact after this process exits (no shared-memory handles).
        tmp = _path(workdir, "result.tmp", rank)
        torch.save(result, tmp)
        os.replace(tmp, _path(workdir, "result", rank))
        # Likewise at the end: no rank closes its connections while a peer may still be
        # finishing its last collective with it.
        all_reach(store, "finished", rank, world_size, timeout)
        if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
            dist.destroy_process_group()
    except BaseException:
        with open(_path(workdir, "error", rank), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit/destructors that could block on a broken process group


