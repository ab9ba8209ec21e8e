"""Apply a unified diff (as `diff -u` or difflib writes it) to a text, by content.

The wrong answers the grader's tests use are kept as small diffs against solutions/ (the bug
and a little context), not as whole copies of the solution: a reader sees the bug at once, and
a change to a solution reaches every wrong answer built from it. Each hunk's old lines must
appear exactly once in the text; line numbers are not used.
"""

from __future__ import annotations

import re


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
