"""The exercises' grader, and the generator of exercises/ from solutions/.

In a notebook cell:

    from zerolab.grading import grade, hint
    grade("ex03")                     # your exercises/ex03_zero1.py, checked against the solution
    grade("ex03", path="my_copy")     # a copy of exercises/ of your own
    hint("3.1")                       # one more hint at each call; hint("3.1", all_levels=True)

From a shell: `python -m zerolab.grade [NAME ...] [--path FOLDER]` (exit status 1 if any
exercise is wrong, 0 when every one graded passed or was not attempted). NAME is a file
(ex03, ex03_zero1), an exercise id (3.1) or a function name; `--list` lists the exercises and
their kind (plain, ranks, engine); `--hints 3.1` prints every hint of an exercise.

How an exercise is graded. The learner's code never runs in the grader's process: each file is
imported and called in processes of their own (worker.py), rank r of every run forked from a
host with its own string-hashing seed (hosts.py), as separately started processes have. Those
processes first run the references (a distributed exercise's solution, an engine exercise's
zerolab engine) and hand their results over before any learner code is loaded; then they run
the learner's code on the same inputs and send back what it returned and what the grader
measured there, as data (data.py): outputs, the arguments it changed, the zerolab.comm
collectives it issued and their bytes (written down as issued: flight.py), and, for an engine,
every live storage of the rank from before the model was built (zerolab.memory's tracker over
the whole process, sorted by the grader's own categories: engine_memory.py). The comparison,
and the naming of mistakes, happen here (check.py, engine_verdict.py), out of the learner's
reach; a learner's file that replaces a function of torch, zerolab or the grader (or swaps its
code object) is reported (tamper.py), and a result that is not what the grader's code writes is
a wrong verdict, never a traceback. Time is kept and the processes are killed from outside
(session.py): a timeout, an exit, a crash or a flood of output is a wrong verdict that says what
happened.

Plain exercises run on one process, distributed ones on 1, 2 and 3 ranks, one run per world
size for all the files being graded; a file found wrong is not run again, and its remaining
cases are skipped as soon as one is found wrong.

Verdicts: passed / not attempted (the untouched stub, told from its text without running it) /
wrong, with where (world size, rank, case), what (which output: expected against got, shape
and max error; for an engine, which step, what was held and when, which collectives), the
learner's own traceback lines when it raised, what it printed when it was stopped, the kind of
mistake when the grader recognises it, and a hint: that kind's, else the exercise's general one.
An answer built on the reference (it imports solutions/, or its engine is built on zerolab's or
torch's) is "uses the reference", named, not passed (borrowed.py).

The sandbox: the references are computed before any learner code runs (plain exercises' in this
process, distributed ones' by the ranks, whose files are removed before learner code loads);
learner processes work in a scratch folder; the course's files (solutions/, zerolab/, the
exercise files not graded) are read before a grade and compared after every run, and a change
is put back and is a WRONG verdict (course.py).

The modules, one job each:

    registry     the table of exercises (EXERCISES) and `select`
    cases_NN     notebook NN's exercises: their cases, hints, known mistakes and outputs
    exercise     the Exercise, Case and Args records; how a returned tensor's memory is told
    inputs       seeded inputs the cases share (dtypes, non-contiguous views, uneven shapes)
    mistakes     kinds of mistakes, and the tests that recognise them
    compare      comparing outputs, and saying how they differ
    storage      snapshots of inputs, storages behind outputs, bytes held
    data         outputs as data, to and from the learner's processes
    call         calling a function exercise on a case, and measuring what it did
    kinds        what differs between function and engine exercises, in one place
    check        judging a function exercise's case, here
    engine_model the engine exercises' model, cases, stages and allowances
    engine_run   one engine case, run and measured in the learner's process
    engine_memory what a rank holds at each moment of the measured step, and at its peak
    engine_mistakes  the engine exercises' mistakes, by finding and by stage
    engine_verdict   judging an engine case, here
    worker       what each learner's process does
    hosts        the processes learner code runs in, and killing them
    session      one run, watched from here: timeouts, exits, crashes, floods
    runner       the runs of a grading, and a verdict per file
    flight       each rank's collectives as issued, compared across ranks
    crashes      a run that stopped early, explained
    tamper       replaced functions of torch, zerolab and the grader, seen
    borrowed     answers built on the reference (solutions/, zerolab's or torch's engines)
    course       the course's files, kept before a grade and put back after
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
    OUTPUT_LIMIT,
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
    "GRACE", "OUTPUT_LIMIT", "REPO", "SHAPE_GROUPS", "SOLUTIONS_DIR", "STAGES",
    "STARTUP_ALLOWANCE",
    "Args", "BadReturn", "Case", "Evidence", "Exercise", "Mistake", "Report", "Result",
    "check_exercises", "exercise_source", "generated_exercises", "grade", "grade_files", "hint",
    "hint_levels", "load", "main", "make_exercises", "select",
]
