"""The command line, `python -m zerolab.grade [NAME ...] [--path FOLDER]` (zerolab/grade.py
calls `main`): grade, list the exercises (with their kind: plain, ranks or engine), print an
exercise's hints, or make and check exercises/.

Exit status: 0 when nothing is wrong (or exercises/ matches solutions/), 1 when an exercise
is wrong (or exercises/ differs), 2 for a bad name or folder, or ranks that cannot start.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from zerolab.grading.defaults import DEFAULT_TIMEOUT, DEFAULT_WORLD_SIZES
from zerolab.grading.generate import check_exercises, make_exercises
from zerolab.grading.grader import grade
from zerolab.grading.hints import hint
from zerolab.grading.predictions import grade_predictions, is_prediction, list_lines
from zerolab.grading.registry import EXERCISES
from zerolab.grading.report import shown_path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line on `argv` (default: sys.argv[1:]); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m zerolab.grade",
        description="Grade the course's exercises against the solutions. Exit status 1 if "
                    "any is wrong.")
    parser.add_argument("names", nargs="*", help="files (ex03), exercise ids (3.1) or "
                                                 "function names; default: all. Predictions "
                                                 "(05.p1, 10.2, or a notebook: 05_zero3) are "
                                                 "graded when named")
    parser.add_argument("--path", help="folder with your exNN_*.py files (default: exercises/)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds one case may run (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                        help="ranks to run distributed exercises on (default 1,2,3)")
    parser.add_argument("--notebooks", help="folder with your notebooks, for predictions "
                                            "(default: notebooks/)")
    parser.add_argument("--list", action="store_true", help="list the exercises and exit")
    parser.add_argument("--make-exercises", action="store_true",
                        help="write exercises/ from solutions/ (overwrites exercises/)")
    parser.add_argument("--check-exercises", action="store_true",
                        help="exit 1 if exercises/ no longer holds what solutions/ generates "
                             "(your answers aside)")
    parser.add_argument("--exact", action="store_true",
                        help="with --check-exercises: compare whole files (the shipped stubs)")
    parser.add_argument("--hints", metavar="NAME",
                        help="print every hint of one exercise (id, file or function name)")
    args = parser.parse_args(argv)
    if args.list:
        for ex in EXERCISES.values():
            print(f"{ex.id:<4} {ex.module + '.' + ex.function:<38} {ex.kind:<6} {ex.teaches}")
        print("\n".join(list_lines()))  # ids NN.pK (10.1-10.5 in notebook 10)
        return 0
    if args.hints:
        try:
            hint(args.hints, all_levels=True)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.make_exercises:
        for path in make_exercises():
            print(f"wrote {shown_path(path)}")
        return 0
    if args.check_exercises:
        problems = check_exercises(exact=args.exact)
        print("\n".join(problems) if problems else "exercises/ matches solutions/")
        return 1 if problems else 0
    predicted = [name for name in args.names if is_prediction(name)]
    names = [name for name in args.names if not is_prediction(name)]
    try:
        world_sizes = tuple(int(n) for n in args.world_sizes.split(","))
        reports = [grade_predictions(predicted, args.notebooks)] if predicted else []
        if names or not predicted:
            reports.insert(0, grade(names, path=args.path, timeout=args.timeout,
                                    world_sizes=world_sizes))
    except (ValueError, RuntimeError) as e:  # a bad name or folder; ranks that cannot start
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(map(str, reports)))
    return 0 if all(r.ok for r in reports) else 1
