"""A progress bar on stderr, drawn by the launching process for work done on rank 0.

Spawned ranks write their output to log files (zerolab.launch keeps a notebook's output clean),
so rank 0 appends its progress to a file (`ProgressFile`) and a thread in the launcher replays
it on a `ProgressBar` (`follow_progress`). `python -m zerolab.bench` and `python -m
zerolab.train` use it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from zerolab.launcher import leftovers


class ProgressBar:
    """A one-line text progress bar: `bench [#########.........] 12/40 zero3`.

    On a terminal it redraws in place; elsewhere (CI logs) it prints a line every 10%.
    Called as `bar(done, total, label)`; `bar.message(text)` prints a line above it.
    """

    def __init__(self, title: str, stream: TextIO | None = None, width: int = 30):
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last_tenth = -1  # non-terminal: last 10% mark printed
        self._line = ""  # what is on the terminal's current line now

    def __call__(self, done: int, total: int, label: str = "") -> None:
        frac = done / total if total else 1.0
        filled = int(round(self.width * frac))
        line = (f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] "
                f"{done}/{total} {label}").rstrip()
        if self.tty:
            self._draw(line)
            if done >= total:
                self._newline()
        elif int(frac * 10) > self._last_tenth or done >= total:
            self._last_tenth = int(frac * 10)
            self.stream.write(line + "\n")
            self.stream.flush()

    def message(self, text: str) -> None:
        if self.tty and self._line:
            self.stream.write("\r" + " " * len(self._line) + "\r")
        self.stream.write(text + "\n")
        if self.tty and self._line:
            self.stream.write(self._line)
        self.stream.flush()

    def _draw(self, line: str) -> None:
        self.stream.write("\r" + line.ljust(len(self._line)))
        self.stream.flush()
        self._line = line

    def _newline(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
        self._line = ""


@dataclass(frozen=True)
class ProgressFile:
    """Rank 0's end of a progress bar drawn by another process: appends JSON lines to a file.

    Spawned ranks write their output to log files, so the launching process draws the bar
    (`follow_progress`). Same call signature as ProgressBar.
    """

    path: str  # the file the launcher follows

    def __call__(self, done: int, total: int, label: str = "") -> None:
        self._write({"done": done, "total": total, "label": label})

    def message(self, text: str) -> None:
        self._write({"message": text})

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


Progress = ProgressBar | ProgressFile


@contextlib.contextmanager
def follow_progress(bar: ProgressBar, poll_s: float = 0.1) -> Iterator[ProgressFile]:
    """Yield a ProgressFile for rank 0; a thread replays what it writes on `bar` meanwhile."""
    # Named with its owner: if this process is killed, the next launch removes the file.
    fd, path = tempfile.mkstemp(prefix=f"{leftovers.PROGRESS_PREFIX}{leftovers.owner_id()}-",
                                suffix=".jsonl")
    os.close(fd)
    stop = threading.Event()

    def replay(f: TextIO) -> None:
        for line in f.readlines():
            if not line.endswith("\n"):  # a record still being written: read it next time
                f.seek(f.tell() - len(line.encode()))
                break
            record = json.loads(line)
            if "message" in record:
                bar.message(record["message"])
            else:
                bar(record["done"], record["total"], record["label"])

    def follow() -> None:
        with open(path) as f:
            while not stop.wait(poll_s):
                replay(f)
            replay(f)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield ProgressFile(path)
    finally:
        stop.set()
        thread.join(timeout=5)
        os.remove(path)
