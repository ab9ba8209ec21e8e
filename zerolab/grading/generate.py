'''The generator of exercises/ from solutions/.

`python -m zerolab.grade --make-exercises` rewrites exercises/ from solutions/, replacing each
`# BEGIN SOLUTION` ... `# END SOLUTION` block with
`raise NotImplementedError("Exercise N.M: <task>")`, the task being the first line of the
function's docstring. `--check-exercises` exits 1 when exercises/ and solutions/ differ.
'''

from __future__ import annotations

import ast
import re
from pathlib import Path

from zerolab.grading.defaults import EXERCISES_DIR, SOLUTIONS_DIR

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_EXERCISE_ID = re.compile(r"Exercise (\d+\.\d+): (.+)")
_GENERATED_NOTE = """
# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401
"""
_EXERCISES_INIT = '''"""The course's exercises: stubs to complete, one file per notebook (01-07).

Each function's docstring states the task, the shapes and a hint. Check your work with
`from zerolab.grading import grade; grade("ex03")` in a notebook, or
`python -m zerolab.grade ex03` in a shell. To work on a copy instead (several learners side
by side): `cp -r exercises my_copy`, then `grade("ex03", path="my_copy")` or
`python -m zerolab.grade ex03 --path my_copy`.

Generated from solutions/ by `python -m zerolab.grade --make-exercises` (which overwrites the
files here: keep your work in a copy, or commit it first).
"""
'''


def exercise_source(solution: str, filename: str = "<solution>") -> str:
    """A solution file's text with each marked block replaced by the exercise's stub."""
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
        indent = line[:len(line) - len(line.lstrip())]
        message = '"Exercise ' + match[1] + ": " + match[2].replace('"', "'") + '"'
        stub = f"{indent}raise NotImplementedError({message})"
        if len(stub) > 100:  # the project's line length: the message on a line of its own
            stub = f"{indent}raise NotImplementedError(\n{indent}    {message})"
        out.append(stub + "\n")
        i = end + 1
    text = "".join(out)
    docstring_end = tree.body[0].end_lineno if tree.body and _is_docstring(tree.body[0]) else 0
    head = text.splitlines(keepends=True)
    return "".join(head[:docstring_end]) + _GENERATED_NOTE + "".join(head[docstring_end:])


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


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


def check_exercises(solutions_dir: Path = SOLUTIONS_DIR,
                    exercises_dir: Path = EXERCISES_DIR) -> list[str]:
    """Where exercises/ differs from what solutions/ generates (empty: in sync)."""
    expected = generated_exercises(solutions_dir)
    problems = []
    for name, text in expected.items():
        path = Path(exercises_dir) / name
        if not path.exists():
            problems.append(f"{path} is missing")
        elif path.read_text() != text:
            problems.append(f"{path} differs from what {Path(solutions_dir) / name} generates")
    for path in sorted(Path(exercises_dir).glob("ex[0-9][0-9]_*.py")):
        if path.name not in expected:
            problems.append(f"{path} has no solution in {solutions_dir}")
    return problems
