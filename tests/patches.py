"""Apply a unified diff (as `diff -u` or difflib writes it) to a text, by content.

The wrong answers the grader's tests use are kept as small diffs against solutions/ (the bug
and a little context), not as whole copies of the solution: a reader sees the bug at once, and
a change to a solution reaches every wrong answer built from it. Each hunk's old lines must
appear exactly once in the text; line numbers are not used.

`answers(folder, dest, solutions)` turns a folder of such diffs, one learner's answer each
(`2.1-off-by-one.diff`: exercise 2.1, against the solution file its `---` line names), into
learners' files: dest/<name>/<module>.py.
"""

from __future__ import annotations

import re
from pathlib import Path

# A hunk header: "@@ -12,7 +12,8 @@", maybe followed by the function it is in (git diff).
_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@.*\n", re.M)
_SOURCE = re.compile(r"^--- (?:a/)?solutions/(\w+)\.py", re.M)


def apply_diff(text: str, diff: str) -> str:
    """`text` with every hunk of `diff` applied; ValueError when a hunk does not fit, or when
    `diff` has no hunk at all (a wrong answer would quietly become the solution)."""
    hunks = _HUNK.split(diff)[1:]
    if not hunks:
        raise ValueError("no hunk (no '@@ -a,b +c,d @@' line) in this diff")
    for hunk in hunks:
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


def answers(source: Path, dest: Path, solutions: Path) -> dict[str, Path]:
    """Each `<name>.diff` in `source` (a diff against solutions/<module>.py) as a learner's
    file dest/<name>/<module>.py; name -> that file, sorted by name."""
    if not source.is_dir():
        raise FileNotFoundError(f"no folder of answers at {source}")
    made = {}
    for path in sorted(source.glob("*.diff")):
        diff = path.read_text()
        found = _SOURCE.search(diff)
        if found is None:
            raise ValueError(f"{path}: no '--- solutions/<module>.py' line")
        module = found[1]
        try:
            text = apply_diff((solutions / f"{module}.py").read_text(), diff)
        except ValueError as e:
            raise ValueError(f"{path} does not fit solutions/{module}.py: {e}") from e
        target = dest / path.stem / f"{module}.py"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        made[path.stem] = target
    return made
