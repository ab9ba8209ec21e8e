"""Apply a unified diff (as `diff -u` or difflib writes it) to a text, by content.

The wrong answers the grader's tests use are kept as small diffs against solutions/ (the bug
and a little context), not as whole copies of the solution: a reader sees the bug at once, and
a change to a solution reaches every wrong answer built from it. Each hunk's old lines must
appear exactly once in the text; line numbers are not used.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path


def apply_diff(text: str, diff: str) -> str:
    """`text` with every hunk of `diff` applied; ValueError when a hunk does not fit."""
    for hunk in re.split(r"^@@[^\n]*@@\n", diff, flags=re.M)[1:]:
        old, new = [], []
        for line in hunk.splitlines(keepends=True):
            sign, body = line[:1], line[1:]
            if sign in (" ", "-"):
                old.append(body)
            if sign in (" ", "+"):
                new.append(body)
        before = "".join(old)
        if text.count(before) != 1:
            raise ValueError(f"a hunk's old lines appear {text.count(before)} times, not once:\n"
                             f"{before}")
        text = text.replace(before, "".join(new))
    return text


def build_folder(source: Path, dest: Path, solutions: Path) -> Path:
    """A copy of `source`'s folders at `dest`, each `<module>.diff` in them replaced by
    `<module>.py`: solutions/<module>.py with the diff applied. Other files are copied."""
    for path in sorted(source.rglob("*")):
        if path.is_dir() or path.suffix == ".md":
            continue
        target = dest / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".diff":
            solution = (solutions / f"{path.stem}.py").read_text()
            target.with_suffix(".py").write_text(apply_diff(solution, path.read_text()))
        else:
            shutil.copyfile(path, target)
    return dest
