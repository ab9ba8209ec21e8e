"""What went wrong in a launch, said for the learner: the errors, the scripts ranks cannot
start from, and what a rank's exit code, error file and output mean.

Everything here reads texts (a rank's traceback, its output), not processes: the launcher
(local.py) collects them, this module explains them.
"""

from __future__ import annotations

import ast
import math
import numbers
import os
import pickle
import signal
import sys
from collections.abc import Callable
from typing import Any

from zerolab.launcher.zygote import STARTUP_FAILED


class LaunchError(RuntimeError):
    """A launch could not start or did not finish."""


class WorkerError(LaunchError):
    """A rank failed; `rank` names it and the message says how, with the rank's own output.
    `explanation`: where each rank's collectives were, from their flight recorders."""

    def __init__(self, rank: int, message: str, explanation: str = ""):
        super().__init__(message)
        self.rank = rank
        self.explanation = explanation


class LaunchTimeout(LaunchError):
    """Ranks hung and were stopped: they waited on each other in collectives that could never
    complete, or made no progress for `timeout` seconds. The message says where each rank was
    and the first collective at which they differ (`explanation`, that part alone)."""

    def __init__(self, message: str, explanation: str = ""):
        super().__init__(message)
        self.explanation = explanation


class CollectiveMismatch(LaunchError):
    """Ranks passed different things to one collective (reduce op, dtype, size, root) and it
    returned all the same, its result wrong; the ranks were stopped. `ranks`: the two ranks
    named, `seq`: the call's number in its group; `explanation`: where each rank was and where
    their collectives first differ (zerolab.launcher.fingerprints)."""

    def __init__(self, message: str, ranks: tuple[int, int], seq: int, explanation: str = ""):
        super().__init__(message)
        self.ranks, self.seq, self.explanation = ranks, seq, explanation


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


def check_timeout(timeout: object) -> float | None:
    """A launch's timeout: seconds without progress (a positive, finite number), or None."""
    if timeout is None:
        return None
    if (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
            or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(
            f"timeout must be a positive number of seconds (how long the ranks may go without "
            f"progress before they are stopped) or None for no limit, got {timeout!r}")
    return float(timeout)


def check_threads(threads: object) -> int | None:
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive integer or None, got {threads!r}")
    return threads


def pickled_work(fn: Callable, args: object) -> bytes:
    """fn and args as the ranks will receive them; a clear error, before anything starts, for
    arguments that cannot be sent (pickled) to another process."""
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise ValueError(f"args must be a tuple (or list) of fn's arguments, got "
                         f"{type(args).__name__} {args!r:.60}: for one argument write "
                         f"args=(x,)")
    for i, arg in enumerate(args):
        try:
            pickle.dumps(arg)
        except Exception as e:
            raise ValueError(
                f"args[{i}] ({type(arg).__name__}) cannot be sent to the ranks, which receive "
                f"their arguments pickled: {e}. Pass what the ranks need to build it instead "
                f"(a path, a config), or build it inside the function.") from e
    return pickle.dumps((fn, tuple(args)))


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


def hang_error(stuck: list[int], timeout: float, certain: bool, still_s: float,
               explanation: str) -> LaunchTimeout:
    """The error for ranks stopped because they hung. certain: a deadlock seen for sure
    (zerolab.launcher.hangs.deadlocked), their collectives unchanged for still_s seconds; else
    `timeout` seconds passed without progress. explanation: where each rank was and where their
    collectives differ."""
    if certain:
        head = (f"ranks {stuck} were stopped: they wait on each other in collectives that can "
                f"never complete (none moved for {still_s:.1f}s)")
    else:
        head = (f"ranks {stuck} made no progress for {timeout:g}s (no collective issued or "
                f"completed, nothing printed, no CPU used) and were stopped")
    return LaunchTimeout(f"{head}.\n{explanation}", explanation)


def failure(rank: int, exitcode: int | None, error: str, output: str,
            fn_name: str, explanation: str = "") -> WorkerError:
    """The error for a rank that failed: what happened, the likely cause, where the ranks'
    collectives were (`explanation`, from their flight recorders), and its output.
    error: the traceback the rank wrote ("" if none); output: what it printed."""
    section = f"\n\n{explanation}" if explanation else ""
    if error:
        last_line = error.strip().splitlines()[-1]  # e.g. "KeyError: 'boom'"
        return WorkerError(rank, f"rank {rank} raised {last_line}{section}\n\n"
                                 f"Traceback from rank {rank}:\n{error}", explanation)
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
    elif STARTUP_FAILED in output or (
            "Traceback" in output and ("spawn_main" in output or "_bootstrap" in output)):
        # a traceback from multiprocessing's start-up code: before the worker could catch it
        head = (f"rank {rank} failed while starting, before it ran {fn_name}: "
                f"{_raised(output)}\n"
                f"{STARTUP_FIX}")
    else:
        head = (f"rank {rank} exited with code {exitcode} without a Python exception: the "
                f"function, or a library it called, ended the process (os._exit, sys.exit in "
                f"a thread, exit() in native code).")
    return WorkerError(rank, head + section + _output_section(rank, output), explanation)


def _raised(output: str) -> str:
    """The exception line the output's last traceback ends with (its first unindented line
    after "Traceback ..."), else the last line. Not simply the last line: a rank's stdout,
    buffered when it is not a terminal, can reach the log after its traceback."""
    lines = output.strip().splitlines()
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")), default=None)
    if start is not None:
        for line in lines[start + 1:]:
            if line and not line[0].isspace():
                return line
    return lines[-1] if lines else ""


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


