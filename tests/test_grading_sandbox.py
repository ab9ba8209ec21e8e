"""The grader's sandbox, from a learner's side: answers that write into the course, look for
the expected answers, or run from the project's folder.

- an answer that rewrites solutions/ex07_scaling.py when imported (so that the reference
  agrees with its wrong answer) is WRONG, named for what it changed; the file is put back; a
  plain wrong answer graded in the same grading stays WRONG (the course was not corrupted for
  it), and the rewriting one is told apart from it (a run whose files changed the course is run
  again a file at a time);
- a learner's process starts in a scratch folder, not the project's, and finds no reference
  (ref-*.pt) in the folders it can reach through /proc/self/fd.

They run in a copy of the repository (zerolab/, solutions/, exercises/), graded from a process
of its own: an answer here really writes into solutions/, which must not be the repository's
while other tests grade from it.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# At import, rewrites the solution so that it rounds as this wrong answer does, and notes
# where it runs; its own answer rounds (19 parameters "fit" where 18 do).
REWRITES = '''
import os
import zerolab

_solution = os.path.join(os.path.dirname(os.path.dirname(zerolab.__file__)), "solutions",
                         "ex07_scaling.py")
with open(_solution) as f:
    _text = f.read()
with open(_solution, "w") as f:
    f.write(_text.replace("math.floor(Fraction(memory_bytes) * n / per_param_n)",
                          "round(Fraction(memory_bytes) * n / per_param_n)"))
with open({notes!r}, "w") as f:
    f.write(os.getcwd())
'''

# At import, looks through every file its process holds open for a folder with references in
# it, and notes what it found and where it runs.
SNOOPS = '''
import glob
import json
import os

_seen = set()
for _fd in os.listdir("/proc/self/fd"):
    try:
        _seen.add(os.path.dirname(os.readlink(f"/proc/self/fd/{{_fd}}")))
    except OSError:
        pass
_refs = sorted(p for d in _seen if d.startswith("/") and not d.startswith(("/dev", "/proc"))
               for p in glob.glob(os.path.join(d, "ref-*")) + glob.glob(os.path.join(d, "*",
                                                                                      "ref-*")))
import sys
import zerolab
with open({notes!r}, "w") as f:
    json.dump({{"cwd": os.getcwd(), "pwd": os.environ.get("PWD"), "refs": _refs,
               "grader": sorted(m for m in sys.modules if m.startswith("zerolab.grading")),
               "zerolab.grading": hasattr(zerolab, "grading"),
               # pytest's own variable names the test file: the caller's, not the grader's
               "environment": sorted(k for k, v in os.environ.items()
                                     if k != "PYTEST_CURRENT_TEST" and ("grad" in k.lower()
                                     or "zerolab.grading" in v or "zerolab-grade" in v))}}, f)
'''

# At import, starts a process in a session of its own (out of the rank's process group) that
# would sleep for 5 minutes, and notes its pid.
ORPHAN = '''
import subprocess
import sys
_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                          start_new_session=True)
with open({notes!r}, "w") as f:
    f.write(str(_child.pid))
'''

# Each runs into one of the learner's process's limits when its function is called.
HUNGRY = '''

def largest_model(memory_bytes, world_size, stage, precision="fp32"):
    return len(bytearray(4 << 30))  # 4 GiB, past the memory limit the test sets
'''
WRITER = '''

def largest_model(memory_bytes, world_size, stage, precision="fp32"):
    with open("big", "wb") as f:
        f.write(bytes(2 << 20))  # 2 MiB, past the file-size limit the test sets
    return 0
'''
SPINNER = '''

def largest_model(memory_bytes, world_size, stage, precision="fp32"):
    while True:  # past the CPU-time limit the test sets, long before the timeout
        pass
'''

GRADE = '''
import json, sys
from zerolab import grading
from zerolab.grading import defaults
defaults.MEMORY_LIMIT, defaults.FILE_LIMIT, defaults.CPU_LIMIT = 3 << 30, 1 << 20, 2
items = json.loads(sys.argv[1])
results = grading.grade_files(items, timeout=60, world_sizes=(1,))
print(json.dumps([[r.status, " ".join(r.message.split()), r.mistake] for r in results]))
'''


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sandbox")
    copy = tmp / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("zerolab", "solutions", "exercises"):
        shutil.copytree(REPO / folder, copy / folder, ignore=ignore)
    scaling = (REPO / "solutions" / "ex07_scaling.py").read_text()
    rounded = scaling.replace("math.floor(Fraction(memory_bytes) * n / per_param_n)",
                              "round(Fraction(memory_bytes) * n / per_param_n)")
    assert rounded != scaling
    files = {"rewrites": ("7.1", "ex07_scaling.py", rounded + REWRITES.format(
                 notes=str(tmp / "rewrites-cwd"))),
             "wrong": ("7.1", "ex07_scaling.py", rounded),
             "snoops": ("2.3", "ex02_collectives.py",
                        (REPO / "solutions" / "ex02_collectives.py").read_text()
                        + SNOOPS.format(notes=str(tmp / "snoops.json"))),
             "orphan": ("7.1", "ex07_scaling.py", scaling + ORPHAN.format(
                 notes=str(tmp / "orphan-pid"))),
             "hungry": ("7.1", "ex07_scaling.py", scaling + HUNGRY),
             "writer": ("7.1", "ex07_scaling.py", scaling + WRITER),
             "spinner": ("7.1", "ex07_scaling.py", scaling + SPINNER)}
    items = []
    for name, (exercise, module, text) in files.items():
        (tmp / name).mkdir()
        (tmp / name / module).write_text(text)
        items.append((exercise, str(tmp / name / module)))
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", GRADE, json.dumps(items)], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = dict(zip(files, json.loads(proc.stdout.splitlines()[-1])))
    return {"results": results, "copy": copy, "tmp": tmp}


def test_an_answer_that_rewrites_the_solution_is_wrong_and_it_is_put_back(graded):
    status, message, mistake = graded["results"]["rewrites"]
    assert status == "wrong" and mistake == "the course's files changed", message
    assert "your code changed the course's files: solutions/ex07_scaling.py changed" in message
    assert "put back as they were" in message
    assert (graded["copy"] / "solutions" / "ex07_scaling.py").read_bytes() == \
        (REPO / "solutions" / "ex07_scaling.py").read_bytes()


def test_a_wrong_answer_graded_beside_it_stays_wrong(graded):
    """The reference it is compared with is the pristine solution's, not the rewritten one."""
    status, message, mistake = graded["results"]["wrong"]
    assert status == "wrong" and mistake == "rounded up or to the nearest, not down", message


def test_learner_code_runs_in_a_scratch_folder_and_sees_no_reference(graded):
    copy = str(graded["copy"])
    cwd = (graded["tmp"] / "rewrites-cwd").read_text()
    notes = json.loads((graded["tmp"] / "snoops.json").read_text())
    for where in (cwd, notes["cwd"], notes["pwd"]):
        assert not where.startswith(copy), where
    assert notes["refs"] == []
    assert graded["results"]["snoops"][0] == "passed", graded["results"]["snoops"]


def test_learner_code_finds_nothing_of_the_grader(graded):
    """No module of the grader by name, no zerolab.grading attribute, no variable that says
    so: an answer cannot behave only while graded."""
    notes = json.loads((graded["tmp"] / "snoops.json").read_text())
    assert notes["grader"] == [] and not notes["zerolab.grading"], notes
    assert notes["environment"] == [], notes
    assert "grad" not in notes["cwd"], notes


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_a_process_started_in_a_session_of_its_own_does_not_outlive_the_grade(graded):
    pid = int((graded["tmp"] / "orphan-pid").read_text())
    assert not _alive(pid), f"process {pid} outlived the grade"
    assert graded["results"]["orphan"][0] == "passed", graded["results"]["orphan"]


@pytest.mark.parametrize("name, words", [
    ("hungry", "past the grader's memory limit: 3072 MiB per process"),
    ("writer", "past the grader's file-size limit: 1 MiB"),
    ("spinner", "killed by SIGXCPU"),
])
def test_each_limit_is_named_when_hit(graded, name, words):
    status, message, _ = graded["results"][name]
    assert status == "wrong" and words in message, message
    if name == "spinner":
        assert "the grader's CPU-time limit per case allows" in message and ": 2 s" in message
