"""The exercises' grader, and the generator of exercises/ from solutions/.

In a notebook cell:

    from zerolab.grading import grade
    grade("ex03")                     # your exercises/ex03_zero1.py, checked against the solution
    grade("ex03", path="my_copy")     # a copy of exercises/ of your own

From a shell: `python -m zerolab.grade [NAME ...] [--path FOLDER]` (exit status 1 if any
exercise is wrong). NAME is a file (ex03, ex03_zero1), an exercise id (3.1) or a function name;
`--list` lists the exercises.

How an exercise is graded: the learner's function and the solution run on the same inputs
(several cases: uneven sizes, sizes smaller than the world size, the seeds' examples) and
their outputs are compared. A distributed exercise runs on ranks spawned by zerolab.launch, on
1, 2 and 3 ranks, one launch per world size for all the distributed exercises being graded;
each rank compares its own outputs, and also which zerolab.comm collectives were called and
the bytes they sent. Plain exercises run in this process.

Verdicts: passed / not attempted (the stub's NotImplementedError) / wrong, with where (world
size, rank, case), what (which output: expected against got, shape and max error), the
learner's own traceback lines when it raised, and a hint.

The modules, one job each:

    registry     the table of exercises (EXERCISES) and `select`
    cases_NN     notebook NN's exercises: their cases, hints and outputs
    exercise     the Exercise and Case records
    inputs       seeded inputs the cases share
    compare      comparing outputs, and saying how they differ
    check        checking one case (in this process, or on a rank)
    runner       plain exercises here, distributed ones on spawned ranks; verdicts
    ranks        what each rank runs: watchdog, and agreement between ranks
    report       Result and Report, and their messages
    grader       `grade` and `load`
    generate     exercises/ from solutions/ (`make_exercises`, `check_exercises`)
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
from zerolab.grading.exercise import BadReturn, Case, Exercise
from zerolab.grading.generate import (
    BEGIN,
    END,
    check_exercises,
    exercise_source,
    generated_exercises,
    make_exercises,
)
from zerolab.grading.grader import grade, load
from zerolab.grading.inputs import SHAPE_GROUPS, STAGES
from zerolab.grading.registry import EXERCISES, select
from zerolab.grading.report import Report, Result

__all__ = [
    "BEGIN", "DEFAULT_TIMEOUT", "DEFAULT_WORLD_SIZES", "END", "EXERCISES", "EXERCISES_DIR",
    "GRACE", "REPO", "SHAPE_GROUPS", "SOLUTIONS_DIR", "STAGES", "STARTUP_ALLOWANCE",
    "BadReturn", "Case", "Exercise", "Report", "Result",
    "check_exercises", "exercise_source", "generated_exercises", "grade", "load", "main",
    "make_exercises", "select",
]
