"""The bytes this process has written, as the Linux kernel counts them.

The kernel keeps, for every thread, the bytes it passed to write(2) and writev(2) (`wchar` in
/proc/self/task/<tid>/io), and for the whole process the sum over its threads, exited ones
included (/proc/self/io). gloo's TCP transport sends with writev, from its own threads, so the
difference of two readings taken around a collective is what that collective put on the wire
from this rank, headers included: a measurement, next to the ring formula's model.

    before = wire.read(threading.get_native_id())
    ...                                   # a gloo collective
    after = wire.read(threading.get_native_id())
    after.process - before.process        # bytes this rank sent

`read` returns None where there is nothing to read (not Linux, /proc not mounted); callers then
fall back to the ring model. Reading costs a few microseconds: the files stay open and are read
again from offset 0, which makes the kernel regenerate them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Written:
    """Two counters, read one right after the other (bytes written since each one started)."""

    process: int  # every thread of the process, live or exited
    thread: int  # one thread: the one that issues collectives (and runs the user's code)


# (pid, path) -> open file descriptor. The pid is in the key because /proc/self is resolved when
# a file is opened: a descriptor inherited through fork() would go on reading the parent.
_open_files: dict[tuple[int, str], int] = {}


def _wchar(path: str) -> int:
    key = (os.getpid(), path)
    if key not in _open_files:
        _open_files[key] = os.open(path, os.O_RDONLY)
    text = os.pread(_open_files[key], 1024, 0)  # "rchar: ...\nwchar: 123\n..."
    start = text.index(b"wchar:") + len(b"wchar:")
    return int(text[start:text.index(b"\n", start)])


def read(thread: int) -> Written | None:
    """Bytes written so far by this process and by thread `thread` (a native thread id).

    None where the kernel does not expose them, or the thread has exited.
    """
    try:
        return Written(process=_wchar("/proc/self/io"),
                       thread=_wchar(f"/proc/self/task/{thread}/io"))
    except (OSError, ValueError):
        return None
