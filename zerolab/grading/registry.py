"""The table of exercises, gathered from each notebook's cases module, and `select`, which
finds exercises by file, id or function name.

A new exercise goes in its notebook's cases_NN module (a new notebook: a new module, listed
here, in order).
"""

from __future__ import annotations

from collections.abc import Sequence

from zerolab.grading import cases_01, cases_02, cases_03, cases_04, cases_05, cases_06, cases_07
from zerolab.grading.exercise import Exercise

_NOTEBOOKS = (cases_01, cases_02, cases_03, cases_04, cases_05, cases_06, cases_07)

EXERCISES: dict[str, Exercise] = {ex.id: ex for notebook in _NOTEBOOKS
                                  for ex in notebook.EXERCISES}


def select(names: Sequence[str] | str | None = None) -> list[Exercise]:
    """Exercises by file (ex03, ex03_zero1, 03, 3), id (3.1) or function name; None: all."""
    if names is None or names == [] or names == ():
        return list(EXERCISES.values())
    if isinstance(names, str):
        names = [names]
    chosen: list[Exercise] = []
    for name in names:
        key = name.removesuffix(".py")
        found = [ex for ex in EXERCISES.values()
                 if key in (ex.id, ex.function, ex.module, ex.module[:4], ex.notebook,
                            ex.notebook.lstrip("0"))]
        if not found:
            files = sorted({ex.module for ex in EXERCISES.values()})
            raise ValueError(f"no exercise called {name!r}: name a file ({', '.join(files)}), "
                             f"an exercise id (1.1 to 7.2) or a function")
        chosen += [ex for ex in found if ex not in chosen]
    return chosen
