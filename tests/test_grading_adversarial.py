"""Learners' files that try to fool or stop the grader (tests/grading_adversarial/): each is a
WRONG verdict saying what happened (or, for an answer made of the solution, "uses the
reference", naming what it used), the command line exits nonzero, and each is over within
four minutes, whatever the file does. The learner's code runs in processes of its own: the
comparison is in the grader's process, out of reach; a replaced function of torch, zerolab or
the grader is reported; time is kept, and the processes killed, from outside; output is capped.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from patches import answers

from zerolab import grading

TESTS = Path(__file__).resolve().parent
TIMEOUT = 10.0  # seconds a case may run: the hangs below are stopped then

# answer -> (world size, words the message must hold, the kind of mistake or "")
CAUGHT = {
    "2.1-patches-comm": (1, "your code replaced zerolab.comm.record_comm",
                         "the grader's tools patched"),
    "2.2-deadlock": (2, "timed out after 10 s during case 'shards of 1'", ""),
    "2.2-os-exit-on-rank-1": (2, "your code ended the process (exit status 0) during case", ""),
    "3.1-patches-while-called": (None, "zerolab.grading.exercise.memory_of",
                                 "the grader's tools patched"),
    "7.1-blinds-the-check": (None, "your code replaced zerolab.grading.tamper.replaced.__code__",
                             "the grader's tools patched"),
    "7.1-exit-at-import": (None, "does not import: SystemExit: 0", ""),
    "7.1-exit-in-function": (None, "raised SystemExit: 0", ""),
    "7.1-forges-a-result": (None, "your code replaced zerolab.grading.data.save in its process",
                            "the grader's tools patched"),
    "7.1-loop-at-import": (None, "timed out after 10 s while importing your file", ""),
    "7.1-loop-catching-everything": (None, "timed out after 10 s during case", ""),
    "7.1-os-exit-at-import": (None, "(exit status 0) while importing your file", ""),
    "7.1-os-exit-in-function": (None, "(exit status 0) during case", ""),
    "7.1-patches-the-check": (None, "your code replaced zerolab.grading.check.judge_case",
                              "the grader's tools patched"),
    "7.1-patches-torch": (None, "your code replaced torch.Tensor.__eq__",
                          "the grader's tools patched"),
    "7.1-prints-at-import": (None, "printed more than 1 MiB while importing your file", ""),
    "7.1-prints-forever": (None, "printed more than 1 MiB during case", ""),
    "7.1-rebinds-run": (None, "your code replaced zerolab.grading.kinds.run in its process",
                        "the grader's tools patched"),
    "7.1-swaps-the-code-of-run": (None, "your code replaced zerolab.grading.kinds.run.__code__",
                                  "the grader's tools patched"),
    "7.1-writes-into-its-events": (None, "your code wrote into the grader's record of the run "
                                         "while importing your file: the line 'all cases "
                                         "passed' is not one the grader writes",
                                   "the grader's files written"),
}

# answer -> (world size, words the message must hold): answers built on the solution
REFERENCE = {
    "2.3-imports-solutions": (1, "your code imports solutions/ex02_collectives.py"),
    "7.1-imports-solutions": (None, "from solutions.ex07_scaling import *): an answer built on "
                                    "the reference shows nothing of yours"),
    "7.1-imports-solutions-when-called": (None, "your code imports solutions/ex07_scaling.py"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    return answers(TESTS / "grading_adversarial", tmp_path_factory.mktemp("adversarial"),
                   TESTS.parent / "solutions")


@pytest.fixture(scope="module")
def graded(built) -> tuple[dict[str, grading.Result], float]:
    """Every file at once (the runs they stop are started again for the others), timed."""
    names = sorted(built)
    start = time.perf_counter()
    results = grading.grade_files([(n.split("-")[0], built[n]) for n in names],
                                  timeout=TIMEOUT, world_sizes=(1, 2))
    return dict(zip(names, results)), time.perf_counter() - start


def test_every_file_on_disk_is_listed():
    assert {p.stem for p in (TESTS / "grading_adversarial").glob("*.diff")} == \
        set(CAUGHT) | set(REFERENCE)


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_is_wrong_and_says_what_happened(graded, name):
    results, _ = graded
    world_size, words, mistake = CAUGHT[name]
    result = results[name]
    assert result.status == "wrong", str(result)
    assert result.world_size == world_size, str(result)
    assert words in " ".join(result.message.split()), str(result)
    assert result.mistake == mistake, str(result)
    assert result.timed_out == ("timed out" in words)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_each_answer_made_of_the_solution_is_named(graded, name):
    """At import (the file's text, or the modules its import loaded) or while its cases ran
    (a module imported from inside the function): told from what the process holds."""
    results, _ = graded
    world_size, words = REFERENCE[name]
    result = results[name]
    assert result.status == "uses the reference", str(result)
    assert result.world_size == world_size, str(result)
    assert words in " ".join(result.message.split()), str(result)
    assert "USES THE REFERENCE" in str(result) and "Write the answer yourself" in str(result)


def test_a_flood_is_capped_and_its_head_shown(graded):
    results, _ = graded
    flood = results["7.1-prints-forever"]
    assert flood.printed.startswith("the largest model so far:"), str(flood)
    text = str(flood)
    assert "its output began:" in text and len(text) < 4000


def test_all_of_them_within_four_minutes_each(graded):
    """Four hangs (each stopped at the timeout, then its run started again for the rest), the
    other files in the same runs: far below four minutes per file."""
    _, elapsed = graded
    assert elapsed < 4 * 60 * (len(CAUGHT) + len(REFERENCE))
    assert elapsed < 4 * 60 + 4 * (TIMEOUT + 60)  # generous: a loaded machine is slow


def test_the_command_line_exits_nonzero(built, tmp_path):
    """One learner's folder holding an exit at import, graded from the shell: WRONG, exit 1."""
    folder = built["7.1-os-exit-at-import"].parent
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "zerolab.grade", "7.1", "--path", str(folder),
                           "--timeout", "30"], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "7.1  ex07_scaling.largest_model             WRONG" in proc.stdout, proc.stdout
    assert "exit status 0" in proc.stdout
