"""Whether a file in exercises/ still holds what the generator wrote, a learner's work aside.

The generator owns a file's top-level statements: the module docstring, the imports, the
constants, the given functions (whole), and each exercise function's decorators, signature
and docstring. The learner owns the body of every exercise function (a function whose
docstring starts with "Exercise N.M:"), all of it, and may add statements of their own
(imports, helpers) anywhere. An engine exercise is a class whose methods are exercises: the
generator owns its header, its docstring and its given methods, the learner the bodies of
its exercise methods (and any methods they add). Comments between statements are not compared.

`_owned_parts` cuts a file's text into the parts the generator owns; a learner's file is in
sync when the generated file's parts appear in it, in order, unchanged.
"""

from __future__ import annotations

import ast
import re

_EXERCISE_DOC = re.compile(r"Exercise \d+\.\d+:")


def _is_exercise(node: ast.stmt) -> bool:
    return (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and bool(_EXERCISE_DOC.match(ast.get_docstring(node) or "")))


def _owned_parts(text: str) -> list[tuple[str, str]]:
    """The generator's parts of a file: (a short name for messages, the part's text)."""
    return _parts(ast.parse(text).body, text.splitlines(), "")


def _parts(body: list[ast.stmt], lines: list[str], owner: str) -> list[tuple[str, str]]:
    """Parts of a module's (or, owner="Class.", an engine class's) statements. A class with
    exercise methods (an engine) is cut further: its header and docstring, then each method;
    so the bodies of its exercise methods are the learner's, as a function's are."""
    parts = []
    for node in body:
        start = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
        end = node.end_lineno or node.lineno
        if _is_exercise(node):
            end = node.body[0].end_lineno or end  # the docstring; the body is the learner's
            name = f"the signature or docstring of {owner}{node.name}()"
        elif isinstance(node, ast.ClassDef) and any(_is_exercise(n) for n in node.body):
            first = node.body[0]
            head_end = (first.end_lineno if is_docstring(first) else first.lineno - 1) or end
            parts.append((f"`{lines[start - 1].strip()}`", _join(lines, start, head_end)))
            inner = node.body[1:] if is_docstring(first) else node.body
            parts += _parts(inner, lines, f"{node.name}.")
            continue
        elif is_docstring(node) and not owner:
            name = "the module docstring"
        else:  # a given statement: in a class, name the class too (methods share names)
            name = f"`{lines[start - 1].strip()}`" + (f" in {owner[:-1]}" if owner else "")
        parts.append((name, _join(lines, start, end)))
    return parts


def is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def _join(lines: list[str], start: int, end: int) -> str:
    """Lines start..end (1-based, inclusive), trailing spaces dropped."""
    return "\n".join(line.rstrip() for line in lines[start - 1:end])


def first_missing(generated: str, learner: str) -> str | None:
    """The first part of `generated` missing (or changed) in `learner`, or None when every
    part is there, in order. Raises SyntaxError when `learner` does not parse."""
    theirs = iter([text for _, text in _owned_parts(learner)])
    for name, text in _owned_parts(generated):
        if not any(text == t for t in theirs):  # consumes `theirs` up to the match: in order
            return name
    return None
