"""Fixtures shared by the grader's tests."""

from pathlib import Path

import pytest

from zerolab import grading

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def stubs(tmp_path) -> Path:
    """Freshly generated stubs, a folder per test (tests change them): the repository's
    exercises/ may hold a learner's answers."""
    grading.make_exercises(exercises_dir=tmp_path / "stubs")
    return tmp_path / "stubs"
