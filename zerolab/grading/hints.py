"""`hint("5.2")`: an exercise's hints, one level more at each call, for a learner who wants to
struggle first and ask for help a step at a time.

The levels: 1, the stub's own "Hint:" paragraph (read from the solution's docstring, which
the stub copies); 2, the exercise's general hint (what the grader says after a wrong answer
it cannot explain); then the exercise's further hints, each closer to the algorithm.
`hint("5.2", all_levels=True)` prints every level, and the mistakes the grader recognises.
"""

from __future__ import annotations

import ast
import textwrap

from zerolab.grading.defaults import SOLUTIONS_DIR
from zerolab.grading.exercise import Exercise
from zerolab.grading.registry import select

_SHOWN: dict[str, int] = {}  # exercise id -> the levels already printed


def _exercise(name: str) -> Exercise:
    found = select(name)
    if len(found) != 1:
        raise ValueError(f"{name!r} names several exercises; give an id such as 5.2")
    return found[0]


def _stub_hint(ex: Exercise) -> str:
    """The "Hint:" paragraph of the exercise's docstring ("" when there is none). For an engine
    (a class), the "Hint:" paragraphs of its methods, each after the method's name."""
    path = SOLUTIONS_DIR / f"{ex.module}.py"
    if not path.exists():
        return ""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == ex.function:
            text = _hint_paragraph(node)
            return text[:1].upper() + text[1:]
        if isinstance(node, ast.ClassDef) and node.name == ex.function:
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef)]
            return " ".join(f"{m.name}: {_hint_paragraph(m)}" for m in methods
                            if _hint_paragraph(m))
    return ""


def _hint_paragraph(node: ast.FunctionDef) -> str:
    _, found, after = (ast.get_docstring(node) or "").partition("Hint:")
    return " ".join(after.split("\n\n")[0].split()) if found else ""


def hint_levels(name: str) -> list[str]:
    """Every hint of an exercise (id, file or function name), from the vaguest."""
    ex = _exercise(name)
    return [h for h in (_stub_hint(ex), ex.hint, *ex.hints) if h]


def _show(ex: Exercise, level: int, levels: list[str]) -> str:
    body = textwrap.fill(levels[level - 1], width=96, initial_indent="  ",
                         subsequent_indent="  ")
    return f"Hint {level} of {len(levels)} for {ex.id} ({ex.function}):\n{body}"


def hint(name: str, all_levels: bool = False) -> None:
    """Print the next hint for an exercise (id "5.2", file or function name); with
    all_levels=True, print all of them and the mistakes the grader recognises."""
    ex = _exercise(name)
    levels = hint_levels(ex.id)
    if all_levels:
        print("\n".join(_show(ex, i, levels) for i in range(1, len(levels) + 1)))
        known = [m.kind for m in ex.mistakes]
        if known:
            print("Mistakes the grader recognises (each with its own hint when graded):")
            print("\n".join(f"  - {kind}" for kind in known))
        return
    level = _SHOWN.get(ex.id, 0) + 1
    if level > len(levels):
        print(f"No more hints for {ex.id}: that was the last of {len(levels)}. "
              f'hint("{ex.id}", all_levels=True) prints them all again.')
        return
    _SHOWN[ex.id] = level
    print(_show(ex, level, levels))
