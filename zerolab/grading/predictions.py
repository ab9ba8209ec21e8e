"""Grading the prediction exercises (zerolab.lessons.predictions): a number the learner wrote in
a notebook, against a fresh measurement.

    python -m zerolab.grade 05.p1              # one prediction
    python -m zerolab.grade 05_zero3           # every prediction of a notebook
    python -m zerolab.grade 10.1 --notebooks my_copy/

The learner's number is read from the notebook file, never by running the learner's code: the
.ipynb's JSON is parsed, the last code cell that assigns the prediction's variable
(`predicted_... = ...`) is found, and its value is taken if it is a plain number or arithmetic
of numbers (`4 * 28_032 + 112`); `None` is "not attempted"; anything else (a name, a call) is
refused unread: "not a number". The measurement runs the prediction's `measure` function
("module:function", called with the id), which launches ranks of zerolab's own code; the
verdict is predictions.score's: right, or which way and by how much it missed.

Ids: notebook 10's are "10.1" to "10.5"; notebooks 01 to 09 have "NN.pK" (01b's "01b.p1"), so
that none reads as a code exercise's id (1.1 ... 9.3).
"""

from __future__ import annotations

import ast
import importlib
import json
import operator
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from zerolab.grading.defaults import REPO
from zerolab.lessons.predictions import PREDICTIONS, PredictionExercise, Score
from zerolab.lessons.predictions import score as lessons_score

NOTEBOOKS_DIR = REPO / "notebooks"
UNITS = {"bytes": "bytes", "count": "a count", "seconds": "seconds", "tokens": "tokens"}


class NotANumber(ValueError):
    """The learner's cell assigns something that is not a number or arithmetic of numbers."""


def is_prediction(name: str) -> bool:
    """`name` is a prediction's id or a notebook that has predictions (its file stem, with or
    without .ipynb)."""
    key = name.removesuffix(".ipynb")
    return key in PREDICTIONS or any(p.notebook == key for p in PREDICTIONS.values())


def select(names: Sequence[str]) -> list[PredictionExercise]:
    """Predictions by id ("05.p1", "10.2") or notebook stem ("05_zero3"), in the table's order."""
    keys = {name.removesuffix(".ipynb") for name in names}
    unknown = [k for k in keys if not is_prediction(k)]
    if unknown:
        raise ValueError(f"no prediction called {unknown[0]!r}: name an id "
                         f"({', '.join(PREDICTIONS)}) or a notebook")
    return [p for p in PREDICTIONS.values() if p.id in keys or p.notebook in keys]


# ---- reading the learner's number, without running anything ----------------------------------

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow, ast.LShift: operator.lshift}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_LARGEST = 1e30  # a bound on every intermediate (10 ** 10 ** 10 must not hang the grader)


def _number(node: ast.expr) -> float:
    """The value of a number, or of arithmetic of numbers; NotANumber for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return ast.literal_eval(node)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_number(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _number(node.left), _number(node.right)
        if isinstance(node.op, ast.Pow | ast.LShift) and abs(right) > 128:
            raise NotANumber("an exponent or shift over 128")
        try:
            value = _BINARY[type(node.op)](left, right)
        except (ZeroDivisionError, OverflowError, ValueError) as e:
            raise NotANumber(str(e)) from None
        if abs(value) > _LARGEST:
            raise NotANumber("a number over 1e30")
        return value
    raise NotANumber(ast.unparse(node))


def _assignments(source: str, name: str) -> list[ast.expr]:
    """The values assigned to `name` at the top level of a cell (`name = ...`), in order. A cell
    that is not plain Python (a %magic) is read line by line."""
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = []
        for line in source.splitlines():
            try:
                body += ast.parse(line.strip()).body
            except SyntaxError:
                continue
    values = []
    for node in body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == name for t in node.targets):
            values.append(node.value)
        elif (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
              and node.target.id == name and node.value is not None):
            values.append(node.value)
    return values


def read_prediction(notebook: str | os.PathLike, name: str) -> float | None:
    """The number the notebook's last assignment to `name` holds (None: not attempted).

    Raises FileNotFoundError (no notebook), LookupError (no cell assigns `name`) or
    NotANumber (the value is not a number or arithmetic of numbers: never evaluated)."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    values = [v for c in cells if c.get("cell_type") == "code"
              for v in _assignments("".join(c.get("source", "")), name)]
    if not values:
        raise LookupError(f"no cell assigns {name}")
    value = values[-1]
    if isinstance(value, ast.Constant) and value.value is None:
        return None
    try:
        return _number(value)
    except NotANumber:  # say what the cell holds, not which part of it is not a number
        raise NotANumber(ast.unparse(value)) from None


# ---- grading ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Graded:
    """One prediction's verdict."""

    prediction: PredictionExercise
    status: str  # "right", "wrong", "not attempted", "not a number", "error"
    message: str
    score: Score | None = None

    def line(self) -> str:
        p = self.prediction
        return f"  {p.id:<7}{p.notebook:<28}{p.name:<31}{self.status}: {self.message}"


def measure(p: PredictionExercise) -> float:
    """Run the prediction's measurement (it launches ranks of zerolab's own code)."""
    module, function = p.measure.split(":")
    return float(getattr(importlib.import_module(module), function)(p.id))


def grade_prediction(p: PredictionExercise, folder: str | os.PathLike | None = None,
                     measure_fn: Callable[[PredictionExercise], float] = measure) -> Graded:
    """Read the learner's number from `folder`/<notebook>.ipynb, measure, score."""
    path = Path(folder if folder is not None else NOTEBOOKS_DIR) / f"{p.notebook}.ipynb"
    unit = UNITS[p.kind]
    try:
        predicted = read_prediction(path, p.name)
    except FileNotFoundError:
        return Graded(p, "error", f"no notebook {path}")
    except LookupError:
        return Graded(p, "not attempted", f"no cell of {path.name} assigns {p.name}; "
                                          f"write `{p.name} = ...` ({unit}) in the notebook")
    except NotANumber as e:
        return Graded(p, "not a number", f"{p.name} = {e}: write a number ({unit}), or "
                                         f"arithmetic of numbers")
    if predicted is None:
        return Graded(p, "not attempted", f"{p.name} is None: {p.question}")
    if p.kind != "seconds":
        score = p.score(predicted, measure_fn(p))
        return Graded(p, "right" if score.ok else "wrong", score.message + _unit(p, score),
                      score)
    # A time is this machine's: measured REPEATS times here, scored against their median
    # within a band from their spread (a number measured on another machine misses it).
    times = sorted(measure_fn(p) for _ in range(REPEATS))
    median = times[len(times) // 2]
    spread = (times[-1] - times[0]) / median if median > 0 else 0.0
    band = min(p.band, max(BAND_FLOOR, 2 * spread))
    score = lessons_score(predicted, median, p.kind, band=band)
    told = (f" ({REPEATS} measurements on this machine, median {median * 1e3:.3g} ms, spread "
            f"{spread:.0%}: the band is ±{band:.0%})")
    return Graded(p, "right" if score.ok else "wrong", score.message + told + _unit(p, score),
                  score)


REPEATS = 5  # measurements of a time on the learner's machine
BAND_FLOOR = 0.10  # the narrowest band a time is scored within, however quiet the machine
# A prediction off by one of these factors was most likely written in another unit.
_UNITS = {"seconds": {1e3: "milliseconds", 1e6: "microseconds"},
          "bytes": {1 / 1024: "KiB", 1 / 1024 ** 2: "MiB", 1 / 1024 ** 3: "GiB", 8: "bits",
                    1 / 4: "fp32 elements"}}


def _unit(p: PredictionExercise, score: Score) -> str:
    """A hint when a wrong prediction is the measurement in another unit (within 35%)."""
    if score.ok or not score.ratio:
        return ""
    for factor, unit in _UNITS.get(p.kind, {}).items():
        if abs(score.ratio / factor - 1) <= 0.35 and abs(score.ratio - 1) > 0.35:
            return (f". Your number is about {factor:g}x the measurement: written in {unit}? "
                    f"The prediction is in {UNITS[p.kind]}")
    return ""


@dataclass
class PredictionReport:
    """What grading several predictions gives; prints as a table."""

    results: list[Graded]
    folder: Path

    @property
    def ok(self) -> bool:
        """Nothing wrong: no miss, no unreadable number, no missing notebook."""
        return all(g.status in ("right", "not attempted") for g in self.results)

    def __str__(self) -> str:
        counts = {s: sum(g.status == s for g in self.results)
                  for s in ("right", "wrong", "not a number", "not attempted", "error")}
        return "\n".join([f"Predictions in {self.folder}/", *(g.line() for g in self.results),
                          f"{len(self.results)} predictions: "
                          + ", ".join(f"{v} {k}" for k, v in counts.items() if v or k in
                                      ("right", "wrong", "not attempted"))])


def grade_predictions(names: Sequence[str], folder: str | os.PathLike | None = None
                      ) -> PredictionReport:
    """Grade the predictions named (ids or notebook stems) in the notebooks of `folder`
    (default: the course's notebooks/)."""
    chosen = select(names)
    return PredictionReport([grade_prediction(p, folder) for p in chosen],
                            Path(folder if folder is not None else NOTEBOOKS_DIR))


def list_lines() -> list[str]:
    """What --list shows for the predictions, under a line that says how they are named, in
    the code exercises' columns (id, where, kind, what)."""
    return ["predictions: ids NN.pK, notebook NN's K-th (10.1-10.5: notebook 10's); graded from "
            "your notebook when named: python -m zerolab.grade 05.p1 (or 05_zero3)",
            *[f"{p.id:<6} {p.notebook + ':' + p.name:<38} prediction  {p.question}"
              for p in PREDICTIONS.values()]]
