'''The generator of exercises/ from solutions/.

`python -m zerolab.grade --make-exercises` rewrites exercises/ from solutions/, replacing each
`# BEGIN SOLUTION` ... `# END SOLUTION` block with
`raise NotImplementedError("Exercise N.M: <task>")`, the task being the first line of the
function's docstring. `--check-exercises` exits 1 when exercises/ no longer holds what the
generator wrote (a learner's answers aside; `--exact`: whole files, the shipped stubs).
'''

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

from zerolab.grading.defaults import EXERCISES_DIR, SOLUTIONS_DIR
from zerolab.grading.drift import first_missing, is_docstring

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_EXERCISE_ID = re.compile(r"Exercise (\d+\.\d+): (.+)")
_GENERATED_NOTE = """
# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401
"""
_EXERCISES_INIT = '''"""The course's exercises: stubs to complete (ex03_*.py: notebook 03's).

Each function's docstring states its contract (inputs, what it returns, the rules, what the
grader checks) and a short hint; the notebook teaches the rest, and
`from zerolab.grading import hint; hint("3.1")` gives one more hint at each call.
Check your work with `from zerolab.grading import grade; grade("ex03")` in a notebook, or
`python -m zerolab.grade ex03` in a shell. To work on a copy instead (several learners side
by side): `cp -r exercises my_copy`, then `grade("ex03", path="my_copy")` or
`python -m zerolab.grade ex03 --path my_copy`.

Generated from solutions/ by `python -m zerolab.grade --make-exercises` (which overwrites the
files here: keep your work in a copy, or commit it first).
"""
'''


def exercise_source(solution: str, filename: str = "<solution>",
                    answer: Callable[[str, str], str] | None = None) -> str:
    """A solution file's text with each marked block replaced by the exercise's stub.

    answer: instead of the stub, what a learner wrote: answer(exercise id, the block's lines)
    gives the lines to put there (tests and tests/mutation.py make learners' files so).
    """
    tree = ast.parse(solution, filename)
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = solution.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END:
            raise ValueError(f"{filename}:{i + 1}: {END} without {BEGIN}")
        if line.strip() != BEGIN:
            out.append(line)
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip() in (BEGIN, END)), None)
        if end is None or lines[end].strip() != END:
            raise ValueError(f"{filename}:{i + 1}: {BEGIN} without its {END}")
        around = [f for f in functions if f.lineno <= i + 1 <= (f.end_lineno or 0)]
        if not around:
            raise ValueError(f"{filename}:{i + 1}: {BEGIN} outside a function")
        docstring = ast.get_docstring(max(around, key=lambda f: f.lineno)) or ""
        match = _EXERCISE_ID.match(docstring.splitlines()[0] if docstring else "")
        if match is None:
            raise ValueError(f"{filename}:{i + 1}: the function's docstring must start with "
                             f"'Exercise N.M: <task>'")
        i, block = end + 1, "".join(lines[i + 1:end])
        if answer is not None:
            out.append(answer(match[1], block))
            continue
        indent = line[:len(line) - len(line.lstrip())]
        message = '"Exercise ' + match[1] + ": " + match[2].replace('"', "'") + '"'
        stub = f"{indent}raise NotImplementedError({message})"
        if len(stub) > 100:  # the project's line length: the message on a line of its own
            stub = f"{indent}raise NotImplementedError(\n{indent}    {message})"
        out.append(stub + "\n")
    text = "".join(out)
    docstring_end = tree.body[0].end_lineno if tree.body and is_docstring(tree.body[0]) else 0
    head = text.splitlines(keepends=True)
    return "".join(head[:docstring_end]) + _GENERATED_NOTE + "".join(head[docstring_end:])


def generated_exercises(solutions_dir: Path = SOLUTIONS_DIR) -> dict[str, str]:
    """File name -> text of every file exercises/ should hold."""
    files = {"__init__.py": _EXERCISES_INIT}
    for path in sorted(Path(solutions_dir).glob("ex[0-9][0-9]_*.py")):
        files[path.name] = exercise_source(path.read_text(), str(path))
    return files


def make_exercises(solutions_dir: Path = SOLUTIONS_DIR,
                   exercises_dir: Path = EXERCISES_DIR) -> list[Path]:
    """Write exercises/ from solutions/; return the files written."""
    exercises_dir = Path(exercises_dir)
    exercises_dir.mkdir(exist_ok=True)
    written = []
    for name, text in generated_exercises(solutions_dir).items():
        (exercises_dir / name).write_text(text)
        written.append(exercises_dir / name)
    return written


def check_exercises(solutions_dir: Path = SOLUTIONS_DIR, exercises_dir: Path = EXERCISES_DIR,
                    exact: bool = False) -> list[str]:
    """Where exercises/ differs from what solutions/ generates (empty: in sync).

    By default a learner's answers are not differences: only what the generator owns is
    compared (see zerolab.grading.drift), so a solved exercises/ is in sync. exact=True
    compares whole files: the untouched stubs the course ships.
    """
    expected = generated_exercises(solutions_dir)
    problems = []
    for name, text in expected.items():
        path = Path(exercises_dir) / name
        if not path.exists():
            problems.append(f"{path} is missing")
            continue
        mine = path.read_text()
        if exact or name == "__init__.py":
            if mine != text:
                problems.append(f"{path} differs from what {Path(solutions_dir) / name} "
                                f"generates")
            continue
        try:
            missing = first_missing(text, mine)
        except SyntaxError as e:
            problems.append(f"{path} does not parse (line {e.lineno}): cannot compare it")
            continue
        if missing is not None:
            problems.append(f"{path}: {missing} differs from the course's version (only the "
                            f"bodies of the exercise functions are yours to change)")
    for path in sorted(Path(exercises_dir).glob("ex[0-9][0-9]_*.py")):
        if path.name not in expected:
            problems.append(f"{path} has no solution in {solutions_dir}")
    return problems
