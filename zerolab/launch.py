"""Run a function on N real processes, from a notebook or a script, or join a torchrun job.

    results = zerolab.launch(fn, world_size=2, args=(x,))   # [fn(x) on rank 0, on rank 1]

Each rank is a new process with the default process group initialised (gloo on CPU, NCCL with
one GPU per rank): forked, in milliseconds, by a helper process that has imported torch already
(zerolab/zygote.py), or, where that cannot run (not Linux), a fresh `spawn`ed Python. What
`fn` returns comes back to the caller, tensors included. If a rank fails, the caller gets one
`WorkerError` naming the rank, what happened, the likely cause and the rank's own output; the
other ranks are killed; nothing is left running. A rank stuck in a collective is killed at
`timeout` and reported by `LaunchTimeout`.

Under `torchrun`, call `init_from_env()` instead: it reads the environment torchrun sets, so the
same training function runs on one laptop or many nodes.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import faulthandler
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerolab import zygote
from zerolab.allocator import keep_freed_memory
from zerolab.spawn import spawn_rank


class LaunchError(RuntimeError):
    """A launch could not start or did not finish."""


class WorkerError(LaunchError):
    """A rank failed; `rank` names it and the message says how, with the rank's own output."""

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
    """The ranks import `fn` by module and name; say so clearly when they cannot."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", repr(fn))
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"{qualname} was defined in a notebook cell (or an interactive session): the ranks, "
            f"other processes, cannot import it. Put it in a module, e.g. my_workers.py next to "
            f"the notebook, and import it from there: `from my_workers import {qualname}`.")
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ValueError(
            f"{qualname} is a lambda or a nested function: the ranks cannot import it. "
            f"Define it at the top level of a module.")
    try:
        pickle.dumps(fn)
    except Exception as e:  # e.g. a bound method of an unpicklable object
        raise ValueError(f"{qualname} cannot be sent to the worker processes: {e}") from e


# --- the main script: every rank starts by running it again --------------------------------------

GUARD_FIX = """\
Every new rank starts by running the main script again (that is how it finds the functions
defined there), so a call to zerolab.launch at the top level of the script would run again in
every rank, and Python stops a process that starts processes while it is itself starting.
Fix: put the call under the guard, so that it runs only in the process you started:

    if __name__ == "__main__":
        print(zerolab.launch(...))"""

STDIN_FIX = """\
Every new rank starts by running the main script again (that is how it finds the functions
defined there), and a script read from standard input (`python -`, `python - <<EOF`) cannot be
read a second time. Fix: save the script to a file, e.g. my_script.py, with the call to
zerolab.launch under `if __name__ == "__main__":`, and run `python my_script.py`."""


def check_main_script() -> None:
    """Refuse, before any rank starts, the two scripts that the ranks cannot run again."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None:
        return  # a notebook or `python -c`: the ranks do not run it again
    if not os.path.isfile(path):  # "<stdin>"
        raise LaunchError(f"zerolab.launch cannot start ranks from a script read from standard "
                          f"input ({path}).\n{STDIN_FIX}")
    line = _unguarded_line(main, path)
    if line is not None:
        number, text = line
        raise LaunchError(
            f"zerolab.launch was called at the top level of {os.path.basename(path)} without "
            f"an `if __name__ == \"__main__\":` guard (line {number}: `{text}`).\n"
            f"{GUARD_FIX}")


def _unguarded_line(main: Any, path: str) -> tuple[int, str] | None:
    """(number, text) of the script's top-level line now running, if it runs unconditionally.

    None when launch is not called while the script runs its top level (a function called
    later, a thread) or when the line sits in an `if`, `try` or `match`: the guard, or a
    condition that may keep it from running again in a rank. When in doubt: None.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is vars(main):
            break
        frame = frame.f_back
    if frame is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source, path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    number = frame.f_lineno
    conditional = (ast.If, ast.Try, ast.Match, getattr(ast, "TryStar", ast.Try))
    body: list[ast.stmt] = tree.body
    while True:  # walk down the statements that contain the line
        node = next((n for n in body if n.lineno <= number <= (n.end_lineno or n.lineno)), None)
        if node is None or isinstance(node, conditional):
            return None
        inner = [n for field in ("body", "orelse", "finalbody")
                 for n in getattr(node, field, []) if isinstance(n, ast.stmt)]
        if not any(n.lineno <= number <= (n.end_lineno or n.lineno) for n in inner):
            return number, source.splitlines()[number - 1].strip()
        body = inner


# --- launching ----------------------------------------------------------------------------------


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
            raise _timeout(sorted(running.values()), workdir, timeout, fn_name)
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
            raise _failure(first, procs[first].exitcode, workdir, fn_name)


def _timeout(stuck: list[int], workdir: str, timeout: float, fn_name: str) -> LaunchTimeout:
    done = [r for r in stuck if os.path.exists(_path(workdir, "result", r))]
    busy = [r for r in stuck if r not in done]
    where = (f": ranks {done} had returned from {fn_name} and waited for ranks {busy}, still "
             f"in it" if done else "")
    return LaunchTimeout(
        f"ranks {stuck} were still running after {timeout:g}s and were killed{where} (a rank "
        f"waiting in a collective that another rank never joined, or whose tensor sizes differ "
        f"from the other ranks'?)")


def _last_written(workdir: str, rank: int) -> float:
    for kind in ("error", "log"):
        with contextlib.suppress(FileNotFoundError):
            return os.stat(_path(workdir, kind, rank)).st_mtime_ns
    return float("inf")


# --- what went wrong, for the learner ------------------------------------------------------------

# What usually sends each signal to a rank: (what happened, the likely cause and the fix).
SIGNAL_CAUSES = {
    "SIGABRT": ("a native library (gloo, NCCL, torch's C++ code) stopped it on an error that it "
                "could not raise as a Python exception",
                "The usual cause is a collective called with tensors that differ across ranks: "
                "different sizes, shapes or dtypes (an uneven all-gather or reduce-scatter), or "
                "ranks calling different collectives. Check what every rank passes, e.g. "
                "print(dist.get_rank(), t.shape, t.dtype) just before the call."),
    "SIGKILL": ("something outside the process killed it",
                "Most often the out-of-memory killer: the ranks together needed more memory than "
                "the machine has (`dmesg` shows 'Out of memory: Killed process'). Use a smaller "
                "model or batch, or fewer ranks. A job scheduler or a timeout that kills with "
                "`kill -9` looks the same."),
    "SIGSEGV": ("it crashed in native code (a segmentation fault)",
                "Usually a compiled extension built for another version of torch, a bug in native "
                "code, or native code out of memory. Where Python was at the crash, if it was "
                "running, is in the output below."),
    "SIGBUS": ("it crashed reading shared memory",
               "Usually /dev/shm is full: a Docker container has 64 MB of it unless started "
               "with a larger --shm-size (e.g. --shm-size=1g)."),
    "SIGTERM": ("it was asked to stop from outside",
                "kill, a job scheduler or a notebook kernel shutting down sends SIGTERM."),
    "SIGINT": ("it was interrupted", "Ctrl-C reaches every rank started from a terminal."),
}

UNGUARDED_IN_A_RANK = """\
zerolab.launch was called while a rank ran the main script again: the script calls it where
every rank runs it, not under `if __name__ == "__main__":`."""

STARTUP_FIX = """\
A new rank first runs the main script again and imports the module of the function: code there
that fails in a fresh process stops the rank (a module not found from there, a relative path,
work that belongs under `if __name__ == "__main__":`). Its output below shows where."""


def _failure(rank: int, exitcode: int | None, workdir: str, fn_name: str) -> WorkerError:
    """The error for a rank that failed: what happened, the likely cause, and its output."""
    error = _read(_path(workdir, "error", rank))
    if error:
        last_line = error.strip().splitlines()[-1]  # e.g. "KeyError: 'boom'"
        return WorkerError(rank, f"rank {rank} raised {last_line}\n\n"
                                 f"Traceback from rank {rank}:\n{error}")
    output = _read(_path(workdir, "log", rank))
    if exitcode is not None and exitcode < 0:  # killed by a signal
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        what, cause = SIGNAL_CAUSES.get(name, ("it was killed", ""))
        head = f"rank {rank} was killed by {name} (exit code {exitcode}): {what}.\n{cause}"
    elif "finished its bootstrapping phase" in output or UNGUARDED_IN_A_RANK in output:
        head = (f"rank {rank} could not start: the main script calls zerolab.launch without "
                f"an `if __name__ == \"__main__\":` guard.\n{GUARD_FIX}")
    elif "<stdin>" in output and "spawn_main" in output:
        head = (f"rank {rank} could not start: the main script was read from standard "
                f"input.\n{STDIN_FIX}")
    elif zygote.STARTUP_FAILED in output or (
            "Traceback" in output and ("spawn_main" in output or "_bootstrap" in output)):
        # a traceback from multiprocessing's start-up code: before the worker could catch it
        last_line = output.strip().splitlines()[-1]
        head = (f"rank {rank} failed while starting, before it ran {fn_name}: {last_line}\n"
                f"{STARTUP_FIX}")
    else:
        head = (f"rank {rank} exited with code {exitcode} without a Python exception: the "
                f"function, or a library it called, ended the process (os._exit, sys.exit in "
                f"a thread, exit() in native code).")
    return WorkerError(rank, head + _output_section(rank, output))


def _output_section(rank: int, output: str, head: int = 10, tail: int = 30) -> str:
    """The rank's output for the error message: its first lines (often where trouble starts)
    and its last lines (where it ended)."""
    lines = output.rstrip().splitlines()
    if not lines:
        return f"\n\nRank {rank} printed nothing."
    if len(lines) > head + tail:
        lines = [*lines[:head], f"... ({len(lines) - head - tail} lines left out) ...",
                 *lines[-tail:]]
    return f"\n\nOutput of rank {rank}:\n" + "\n".join("    " + line for line in lines)


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
        _all_reach(store, "started", rank, world_size, timeout)
        result = fn(*args)
        # torch.save keeps tensors intact after this process exits (no shared-memory handles).
        tmp = _path(workdir, "result.tmp", rank)
        torch.save(result, tmp)
        os.replace(tmp, _path(workdir, "result", rank))
        # Likewise at the end: no rank closes its connections while a peer may still be
        # finishing its last collective with it.
        _all_reach(store, "finished", rank, world_size, timeout)
        if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
            dist.destroy_process_group()
    except BaseException:
        with open(_path(workdir, "error", rank), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit/destructors that could block on a broken process group


def _all_reach(store: dist.Store, point: str, rank: int, world_size: int,
               timeout: float) -> None:
    """Wait until every rank has reached `point`. Through the store, not a collective: it works
    whatever collectives the function left unfinished, and after it destroyed its group."""
    store.set(f"zerolab/{point}/{rank}", "1")
    store.wait([f"zerolab/{point}/{r}" for r in range(world_size)],
               datetime.timedelta(seconds=timeout))


def finish_torchrun_job(timeout: float = 300.0) -> None:
    """Under torchrun: wait until every rank gets here, then destroy the process group.

    As at the end of a `launch`, through a store rather than a collective: a gloo barrier
    returns on one rank while its last message to a peer may still be in flight, and a rank
    that then tears its connections down could make that peer abort at exit ("terminate
    called without an active exception", seen in 1 of 12-20 torchrun runs). The store is
    torchrun's own, reached as a client at MASTER_ADDR:MASTER_PORT, under keys of this run.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=datetime.timedelta(seconds=timeout))
    run = (f"zerolab/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    _all_reach(dist.PrefixStore(run, client), "finished", rank, world_size, timeout)
    dist.destroy_process_group()


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
        keep_freed_memory()
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:  # a plain `python script.py`: a one-process job
            rendezvous = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
            dist.init_process_group(backend, init_method=rendezvous, rank=0, world_size=1)
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
