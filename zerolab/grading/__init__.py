"""The exercises' grader, and the generator of exercises/ from solutions/.

In a notebook cell:

    from zerolab.grading import grade, hint
    grade("ex03")                     # your exercises/ex03_zero1.py, checked against the solution
    grade("ex03", path="my_copy")     # a copy of exercises/ of your own
    hint("3.1")                       # one more hint at each call; hint("3.1", all_levels=True)

From a shell: `python -m zerolab.grade [NAME ...] [--path FOLDER]` (exit status 1 if any
exercise is wrong). NAME is a file (ex03, ex03_zero1), an exercise id (3.1) or a function name;
`--list` lists the exercises and their kind (plain, ranks, engine); `--hints 3.1` prints
every hint of an exercise.

How an exercise is graded: the learner's function and the solution run on the same inputs
(several cases: uneven sizes, sizes smaller than the world size, the source article's examples)
and their outputs are compared, then the arguments the contract says to leave unchanged. A
distributed exercise runs on ranks spawned by zerolab.launch, on 1, 2 and 3 ranks, one launch
per world size for all the distributed exercises being graded; each rank compares its own
outputs, and also which zerolab.comm collectives were called and the bytes they sent. Plain
exercises run in this process.

Verdicts: passed / not attempted (the stub's NotImplementedError) / wrong, with where (world
size, rank, case), what (which output: expected against got, shape and max error), the
learner's own traceback lines when it raised (or, for a rank killed by a signal, the likely
cause), the kind of mistake when the grader recognises it, and a hint: that kind's, else the
exercise's general one.

The modules, one job each:

    registry     the table of exercises (EXERCISES) and `select`
    cases_NN     notebook NN's exercises: their cases, hints, known mistakes and outputs
    exercise     the Exercise, Case and Args records
    inputs       seeded inputs the cases share
    mistakes     kinds of mistakes, and the tests that recognise them
    compare      comparing outputs, and saying how they differ
    storage      snapshots of inputs, storages behind outputs, bytes held
    check        checking one case (in this process, or on a rank)
    runner       plain exercises here, distributed ones on spawned ranks; verdicts
    ranks        what each rank runs: watchdog, and agreement between ranks
    crashes      a rank killed by a signal: which, and the likely cause
    report       Result and Report, and their messages
    grader       `grade`, `grade_files` and `load`
    hints        `hint`: an exercise's hints, a level at a time
    generate     exercises/ from solutions/ (`make_exercises`, `check_exercises`)
    drift        what of an exercises/ file the generator owns (the rest is the learner's)
    cli          `python -m zerolab.grade`
    defaults     paths and default limits

Names starting with an underscore are shared between these modules only.
"""

from zerolab.grading.cli import main
from zerolab.grading.defaults import (
    DEFAULT_TIMEOUT,
    DEFAULT_WORLD_SIZES,
    EXERCISES_DIR,
    GRACE,
    REPO,
    SOLUTIONS_DIR,
    STARTUP_ALLOWANCE,
)
from zerolab.grading.exercise import Args, BadReturn, Case, Exercise
from zerolab.grading.generate import (
    BEGIN,
    END,
    check_exercises,
    exercise_source,
    generated_exercises,
    make_exercises,
)
from zerolab.grading.grader import grade, grade_files, load
from zerolab.grading.hints import hint, hint_levels
from zerolab.grading.inputs import SHAPE_GROUPS, STAGES
from zerolab.grading.mistakes import Evidence, Mistake
from zerolab.grading.registry import EXERCISES, select
from zerolab.grading.report import Report, Result

__all__ = [
    "BEGIN", "DEFAULT_TIMEOUT", "DEFAULT_WORLD_SIZES", "END", "EXERCISES", "EXERCISES_DIR",
    "GRACE", "REPO", "SHAPE_GROUPS", "SOLUTIONS_DIR", "STAGES", "STARTUP_ALLOWANCE",
    "Args", "BadReturn", "Case", "Evidence", "Exercise", "Mistake", "Report", "Result",
    "check_exercises", "exercise_source", "generated_exercises", "grade", "grade_files", "hint",
    "hint_levels", "load", "main", "make_exercises", "select",
]
