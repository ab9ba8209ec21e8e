"""Nothing left behind: what a launch creates, how it is marked, and how it is cleaned up.

A launch creates processes (its ranks, and whatever they start), a folder (zerolab-launch-*,
the ranks' rendezvous, logs, results and flight recorders) and, once per caller, the zygote's
log. All are removed when the launch ends, however it ends:

- it returns or raises (a rank failed, a hang, Ctrl-C): `launch` kills every rank's process
  group (each rank leads its own, so its children and grandchildren go with it) and anything
  else carrying the launch's mark, then removes the folder;
- its caller is killed outright (SIGKILL, SIGTERM): the zygote sees its caller's socket close
  and does the same for every launch of that caller, then removes its own log and exits;
- caller and zygote are killed together (a whole process group killed): the ranks die with the
  zygote (their parent-death signal), and what outlives them (their own children, the folders,
  the log) is cleaned by the next launch on this machine, which finds them by their owner.

Marks: the zygote's environment, and so every rank's and every child's, names the caller (its
pid and start time: `owner_id`, never reused while it lives); each rank's environment names
its launch's folder. Processes are found by their /proc/PID/environ, which a process cannot
lose by changing its session or process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import time

OWNER = "ZEROLAB_OWNER"  # the caller that launched: "pid.start_time.pid_namespace"
LAUNCH = "ZEROLAB_LAUNCH"  # a rank's launch folder
LAUNCH_PREFIX = "zerolab-launch-"
ZYGOTE_PREFIX = "zerolab-zygote-"
POOL_PREFIX = "zerolab-pool-"  # a pool's folder of zygote sockets (pool.py)
PROGRESS_PREFIX = "zerolab-progress-"
OWNER_FILE = "owner"  # in a launch folder: its owner_id
UNOWNED_AGE_S = 24 * 3600  # a launch folder with no owner file (older zerolab) is stale after


def owner_id(pid: int | None = None) -> str:
    """A process's identity: its pid, its start time (a pid alone is reused) and its pid
    namespace (another container sharing this temporary folder counts its pids apart)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}.{_start_time(pid)}.{_pid_namespace()}"


def owner_alive(owner: str) -> bool:
    """Whether the process `owner_id` named is alive; True where this process cannot tell (it
    lives in another pid namespace): only what is surely dead is cleaned up."""
    parts = owner.split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return False
    pid, start, namespace = parts
    if namespace != str(_pid_namespace()):
        return True
    try:
        return str(_start_time(int(pid))) == start
    except (OSError, ValueError):
        return False


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int:
    """Clock ticks since boot at which `pid` started (0 where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            raise  # Linux, and no such process
        return 0


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads (a rank and its children); the process alone if it
    leads none (it had not reached setsid yet)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    except PermissionError:  # the group id was reused by another user's process: not ours
        pass


def kill_marked(name: str, value: str) -> list[int]:
    """SIGKILL every process of this user whose environment holds name=value (not this one).
    Returns their pids. Nothing where there is no /proc."""
    mark = f"{name}={value}".encode() + b"\0"
    killed = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return killed
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = b"\0" + f.read()
        except OSError:  # gone, or another user's
            continue
        if b"\0" + mark in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


def new_workdir() -> str:
    """A fresh launch folder, marked with its owner (this process)."""
    workdir = tempfile.mkdtemp(prefix=LAUNCH_PREFIX)
    with open(os.path.join(workdir, OWNER_FILE), "w") as f:
        f.write(owner_id())
    return workdir


def clean_stale(tmpdir: str | None = None) -> list[str]:
    """Remove what launches of dead callers left in `tmpdir`: their processes, launch folders,
    zygote logs and progress files. Returns the paths removed."""
    tmpdir = tmpdir or tempfile.gettempdir()
    try:
        names = os.listdir(tmpdir)
    except OSError:
        return []
    removed, dead = [], set()
    for name in names:
        path = os.path.join(tmpdir, name)
        owner = _owner_of(path, name)
        if owner is None or owner_alive(owner):
            continue
        if owner:
            dead.add(owner)
        with contextlib.suppress(OSError):
            if os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
            removed.append(path)
    for owner in dead:  # processes a dead caller's ranks left (their children)
        kill_marked(OWNER, owner)
    return removed


def _owner_of(path: str, name: str) -> str | None:
    """The owner_id named by a leftover ("" for a launch folder too old to have one), or None
    if `path` is not zerolab's."""
    if name.startswith(LAUNCH_PREFIX):
        try:
            with open(os.path.join(path, OWNER_FILE)) as f:
                return f.read().strip()
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(path).st_mtime > UNOWNED_AGE_S:
                    return ""
            return None
        except OSError:
            return None
    for prefix in (ZYGOTE_PREFIX, PROGRESS_PREFIX, POOL_PREFIX):
        found = re.match(re.escape(prefix) + r"(\d+\.\d+\.\d+)-", name)  # <prefix><owner>-*
        if found:
            return found.group(1)
    return None
