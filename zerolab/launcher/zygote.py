"""Start ranks in milliseconds: fork them from a process that has imported torch already.

    zygotes = Zygote.for_ranks(world_size)       # started on first use: one per rank index
    rank = zygotes[r].start(target, args, log_path)  # a forked process running target(*args)
    rank.join(timeout); rank.exitcode

Note: why a zygote. A rank started with multiprocessing's `spawn` method is a new Python that
imports torch (2-4 s of CPU) before it runs a line of the course: a 4-rank launch on a 2-core
laptop waits 5 s for that, and the course launches ranks hundreds of times. The zygote is one
helper process per caller (a notebook kernel, a script, pytest). It imports torch and zerolab
once, then forks a new rank whenever `launch` asks: a fork takes milliseconds, and the forked
rank shares the imported modules' memory until it writes to it. This is the idea of
multiprocessing's `forkserver` start method; zerolab runs its own so that a rank's stdout and
stderr go to its log from its first instruction, as they do with `spawn`.

Forking is safe from the zygote and not from the caller. A fork copies only the thread that
calls it; a lock that another thread held stays locked forever in the child. The caller (a
notebook kernel) runs threads: Jupyter's, torch's thread pool, gloo's. The zygote runs one
thread and has run no torch operation when it forks (it starts numpy's BLAS with one thread
for that reason).

Note: one zygote per rank index. Python picks the seed of its string hashes when it starts,
and a forked child keeps its parent's: ranks forked from one zygote would iterate a set of
strings in the same order, where ranks that torchrun starts (new Pythons) do not. A training
loop that issues collectives in a set's order hangs under torchrun; it must hang here too, not
pass. So rank r of every launch forks from zygote r, and each zygote starts with a hash seed
of its own (unless the caller fixed PYTHONHASHSEED, which torchrun's ranks would inherit too).
Zygote r starts when a launch first needs r + 1 ranks, beside the others.

A forked rank gets what a spawned one would: the caller's environment, working directory,
sys.path and main script (run again as `__mp_main__`, which is how `fn` defined there is
found), and nothing else of the caller. torch and zerolab are the modules the zygote imported
when it started: the same files as the caller's (checked), as of then. A restarted kernel
starts a new zygote.

The zygote dies with its caller: when the caller's end of the socket closes (the caller exited
or was killed), or when it is sent SIGTERM or SIGHUP, it kills the ranks still running (each
rank leads its own process group: the group goes), whatever else its caller's launches
started, their folders and its own log, and exits (zerolab/launcher/leftovers.py).

A process tree that launches from dozens of processes shares zygotes: pool.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing.connection
import multiprocessing.spawn
import os
import pickle
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from zerolab.launcher import leftovers, pool

# Printed by a rank that failed before its target ran (while it ran the main script again):
# launch recognises it in the rank's output.
STARTUP_FAILED = "zerolab: this rank failed while starting"

# True in a rank while it runs the caller's main script again: a launch from there means the
# script calls zerolab.launch where every rank runs it (see diagnose.GUARD_FIX).
running_main_again = False

_INT = struct.Struct("i")  # a pid or an exit code, as the zygote sends them
_MAX_MESSAGE = 1 << 20  # a start request: the environment, sys.path, a few names
PR_SET_PDEATHSIG = 1  # prctl(2): set the signal a process gets when its parent dies


class ZygoteUnavailable(RuntimeError):
    """The zygote could not start here; launch falls back to spawned ranks."""


class ForkedRank:
    """A rank forked by the zygote: the parts of multiprocessing.Process that launch uses.

    It is the zygote's child, not ours: the zygote reaps it and writes its exit code into a
    pipe whose read end is our `sentinel` (readable once the rank has exited).
    """

    def __init__(self, pid: int, sentinel: int):
        self.pid = pid
        self.sentinel = sentinel
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        if self.exitcode is not None:
            return
        if not multiprocessing.connection.wait([self.sentinel], timeout):
            return
        report = os.read(self.sentinel, _INT.size)
        os.close(self.sentinel)
        # No report: the zygote itself died (killed with its ranks), so this rank is gone.
        self.exitcode = _INT.unpack(report)[0] if len(report) == _INT.size else -signal.SIGKILL

    def is_alive(self) -> bool:
        self.join(0)
        return self.exitcode is None

    def kill(self) -> None:
        """Kill the rank and its process group (whatever it started)."""
        leftovers.kill_group(self.pid)


class Zygote:
    """The caller's end: start ranks by asking the zygote process to fork them."""

    _by_index: dict[int, Zygote] = {}  # rank index -> its zygote (this process's)
    _registry_lock = threading.Lock()

    @classmethod
    def current(cls, index: int = 0) -> Zygote | None:
        """This process's zygote for rank `index` if one is running, without starting one. (A
        process forked from this one, not by the zygote, needs its own: two processes'
        requests on one socket would mix.)"""
        zygote = cls._by_index.get(index)
        alive = zygote is not None and zygote.owner == os.getpid() and zygote.process.poll() is None
        return zygote if alive else None

    @classmethod
    def running(cls) -> list[Zygote]:
        """This process's zygotes that are running, by rank index."""
        return [z for i in sorted(cls._by_index) if (z := cls.current(i)) is not None]

    @classmethod
    def for_ranks(cls, world_size: int) -> list[Zygote]:
        """The zygotes of ranks 0..world_size-1, those missing (or dead) started side by side."""
        with cls._registry_lock:
            missing = [i for i in range(world_size) if cls.current(i) is None]
            for i in missing:  # a dead one's leftovers (its log), as its own exit would
                if i in cls._by_index and cls._by_index[i].owner == os.getpid():
                    cls._by_index.pop(i).close()
            pooled = pool.seeds()
            seeds = hash_seeds(len(missing), taken={z.hash_seed for z in cls.running()} | {
                pooled[i] for i in range(len(pooled)) if i not in missing})
            seeds = [pooled[i] if i < len(pooled) else seed for i, seed in zip(missing, seeds)]
            started = {i: cls(seed) for i, seed in zip(missing, seeds)}  # importing, in parallel
            cls._by_index.update(started)
            try:
                for zygote in started.values():
                    zygote._wait_ready()
            except ZygoteUnavailable:
                for zygote in started.values():
                    zygote.close()
                raise
            return [cls._by_index[i] for i in range(world_size)]

    @classmethod
    def for_this_process(cls) -> Zygote:
        """Rank 0's zygote, started on first use (and again if it has died)."""
        return cls.for_ranks(1)[0]

    @classmethod
    def close_all(cls) -> None:
        """Close this process's zygotes (a pool's: our connections to them); the next launch
        starts or connects anew."""
        with cls._registry_lock:
            for index in list(cls._by_index):
                if cls.current(index) is not None:
                    cls._by_index[index].close()
                del cls._by_index[index]

    def __init__(self, hash_seed: int | str | None = None, listen: str = "") -> None:
        """Start a zygote process (its imports go on in the background: `_wait_ready`), or
        connect to a pool's zygote of the same seed (pool.py).
        hash_seed: its string-hash seed (None: the caller's PYTHONHASHSEED, else random).
        listen: a socket path on which it also serves other processes (a Pool's zygote)."""
        if sys.platform != "linux":  # fork, and passing file descriptors, as Linux has them
            raise ZygoteUnavailable(f"no zygote on {sys.platform}")
        self.owner = os.getpid()
        self.hash_seed = hash_seeds(1, set())[0] if hash_seed is None else hash_seed
        self._lock = threading.Lock()  # one request at a time: launches from two threads
        self._started: set[int] = set()  # the pids of the ranks it forked for us
        self._log_path = ""
        shared = pool.connect(self.hash_seed, _imported()) if not listen else None
        if shared is not None:  # a pool's zygote serves us (pool.py); else one of our own
            self._socket, pid = shared
            self.process: subprocess.Popen | pool.PoolZygote = pool.PoolZygote(pid)
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        # The zygote imports zerolab and torch from where this process did.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        env["OPENBLAS_NUM_THREADS"] = "1"  # numpy's BLAS would start a thread: see the Note
        env["PYTHONHASHSEED"] = str(self.hash_seed)  # its ranks' string hashes: see the Note
        # The zygote, its ranks and their children carry their owner's name (leftovers.py).
        env[leftovers.OWNER] = owner = leftovers.owner_id()
        # Its output, for when it fails to start. The zygote removes this file when it exits.
        log, self._log_path = tempfile.mkstemp(prefix=f"{leftovers.ZYGOTE_PREFIX}{owner}-",
                                               suffix=".log")
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from zerolab.launcher.zygote import serve; "
                                   f"serve({theirs.fileno()}, {self._log_path!r}, {listen!r})"],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            env=env)
        os.close(log)
        theirs.close()
        self._socket = ours

    def _wait_ready(self) -> None:
        """Wait until the zygote has imported what ranks need, and check it imported ours."""
        if isinstance(self.process, pool.PoolZygote):  # checked when it connected
            return
        self._socket.settimeout(300)  # importing torch on a busy machine; not forever
        try:
            ready = self._socket.recv(_MAX_MESSAGE)
        except TimeoutError:
            ready = b""
        self._socket.settimeout(None)
        if not ready:
            self.process.kill()
            self.process.wait()
            raise ZygoteUnavailable("the zygote did not start:\n" + self._output())
        expected = _imported()
        *imported, _ = pickle.loads(ready)
        if tuple(imported) != expected:  # another torch or zerolab came first on its path
            self.close()
            raise ZygoteUnavailable(f"the zygote imported {tuple(imported)}, not {expected}")

    def start(self, target: Callable[..., Any], args: tuple, log_path: str,
              workdir: str | None = None, main: bool = True) -> ForkedRank:
        """Fork a rank that runs target(*args), its stdout and stderr appended to log_path.
        workdir: its launch's folder, which the zygote removes if this process dies first.
        main: whether the rank runs the caller's main script first, as a spawned one does
        (how it finds a target defined there); False for a target that lives in a module."""
        # What spawn sends a new process: sys.path, working directory, the main script; not
        # multiprocessing's authentication key, which it refuses to pickle (a rank needs none).
        preparation = multiprocessing.spawn.get_preparation_data("zerolab-rank")
        preparation.pop("authkey", None)
        if not main:
            preparation.pop("init_main_from_path", None)
            preparation.pop("init_main_from_name", None)
        # The work stays pickled until the rank has run the preparation: unpickling it may
        # import the caller's modules, which belong in the rank, not in the zygote.
        request = pickle.dumps({"environ": dict(os.environ), "preparation": preparation,
                                "work": pickle.dumps((target, args)), "workdir": workdir})
        report_r, report_w = os.pipe()
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            with self._lock:
                socket.send_fds(self._socket, [request], [report_w, log])
                reply = self._socket.recv(_MAX_MESSAGE)
        except OSError:  # the zygote died (killed) since it last answered
            reply = b""
        finally:
            os.close(report_w)  # the zygote holds its own copy now
            os.close(log)
        if not reply:
            os.close(report_r)
            raise ZygoteUnavailable("the zygote died:\n" + self._output())
        pid = _INT.unpack(reply)[0]
        self._started = {p for p in self._started if pool.alive(p)} | {pid}
        return ForkedRank(pid, report_r)

    def ranks_running(self) -> list[int]:
        """The pids of the ranks running now that it forked for us: its children that have not
        exited (a pool's zygote has other processes' ranks too)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        # "pid (name) state ppid ...": the name may hold spaces and brackets
                        state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
                except (OSError, IndexError):  # exited while we looked
                    continue
                if int(ppid) == self.process.pid and state != "Z" and int(entry) in self._started:
                    pids.append(int(entry))
        return pids

    def close(self) -> None:
        """Close our end: our own zygote exits (removing its log); a pool's ends our ranks."""
        self._socket.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self._log_path:
            with contextlib.suppress(OSError):
                os.remove(self._log_path)

    def _output(self) -> str:
        """What the zygote printed, once it has died (which removes its log: this does, if
        the zygote could not)."""
        if not self._log_path:
            return "(a pool's zygote: its output is in its pool's folder)"
        try:
            with open(self._log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""
        finally:
            if self.process.poll() is not None:
                with contextlib.suppress(OSError):
                    os.remove(self._log_path)


def _imported() -> tuple[str, str]:
    """The files of zerolab and torch that this process imported (a zygote's must be these)."""
    package = os.path.dirname(os.path.dirname(__file__))  # zerolab/, above launcher/
    return os.path.join(package, "__init__.py"), torch.__file__


def hash_seeds(count: int, taken: set) -> list[int | str]:
    """A string-hash seed for each new zygote: the caller's PYTHONHASHSEED where it set one (as
    every rank of a torchrun job would inherit it), else a different random one each."""
    if "PYTHONHASHSEED" in os.environ:
        return [os.environ["PYTHONHASHSEED"]] * count
    seeds: list[int | str] = []
    while len(seeds) < count:
        seed = 1 + int.from_bytes(os.urandom(4), "little") % (2**32 - 1)  # 1..4294967295
        if seed not in taken and seed not in seeds:
            seeds.append(seed)
    return seeds


# --- in the zygote process ----------------------------------------------------------------------


# What every rank needs, imported once in the zygote (the launcher and the harness bring torch,
# torch.distributed and the engines along; torch's optimizers import torch._dynamo the first time
# one is built, seconds of CPU that every rank paid again). Named, not imported here: the
# zygote is part of the launcher, and the launcher does not depend on what it launches.
PRELOAD = ("torch.distributed", "torch._dynamo", "zerolab", "zerolab.harness")


class _Stop(BaseException):
    """SIGTERM or SIGHUP reached the zygote: clean up as if its caller had gone."""


def _stop(signum: int, frame: object) -> None:
    raise _Stop()


def serve(fd: int, log_path: str = "", listen: str = "") -> None:
    """The zygote: import what every rank needs, then fork one rank per request. listen: a
    socket path on which other processes connect too (a pool's zygote: pool.py)."""
    owner = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the ranks and the caller
    for name in PRELOAD:
        importlib.import_module(name)
    ready = pickle.dumps((sys.modules["zerolab"].__file__, torch.__file__, os.getpid()))
    listener = None
    if listen:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(listen)
        listener.listen(64)
    owner.send(ready)
    # Every caller's socket -> the folders of its launches; a rank's exit pipe -> (pid, report
    # fd, its caller's socket).
    callers: dict[socket.socket, set[str]] = {owner: set()}
    ranks: dict[int, tuple[int, int, socket.socket]] = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _stop)
    zygote = os.getpid()
    try:
        while True:
            for ready_one in multiprocessing.connection.wait(
                    [*callers, *ranks, *([listener] if listener else [])]):
                if ready_one is listener:
                    caller, _ = listener.accept()
                    caller.send(ready)
                    callers[caller] = set()
                elif ready_one in callers:
                    caller = ready_one
                    try:
                        request, fds, _, _ = socket.recv_fds(caller, _MAX_MESSAGE, 2)
                    except OSError:
                        request, fds = b"", []
                    if not request:  # this caller is gone: so are its ranks
                        if caller is owner:
                            return
                        _forget(caller, callers, ranks)
                        continue
                    report, log = fds
                    request = pickle.loads(request)
                    closed = [fd for exited, (_, theirs, _) in ranks.items()
                              for fd in (exited, theirs)]
                    closed += [s.fileno() for s in callers] + ([listener.fileno()] if listener
                                                               else [])
                    exited_r, pid = _fork_rank(request, log, report, closed)
                    os.close(log)
                    ranks[exited_r] = (pid, report, caller)
                    if request.get("workdir"):  # forget the folders removed since
                        workdirs = {w for w in callers[caller] if os.path.isdir(w)}
                        callers[caller] = workdirs | {request["workdir"]}
                    with contextlib.suppress(OSError):
                        caller.send(_INT.pack(pid))
                else:
                    pid, report, _ = ranks.pop(ready_one)
                    _, status = os.waitpid(pid, 0)
                    with contextlib.suppress(OSError):
                        os.write(report, _INT.pack(os.waitstatus_to_exitcode(status)))
                    os.close(report)
                    os.close(ready_one)
    except (_Stop, OSError):
        pass
    finally:
        if os.getpid() != zygote:  # a rank that failed before it could run: not the zygote
            os._exit(1)
        for caller in list(callers):
            _forget(caller, callers, ranks)
        if listen:
            with contextlib.suppress(OSError):
                os.remove(listen)
        if log_path:
            with contextlib.suppress(OSError):
                os.remove(log_path)
        os._exit(0)


def _forget(caller: socket.socket, callers: dict[socket.socket, set[str]],
            ranks: dict[int, tuple[int, int, socket.socket]]) -> None:
    """A caller has gone: kill its ranks (their process groups), whatever carries the mark of
    one of its launches, and remove their folders. Its ranks' exits are reaped as they come."""
    for pid, _, theirs in ranks.values():
        if theirs is caller:
            leftovers.kill_group(pid)
    for workdir in callers.pop(caller):
        leftovers.kill_marked(leftovers.LAUNCH, workdir)
        shutil.rmtree(workdir, ignore_errors=True)
    caller.close()


def _fork_rank(request: dict, log: int, report: int, closed: list[int]) -> tuple[int, int]:
    """Fork one rank; return (the read end of a pipe that closes when it exits, its pid).
    closed: the zygote's descriptors the rank closes (its sockets, other ranks' pipes)."""
    exited_r, exited_w = os.pipe()  # the rank holds the write end until it exits
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid:
        os.close(exited_w)
        return exited_r, pid
    # In the new rank. It leads a new session and process group, so that killing the group
    # ends whatever it starts too. Its output goes to its log before anything else runs.
    os.setsid()
    os.dup2(log, 1)
    os.dup2(log, 2)
    # The zygote's other descriptors are not the rank's: its sockets, the pipe on which the
    # zygote reports this rank's exit, and the pipes of the ranks forked before (holding one
    # would hide that rank's exit).
    for fd in (log, report, exited_r, *closed):
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    # Die with the zygote (which dies with the caller): Linux's "parent death signal".
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != zygote_pid:  # it died before the line above: nobody to report to
        os._exit(1)
    # A new process draws new seeds; a forked one would share the zygote's with every other
    # rank (Python's `random` reseeds itself after a fork; torch and numpy do not).
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["environ"])
        global running_main_again
        running_main_again = True
        try:
            multiprocessing.spawn.prepare(request["preparation"])
        except BaseException:
            print(STARTUP_FAILED, file=sys.stderr)
            raise
        running_main_again = False
        target, args = pickle.loads(request["work"])
        target(*args)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
