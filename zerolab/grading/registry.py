"""The table of exercises, gathered from each notebook's cases module, and `select`, which
finds exercises by file, id or function name.

A new exercise goes in its notebook's cases_NN module; a new notebook's module is found by
its name (cases_08.py, ...), in notebook order, and so is a notebook's second module, after its
first (cases_01_engine.py: the notebook's engine exercise).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path

from zerolab.grading.exercise import Exercise

_NOTEBOOKS = [importlib.import_module(f"zerolab.grading.{path.stem}")
              for path in sorted(Path(__file__).parent.glob("cases_[0-9][0-9]*.py"))]

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
            first, last = next(iter(EXERCISES)), list(EXERCISES)[-1]
            raise ValueError(f"no exercise called {name!r}: name a file ({', '.join(files)}), "
                             f"an exercise id ({first} to {last}) or a function")
        chosen += [ex for ex in found if ex not in chosen]
    return chosen
