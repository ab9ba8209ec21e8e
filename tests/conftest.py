"""Fixtures shared by several test files: the grader's, and the launches that several files' tests
read (one launch each, started by whichever of those files runs first)."""

from pathlib import Path

import pytest
from workers import lessons as lesson_workers
from workers import nodes as node_workers

import zerolab
from zerolab import grading

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def stubs(tmp_path) -> Path:
    """Freshly generated stubs, a folder per test (tests change them): the repository's
    exercises/ may hold a learner's answers."""
    grading.make_exercises(exercises_dir=tmp_path / "stubs")
    return tmp_path / "stubs"


# ---- launches that several test files share ------------------------------------------------------
# Starting ranks costs seconds, so one launch runs several lessons (or engines) at once and the
# test file of each lesson (or module) reads its results.

@pytest.fixture(scope="session")
def lessons_00_01_at_2() -> list[dict]:
    """Lessons 00 (first all-reduce) and 01 (DDP memory) on 2 ranks: tests/workers/lessons.py."""
    return zerolab.launch(lesson_workers.lessons_00_01_at_2, world_size=2, timeout=180)


@pytest.fixture(scope="session")
def lessons_00_03_at_4() -> list[dict]:
    """Lessons 00 (first all-reduce, process groups), 02 (collectives) and 03 (ZeRO-1) on 4
    ranks: tests/workers/lessons.py."""
    return zerolab.launch(lesson_workers.lessons_00_03_at_4, world_size=4, timeout=240)


@pytest.fixture(scope="session")
def lessons_04_07_at_2() -> list[dict]:
    """Lessons 04 (ZeRO-2), 05 (ZeRO-3), 06 (FSDP2) and 07 (scaling) on 2 ranks, on smaller
    models than the notebooks use: tests/workers/lessons.py."""
    return zerolab.launch(lesson_workers.lessons_04_07_at_2, world_size=lesson_workers.WORLD_04_07,
                          timeout=240)


@pytest.fixture(scope="session")
def nodes_at_4() -> list[dict]:
    """4 ranks as 2 "nodes" of 2: DDP, ZeRO-3, HSDP and the ZeRO++ variants, each trained with
    AdamW (bytes, memory, per-peer bytes) and with SGD (values), and torch's DDP, for
    test_hsdp.py, test_zeropp.py and test_peers.py: tests/workers/nodes.py."""
    return zerolab.launch(node_workers.everything, 4, timeout=900)


@pytest.fixture(scope="session")
def nodes_reference() -> dict:
    """nodes_at_4's SGD run in one process on the global batch."""
    return node_workers.reference()
