"""Correct answers written independently of the solutions (tests/grading_right/): the grader
passes every one. It measures outputs, memory, collectives and bytes, not the solution's
way of getting them. (The engines' correct variants are in test_grading_engines.py.)"""

import shutil
from pathlib import Path

import pytest
from patches import answers

from zerolab import grading

TESTS = Path(__file__).resolve().parent
RIGHT, SOLUTIONS = TESTS / "grading_right", TESTS.parent / "solutions"
FUNCTIONS = [i for i, ex in grading.EXERCISES.items() if ex.kind != "engine"]


@pytest.fixture(scope="module")
def right(tmp_path_factory) -> Path:
    """A learner's folder holding every answer (each a diff against its solution)."""
    built = tmp_path_factory.mktemp("right")
    folder = built / "exercises"
    folder.mkdir()
    for path in answers(RIGHT, built / "each", SOLUTIONS).values():
        shutil.copy(path, folder / path.name)
    return folder


@pytest.fixture(scope="module")
def report(right) -> grading.Report:
    return grading.grade(FUNCTIONS, path=right, timeout=240.0)


@pytest.mark.parametrize("exercise_id", FUNCTIONS)
def test_an_answer_written_otherwise_passes(report, exercise_id):
    result = report[exercise_id]
    assert result.status == "passed", str(result)


def test_they_are_not_the_solutions(right):
    """Each answer's body differs from its solution's (the files keep the docstrings)."""
    from zerolab.grading import BEGIN, exercise_source
    solutions = SOLUTIONS
    modules = {ex.module for i, ex in grading.EXERCISES.items() if i in FUNCTIONS}
    assert {p.stem for p in right.glob("ex*.py")} == modules
    for path in sorted(right.glob("ex*.py")):
        bodies: list[str] = []

        def keep(exercise_id: str, block: str, bodies: list[str] = bodies) -> str:
            bodies.append(block.strip())
            return block
        exercise_source((solutions / path.name).read_text(), answer=keep)
        mine = path.read_text()
        assert BEGIN not in mine
        for body in bodies:
            assert body not in mine, (path.name, body[:60])
