"""Run a function on N real processes, from a notebook or a script, or join a torchrun job.

    results = zerolab.launch(fn, world_size=2, args=(x,))   # [fn(x) on rank 0, on rank 1]

Each rank is a new process with the default process group initialised (gloo on CPU, NCCL with
one GPU per rank): forked, in milliseconds, by a helper process that has imported torch already
(zerolab/launcher/zygote.py), or, where that cannot run (not Linux), a fresh `spawn`ed Python. What
`fn` returns comes back to the caller, tensors included. If a rank fails, the caller gets one
`WorkerError` naming the rank, what happened, the likely cause and the rank's own output; the
other ranks are killed; nothing is left running. Ranks that hang (waiting on each other in
collectives that cannot complete, or making no progress for `timeout` seconds) are stopped and
reported by `LaunchTimeout`, which says where each rank was and the first collective at which
they parted: every rank keeps a flight recorder (zerolab.wire.flight) the launcher can read
even after the rank died. A collective that returned although the ranks passed different things
(a SUM met by a MAX, float32 met by int32) stops them too, with `CollectiveMismatch`
(zerolab.launcher.fingerprints compares the records at every poll and at the end). The ranks
talk over the loopback interface only (127.0.0.1): nothing of a single-machine job listens on
the network.

Under `torchrun`, call `init_from_env()` instead: it reads the environment torchrun sets, so the
same training function runs on one laptop or many nodes.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from zerolab.launcher import fingerprints, hangs, leftovers, zygote
from zerolab.launcher.allocator import keep_freed_memory
from zerolab.launcher.diagnose import (
    UNGUARDED_IN_A_RANK,
    CollectiveMismatch,
    LaunchError,
    check_importable,
    check_main_script,
    check_threads,
    check_timeout,
    failure,
    hang_error,
    pickled_work,
)
from zerolab.launcher.hangs import rank_file
from zerolab.launcher.spawn import spawn_rank
from zerolab.launcher.torchrun import all_reach, choose_backend, default_threads
from zerolab.wire import flight, flight_torch

DEFAULT_TIMEOUT = 120.0  # seconds without progress before hung ranks are stopped
POLL_S = 0.2  # how often the launcher looks at the ranks' progress
GROUP_TIMEOUT_S = 1800.0  # gloo's own limit on one wait (torch's default): the launcher decides


def launch(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
           backend: str | None = None, timeout: float | None = DEFAULT_TIMEOUT, *,
           threads: int | None = None, verbose: bool = False) -> list[Any]:
    """Run `fn(*args)` on `world_size` new ranks; return the results ordered by rank.

    backend: None picks NCCL with one GPU per rank (rank r on cuda:r), else gloo on CPU.
    timeout: seconds without progress (no rank issuing or completing a collective, printing,
        returning or using the CPU) after which the ranks are stopped (LaunchTimeout); not a
        limit on the whole run: a job that computes for an hour is not stopped. Ranks that wait
        on each other in collectives that can never complete are stopped as soon as that is
        certain. None: never stop them.
    threads: torch threads per rank (default: the cores divided among the ranks).
    verbose: print what the ranks printed (prefixed by rank); otherwise their stdout and stderr
        (warnings included) are kept out of the caller's output and shown only on failure.
    """
    if zygote.running_main_again:  # in a rank, running the main script again
        raise LaunchError(UNGUARDED_IN_A_RANK)
    backend = choose_backend(world_size, backend)
    timeout = check_timeout(timeout)
    threads = check_threads(threads) or default_threads(world_size)
    check_importable(fn)
    check_main_script()
    # The function and its arguments travel in a file: each rank unpickles them after its
    # output is redirected (importing fn's module must not print into the caller's output),
    # and the process objects stay small, so that starting one returns at once. Pickled
    # first: arguments that cannot be sent are refused before anything is created.
    work = pickled_work(fn, args)
    leftovers.clean_stale()  # what launches of callers killed outright left behind
    workdir = leftovers.new_workdir()  # the rendezvous, logs, results, flight recorders
    procs: list = []  # one per rank started so far: all are killed if anything goes wrong
    try:
        with open(os.path.join(workdir, "payload"), "wb") as f:
            f.write(work)
        _start(procs, workdir, world_size, (backend, threads, timeout, leftovers.owner_id()))
        _wait_all(procs, workdir, timeout, getattr(fn, "__qualname__", repr(fn)))
        results = [torch.load(rank_file(workdir, "result", r), weights_only=False)
                   for r in range(world_size)]
        if verbose:
            for r in range(world_size):
                for line in _read(rank_file(workdir, "log", r)).splitlines():
                    print(f"[rank {r}] {line}")
        return results
    finally:
        _end(procs, workdir)


def _end(procs: list, workdir: str) -> None:
    """Leave nothing behind: each rank's process group (it, its children and theirs), anything
    else its launch marked (a child that left the group), the launch's folder."""
    for p in procs:
        if p.pid is not None:  # started
            leftovers.kill_group(p.pid)
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
    leftovers.kill_marked(leftovers.LAUNCH, workdir)
    shutil.rmtree(workdir, ignore_errors=True)


def running_ranks() -> list[int]:
    """The pids of the ranks this process started that are still running: none once `launch`
    has returned or raised, which kills whatever is left."""
    forked = [pid for z in zygote.Zygote.running() for pid in z.ranks_running()]
    spawned = [p.pid for p in multiprocessing.active_children()]
    return forked + spawned


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _start(procs: list, workdir: str, world_size: int, settings: tuple) -> None:
    """Start the ranks, appending each to `procs`, its output going to its log file from its
    first instruction (the main script run again, a failed import): rank r forked by zygote r,
    or spawned where no zygote can run. settings: (backend, threads, timeout, owner) for
    `_worker`."""
    try:
        forkers = zygote.Zygote.for_ranks(world_size)
    except zygote.ZygoteUnavailable:
        forkers = None
    for rank in range(world_size):
        args, log = (workdir, rank, world_size, *settings), rank_file(workdir, "log", rank)
        if forkers is None:
            procs.append(spawn_rank(_worker, args, log))
            continue
        try:
            procs.append(forkers[rank].start(_worker, args, log, workdir))
        except zygote.ZygoteUnavailable as e:
            if rank > 0:
                raise LaunchError(f"could not start rank {rank}: {e}") from e
            # A zygote died since the last launch (killed): new ones, once.
            forkers = zygote.Zygote.for_ranks(world_size)
            procs.append(forkers[rank].start(_worker, args, log, workdir))


def _wait_all(procs: list, workdir: str, timeout: float | None, fn_name: str) -> None:
    """Wait for every rank; on the first failure, or a hang, kill the rest and raise."""
    running = {p.sentinel: rank for rank, p in enumerate(procs)}
    watch = hangs.Watch(workdir, [p.pid for p in procs])
    settle = hangs.SETTLE_S if timeout is None else min(hangs.SETTLE_S, timeout / 2)
    judged = None  # the state of the collectives last judged (not) a deadlock
    compared = None  # the ranks' flight recorders' activity when last compared
    while running:
        failed = _reap(procs, workdir, running, POLL_S)
        if failed and all(_broken_by_a_peer(workdir, r) for r in failed):
            # A peer's collective broke (gloo noticed within milliseconds) before the rank
            # that broke it has finished dying (an abort writes its stacks first): wait for it.
            failed += _reap(procs, workdir, running, 2.0)
        if failed:
            # Several ranks can be seen dead at once: the one that failed, and peers whose
            # collective broke when it died. Report the rank that failed first (the cause, not
            # a consequence): not one that lost a peer, if another failed; then when each last
            # wrote its error file, or, without one (killed, aborted), its output.
            first = min(failed, key=lambda r: (_broken_by_a_peer(workdir, r),
                                               _last_written(workdir, r)))
            states = _states(procs, workdir, running.values())
            raise failure(first, procs[first].exitcode,
                          _read(rank_file(workdir, "error", first)),
                          _read(rank_file(workdir, "log", first)), fn_name,
                          hangs.explain(states, fn_name))
        # Every poll, the last one after every rank has returned: a call that returned with
        # the ranks disagreeing stops the launch, at the latest before the results come back.
        compared = _compare_calls(procs, workdir, running.values(), fn_name, compared)
        if timeout is None or not running:
            continue
        watch.poll()
        still, idle = watch.still_s(), watch.idle_s()
        # Whether it is a deadlock: asked once per state of the collectives that has lasted.
        certain = False
        if still >= settle and watch.last_change != judged:
            judged = watch.last_change
            certain = hangs.deadlocked(_states(procs, workdir, ()))
        if certain or idle >= timeout:
            stuck = sorted(running.values())
            states = _states(procs, workdir, stuck)
            raise hang_error(stuck, timeout, certain, still, hangs.explain(states, fn_name))


def _compare_calls(procs: list, workdir: str, running: Any, fn_name: str,
                   compared: tuple | None) -> tuple:
    """Raise CollectiveMismatch if a collective completed although its ranks passed different
    things (fingerprints.silent_mismatch). Read only when a rank's record changed since
    `compared` (their activity counters then), and the records in full only when the digests
    disagree; returns the counters now."""
    paths = [rank_file(workdir, "flight", r) for r in range(len(procs))]
    activity = tuple(flight.read_activity(path) for path in paths)
    if activity == compared:
        return activity
    digests = {r: d for r, path in enumerate(paths)
               if (d := flight.completed_digests(path)) is not None}
    if fingerprints.agree(digests):
        return activity
    logs = {r: log for r, path in enumerate(paths) if (log := flight.read(path)) is not None}
    found = fingerprints.silent_mismatch(logs)
    if found is None:
        return activity
    explanation = hangs.explain(_states(procs, workdir, running), fn_name)
    raise CollectiveMismatch(f"{fingerprints.mismatch_text(found)}\n{explanation}",
                             tuple(found.at), found.seq, explanation)


def _reap(procs: list, workdir: str, running: dict, wait_s: float) -> list[int]:
    """Wait up to wait_s for ranks to exit; those that failed (no result, or an exit code)."""
    failed = []
    deadline = time.monotonic() + wait_s
    while running and not failed:
        ready = multiprocessing.connection.wait(list(running),
                                                timeout=max(0.0, deadline - time.monotonic()))
        for sentinel in ready:
            rank = running.pop(sentinel)
            procs[rank].join(timeout=5)  # reap it, so that exitcode is set
            if procs[rank].exitcode != 0 or not os.path.exists(
                    rank_file(workdir, "result", rank)):
                failed.append(rank)
        if not ready or time.monotonic() >= deadline:
            break
    return failed


# What gloo raises on a rank whose peer died or aborted in a collective with it.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe",
             "Socket closed")


def _broken_by_a_peer(workdir: str, rank: int) -> bool:
    error = _read(rank_file(workdir, "error", rank))
    return any(text in error for text in PEER_GONE)


def _states(procs: list, workdir: str, ask: Any) -> list[hangs.RankState]:
    """Every rank's state; the ranks in `ask` (still running) are asked where they are."""
    ask = list(ask)
    wheres = hangs.dump_stacks(workdir, {r: procs[r].pid for r in ask}) if ask else {}
    codes = [None if p.exitcode is None and p.is_alive() else p.exitcode for p in procs]
    return hangs.rank_states(workdir, codes, wheres)


def _last_written(workdir: str, rank: int) -> float:
    for kind in ("error", "log"):
        with contextlib.suppress(FileNotFoundError):
            return os.stat(rank_file(workdir, kind, rank)).st_mtime_ns
    return float("inf")


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface ("lo" on Linux, "lo0" on macOS)."""
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") \
        else []
    return next((n for n in names if n in ("lo", "lo0")),
                next((n for n in names if n.startswith("lo")), None))


# --- in each rank -------------------------------------------------------------------------------


def _worker(workdir: str, rank: int, world_size: int, backend: str, threads: int,
            timeout: float | None, owner: str) -> None:
    """One rank: run fn in the process group and leave its result, or its error, in workdir."""
    _own_group()
    # stdout and stderr already go to this rank's log (see _start): a line at a time from
    # now on, so that a crash loses none; a crash in native code still shows the Python stack,
    # and so does STACK_SIGNAL, which the launcher sends to ask where a hung rank is.
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    faulthandler.enable(all_threads=True)
    stacks = open(rank_file(workdir, "stack", rank), "w")  # noqa: SIM115 (open until exit)
    faulthandler.register(hangs.STACK_SIGNAL, file=stacks, all_threads=True)
    try:
        if flight.install(rank_file(workdir, "flight", rank), rank, world_size):
            flight_torch.hook()  # torch.distributed's own functions, called directly
        with open(os.path.join(workdir, "payload"), "rb") as f:
            fn, args = pickle.load(f)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                          LOCAL_WORLD_SIZE=str(world_size))
        # Marks on whatever this rank starts, so that it can be found and ended (leftovers.py).
        os.environ.update({leftovers.OWNER: owner, leftovers.LAUNCH: workdir})
        # One machine: the ranks listen on the loopback interface only, whatever the hostname
        # resolves to (gloo's default: in a container, often the network) or the caller's
        # GLOO_SOCKET_IFNAME says (meant for jobs across machines).
        loopback = loopback_interface()
        if loopback:
            os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = loopback
        torch.set_num_threads(threads)
        keep_freed_memory()  # reuse freed host memory step after step (allocator.py)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # Rendezvous through a file in a fresh directory: two launches can never collide.
        # gloo's own limit on a wait stays long: hung ranks are the launcher's to judge.
        wait_s = max(GROUP_TIMEOUT_S, timeout or 0)
        # torch read TORCH_DISTRIBUTED_DEBUG when the zygote imported it; the caller's may have
        # changed since (DETAIL: torch checks each collective's fingerprint, see fingerprints.py)
        dist.set_debug_level_from_env()
        store = dist.FileStore(os.path.join(workdir, "rendezvous"), world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=wait_s))
        # Setting up the group can end on one rank before it has on another: a fast rank
        # whose function needs no collective could finish and close its connections while a
        # slow rank (a busy machine) is still connecting, which then fails with gloo's
        # "connectFullMesh failed ... Connection closed by peer". So no rank starts until
        # every rank's group is up.
        flight.set_phase(flight.RENDEZVOUS)
        all_reach(store, "started", rank, world_size, wait_s)
        flight.set_phase(flight.RUNNING)
        result = fn(*args)
        # torch.save keeps tensors intact after this process exits (no shared-memory handles).
        tmp = rank_file(workdir, "result.tmp", rank)
        torch.save(result, tmp)
        os.replace(tmp, rank_file(workdir, "result", rank))
        flight.set_phase(flight.RETURNED)
        # Likewise at the end: no rank closes its connections while a peer may still be
        # finishing its last collective with it.
        all_reach(store, "finished", rank, world_size, wait_s)
        if dist.is_initialized():  # fn may have destroyed it itself, torchrun-style
            dist.destroy_process_group()
    except BaseException:
        flight.set_phase(flight.RAISED)
        with open(rank_file(workdir, "error", rank), "w") as f:
            f.write(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # skip atexit/destructors that could block on a broken process group


def _own_group() -> None:
    """Lead a process group of this rank's own, so that killing the group ends whatever the
    rank started too; and die with the process that started it (Linux)."""
    if os.getpgrp() != os.getpid():  # the zygote has done both for a forked rank
        with contextlib.suppress(OSError):
            os.setsid()
        if sys.platform == "linux":
            ctypes.CDLL(None).prctl(zygote.PR_SET_PDEATHSIG, signal.SIGKILL)
