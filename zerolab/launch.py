"""Run a function on N real processes, from a notebook or a script, or join a torchrun job.

    results = zerolab.launch(fn, world_size=2, args=(x,))   # [fn(x) on rank 0, on rank 1]

Each rank is a fresh `spawn`ed Python process with the default process group initialised
(gloo on CPU, NCCL with one GPU per rank). What `fn` returns comes back to the caller, tensors
included. If a rank raises, the caller gets one `WorkerError` naming the rank and carrying the
worker's traceback; the other ranks are killed; nothing is left running. A rank stuck in a
collective is killed at `timeout` and reported by `LaunchTimeout`.

Under `torchrun`, call `init_from_env()` instead: it reads the environment torchrun sets, so the
same training function runs on one laptop or many nodes.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    """A launch could not start or did not finish."""


class WorkerError(LaunchError):
    """A rank raised; `rank` names it and the message carries the worker's traceback."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


class LaunchTimeout(LaunchError):
    """Ranks were still running at the timeout (often: a rank waiting in a collective)."""


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. Returned by `init_from_env()`."""

    rank: int  # global rank, 0..world_size-1
    world_size: int  # number of processes in the job
    local_rank: int  # rank on this node: picks the GPU
    backend: str  # "gloo" or "nccl"
    device: torch.device  # cuda:local_rank with NCCL, else cpu


def default_threads(world_size: int) -> int:
    """Torch threads per rank so that the ranks share the cores instead of fighting over them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def choose_backend(world_size: int, backend: str | None) -> str:
    """None -> NCCL when there is one GPU per rank, else gloo on CPU. Errors before spawning."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= world_size else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine "
            f"has {gpus} GPU(s). Use backend='gloo' (CPU) or a smaller world_size.")
    return backend


def check_importable(fn: Callable) -> None:
    """Spawned processes re-import `fn` by module and name; say so clearly when they cannot."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", repr(fn))
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"{qualname} was defined in a notebook cell (or an interactive session): spawned "
            f"processes cannot import it. Put it in a module, e.g. my_workers.py next to the "
            f"notebook, and import it from there: `from my_workers import {qualname}`.")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(
            f"{qualname} is a lambda or a nested function: spawned processes cannot import it. "
            f"Define it at the top level of a module.")
    try:
        pickle.dumps(fn)
    except Exception as e:  # e.g. a bound method of an unpicklable object
        raise ValueError(f"{qualname} cannot be sent to the worker processes: {e}") from e


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
           backend: str | None = None, timeout: float = 120.0, *,
           threads: int | None = None, verbose: bool = False) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks; return the results ordered by rank.

    backend: None picks NCCL with one GPU per rank (rank r on cuda:r), else gloo on CPU.
    timeout: seconds for the whole run; ranks still running then are killed (LaunchTimeout).
    threads: torch threads per rank (default: the cores divided among the ranks).
    verbose: print what the ranks printed (prefixed by rank); otherwise their stdout and stderr
        (warnings included) are kept out of the caller's output and shown only on failure.
    """
    backend = choose_backend(world_size, backend)
    check_importable(fn)
    threads = threads or default_threads(world_size)
    workdir = tempfile.mkdtemp(prefix="zerolab-launch-")
    # Rendezvous through a file in a fresh directory: two launches can never collide.
    init_method = "file://" + os.path.join(workdir, "rendezvous")
    ctx = mp.get_context("spawn")
    # Pickled here, unpickled by the worker after it has redirected its output: importing fn's
    # module in the worker must not print into the caller's output either.
    payload = pickle.dumps((fn, tuple(args)))
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(payload, rank, world_size, backend, init_method, workdir, threads,
                          timeout))
        for rank in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        _wait_all(procs, workdir, timeout)
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


def _path(workdir: str, kind: str, rank: int) -> str:
    return os.path.join(workdir, f"{kind}-{rank}")


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime_ns
    except FileNotFoundError:
        return float("inf")  # no error file (killed hard): after any rank that wrote one


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _wait_all(procs: list, workdir: str, timeout: float) -> None:
    """Wait for every rank; on the first failure kill the rest and raise."""
    deadline = time.monotonic() + timeout
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    while running:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            stuck = sorted(running.values())
            raise LaunchTimeout(
                f"ranks {stuck} were still running after {timeout:g}s and were killed "
                f"(a rank waiting in a collective that another rank never joined?)")
        failed = []
        for sentinel in multiprocessing.connection.wait(list(running), timeout=remaining):
            rank = running.pop(sentinel)
            procs[rank].join(timeout=5)  # reap it, so that exitcode is set
            if procs[rank].exitcode != 0 or not os.path.exists(_path(workdir, "result", rank)):
                failed.append(rank)
        if failed:
            # Several ranks can be seen dead at once: the one that raised, and peers whose
            # collective broke when it died (gloo notices within milliseconds). Report the
            # rank whose error was written first: the cause, not a consequence.
            first = min(failed, key=lambda r: _mtime(_path(workdir, "error", r)))
            raise _failure(first, procs[first].exitcode, workdir)


def _failure(rank: int, exitcode: int | None, workdir: str) -> WorkerError:
    error = _read(_path(workdir, "error", rank))
    if error:
        last_line = error.strip().splitlines()[-1]  # e.g. "KeyError: 'boom'"
        return WorkerError(rank, f"rank {rank} raised {last_line}\n\n"
                                 f"Traceback from rank {rank}:\n{error}")
    log_tail = "\n".join(_read(_path(workdir, "log", rank)).splitlines()[-20:])
    return WorkerError(rank, f"rank {rank} exited with code {exitcode} without a Python "
                             f"exception. Its last output:\n{log_tail}")


def _worker(payload, rank, world_size, backend, init_method, workdir, threads, timeout) -> None:
    # Keep the caller's output deterministic: this rank's prints and warnings go to a file.
    log = os.open(_path(workdir, "log", rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    try:
        fn, args = pickle.loads(payload)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(*args)
        # torch.save keeps tensors intact after this process exits (no shared-memory handles).
        tmp = _path(workdir, "result.tmp", rank)
        torch.save(result, tmp)
        os.replace(tmp, _path(workdir, "result", rank))
        if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
            dist.destroy_process_group()
    except BaseException:
        with open(_path(workdir, "error", rank), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit/destructors that could block on a broken process group


def init_from_env(backend: str | None = None, threads: int | None = None) -> DistContext:
    """Join the job torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Also works when the process group is already up (inside `launch`). Returns where this
    process sits; with NCCL, the current CUDA device is set to cuda:LOCAL_RANK.
    """
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        if backend is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            backend = "nccl" if gpus >= local_world else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        torch.set_num_threads(threads or default_threads(local_world))
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:  # a plain `python script.py`: a one-process job
            rendezvous = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
            dist.init_process_group(backend, init_method=rendezvous, rank=0, world_size=1)
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
