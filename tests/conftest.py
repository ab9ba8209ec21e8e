"""Fixtures shared by the grader's tests."""

from pathlib import Path

import pytest
from patches import build_folder

from zerolab import grading

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def wrong_root(tmp_path_factory) -> Path:
    """tests/grading_wrong and tests/grading_wrong_engines as learners' folders would hold them
    (<root>/grading_wrong/v1/ex02_collectives.py, ...): their files copied, and each diff
    against solutions/ applied to the solution (see tests/patches.py)."""
    root = tmp_path_factory.mktemp("wrong")
    for name in ("grading_wrong", "grading_wrong_engines"):
        build_folder(TESTS / name, root / name, TESTS.parent / "solutions")
    return root


@pytest.fixture(scope="session")
def wrong_answers(wrong_root) -> Path:
    """The plain and ranks exercises' wrong answers: <folder>/v1, v2, v3, v4, hang."""
    return wrong_root / "grading_wrong"


@pytest.fixture(scope="session")
def wrong_engines(wrong_root) -> Path:
    """The engine exercises' wrong (and rightly different) engines."""
    return wrong_root / "grading_wrong_engines"


@pytest.fixture
def stubs(tmp_path) -> Path:
    """Freshly generated stubs, a folder per test (tests change them): the repository's
    exercises/ may hold a learner's answers."""
    grading.make_exercises(exercises_dir=tmp_path / "stubs")
    return tmp_path / "stubs"
