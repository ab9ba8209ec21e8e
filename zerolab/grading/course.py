"""The course's files, kept as they were before a grade: what a learner's answer changed in them
is found, reported and put back.

The course, for one grade, is what the grader's verdicts rest on and what an answer has no
business writing: solutions/ (the references), zerolab/ (the grader and what it measures with),
and the exercise files not being graded (exercises/, and the other ex*.py files of each folder
a graded file is in: another answer, or the stub of one). The files being graded are the
learner's own and are left out; so are notebooks/ (the learner's work, saved by Jupyter while
a grade runs) and everything else of the repository, which no verdict reads.

An exercise file is the learner's too, and may have been saved from an editor while a grade
ran: before one is put back, what was found in it is kept beside it (<file>.found-after-grading),
so that nothing typed is lost.

`snapshot(graded)` reads every file of the course (about 1.5 MB, in milliseconds) before any
learner code runs: the pristine copy, in this process's memory, where no learner process can
reach it.
`changes(before)` reads them again and lists what differs: changed, added, removed. `restore`
writes the pristine bytes back (and removes what was added). Python's bytecode caches
(__pycache__/*.pyc) are written by Python itself while a grade runs, so they are not reported;
`drop_caches` removes those added or changed since the snapshot all the same, since a forged
cache would run in place of its source in the next process (Python rewrites a removed cache).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from zerolab.grading.defaults import EXERCISES_DIR, REPO, SOLUTIONS_DIR

_TREES = (SOLUTIONS_DIR, REPO / "zerolab", EXERCISES_DIR)  # walked whole
_OURS = tuple(os.path.realpath(t) + os.sep for t in _TREES[:2])  # no learner's files in these
KEPT = ".found-after-grading"  # an exercise file's content, kept before it is put back


@dataclass(frozen=True)
class Snapshot:
    """The course's files as they were: path -> (bytes, permission bits)."""

    files: dict[str, tuple[bytes, int]]
    caches: dict[str, bytes]  # __pycache__ files: path -> bytes
    folders: tuple[str, ...]  # the other folders walked (graded files' own), one level deep
    graded: frozenset[str]  # the files left out: the learner's


@dataclass(frozen=True)
class Change:
    path: str
    how: str  # "changed", "added", "removed"

    def __str__(self) -> str:
        return f"{_shown(self.path)} {self.how}"


def _shown(path: str) -> str:
    try:
        return str(Path(path).relative_to(REPO.resolve()))
    except ValueError:
        return path


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # a folder where a file was, a file made unreadable: not what was there
        return None


def _walk(graded: frozenset[str], folders: Iterable[str]) -> tuple[list[str], list[str]]:
    """The course's files now: (sources, bytecode caches), real paths, symbolic links not
    followed (a link put in place of a file is listed, and compared as what it points to)."""
    sources, caches = [], []
    for tree in _TREES:
        for folder, dirs, names in os.walk(os.path.realpath(tree)):
            dirs.sort()
            for name in sorted(names):
                path = os.path.join(folder, name)
                if path in graded or name.endswith(KEPT):
                    continue
                (caches if os.path.basename(folder) == "__pycache__" else sources).append(path)
    inside = tuple(os.path.realpath(t) + os.sep for t in _TREES)
    for folder in folders:
        if (folder + os.sep).startswith(inside):
            continue  # walked above
        with contextlib.suppress(OSError):
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                if name.startswith("ex") and name.endswith(".py") and path not in graded:
                    sources.append(path)
    return sources, caches


def snapshot(graded: Iterable[str | os.PathLike]) -> Snapshot:
    """The course now, the `graded` files (the learner's) left out."""
    left_out = frozenset(os.path.realpath(p) for p in graded)
    folders = tuple(sorted({os.path.dirname(p) for p in left_out}))
    sources, caches = _walk(left_out, folders)
    files = {}
    for path in sources:
        content = _read(path)
        if content is not None:
            files[path] = (content, stat.S_IMODE(os.stat(path).st_mode))
    return Snapshot(files, {p: c for p in caches if (c := _read(p)) is not None}, folders,
                    left_out)


def changes(before: Snapshot) -> list[Change]:
    """What differs from `before` in the course's sources, in path order (caches aside)."""
    sources, _ = _walk(before.graded, before.folders)
    found = [Change(p, "added") for p in sources if p not in before.files]
    for path, (content, _) in before.files.items():
        now = _read(path) if os.path.lexists(path) else None
        if now is None and not os.path.lexists(path):
            found.append(Change(path, "removed"))
        elif now != content:
            found.append(Change(path, "changed"))
    return sorted(found, key=lambda c: c.path)


def restore(before: Snapshot, found: list[Change]) -> list[str]:
    """Put the course back as `before` had it: the changed and removed files rewritten, the
    added ones removed. What could not be put back, in words (empty: all of it)."""
    failed = []
    for change in found:
        try:
            if change.how == "changed" and not change.path.startswith(_OURS):
                with contextlib.suppress(OSError):  # an exercise file: keep what it held
                    shutil.copyfile(change.path, change.path + KEPT)
            _remove(change.path)
            if change.how != "added":
                content, mode = before.files[change.path]
                os.makedirs(os.path.dirname(change.path), exist_ok=True)
                tmp = change.path + ".zerolab-restore"
                with open(tmp, "wb") as f:
                    f.write(content)
                os.chmod(tmp, mode)
                os.replace(tmp, change.path)
        except OSError as e:
            failed.append(f"{_shown(change.path)}: {e}")
    return failed


def drop_caches(before: Snapshot) -> None:
    """Remove the bytecode caches added or changed since `before` (see the docstring)."""
    _, caches = _walk(before.graded, before.folders)
    for path in caches:
        if before.caches.get(path) != _read(path):
            with contextlib.suppress(OSError):
                _remove(path)


def _remove(path: str) -> None:
    """Remove whatever is at `path` now (a file, a link, a folder put in a file's place)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
