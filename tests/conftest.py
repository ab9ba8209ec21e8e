"""Fixtures shared by several test files: the grader's, and the launches that several files' tests
read (one launch each, started by whichever of those files runs first)."""

import os
from pathlib import Path

import pytest
from workers import lessons as lesson_workers
from workers import nodes as node_workers

import zerolab
from zerolab import grading
from zerolab.grading.defaults import HASH_SEEDS
from zerolab.launcher import pool, zygote

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


# ---- zygotes shared by the whole run (zerolab/launcher/pool.py) ---------------------------------
# `make test` starts a kernel per notebook, grader processes and scripts besides its workers: each
# would start a zygote per rank index (about 5 s of CPU each, a hundred of them). With xdist, the
# controller starts one pool before its workers, which every process of the run inherits (ranks
# 0-3 and the grader's seeds). A nested pytest (a test's own) keeps the pool it inherits.

def pytest_configure(config: pytest.Config) -> None:
    if (not hasattr(config, "workerinput") and config.getoption("numprocesses", None)
            and pool.POOL_ENV not in os.environ):
        config.stash[POOL] = pool.Pool(ranks=4, seeds=HASH_SEEDS)


def pytest_unconfigure(config: pytest.Config) -> None:
    if POOL in config.stash:
        config.stash[POOL].close()


POOL = pytest.StashKey[pool.Pool]()


@pytest.fixture(scope="module")
def no_pool():
    """For tests of how zygotes start, die and clean up (and of scripts that start their own):
    this process's own zygotes, the pool out of the environment, for the module's tests."""
    folder = os.environ.pop(pool.POOL_ENV, None)
    zygote.Zygote.close_all()
    yield
    zygote.Zygote.close_all()
    if folder is not None:
        os.environ[pool.POOL_ENV] = folder


# ---- running in parallel (`make test` runs pytest-xdist: `-n N --dist loadscope`) --------------
# A worker takes a whole group: a file, or the files that read one shared launch above (so it
# runs once). Groups are handed out in the order below, the longest first (seconds on 2 cores,
# from `--durations`), so that no long one starts last while the other worker sits idle.
SHARED = {"test_lesson_n00_launch": "lessons_00_03", "test_lesson_n01_memory": "lessons_00_03",
          "test_lesson_n02_collectives": "lessons_00_03", "test_lesson_n03_zero1": "lessons_00_03",
          "test_lesson_n04_zero2": "lessons_04_07", "test_lesson_n05_zero3": "lessons_04_07",
          "test_lesson_n06_fsdp2": "lessons_04_07", "test_lesson_n07_scaling": "lessons_04_07",
          "test_hsdp": "nodes", "test_peers": "nodes", "test_zeropp": "nodes"}
LONGEST_FIRST = ["test_grading_engines", "test_grading", "test_zygote", "09_past_one_node",
                 "test_checkpoint", "test_engines", "06_fsdp2", "test_habits",
                 "test_grading_adversarial", "test_launch", "test_launch_cleanup",
                 "11_precision_and_optimizers", "test_browser", "10_bytes_to_seconds",
                 "test_predict", "test_grading_wrong", "test_lesson_n06_knobs", "test_train",
                 "test_pool", "08_activations", "test_bench", "09b_built_and_saved", "nodes",
                 "lessons_00_03", "lessons_04_07"]


def _group(path: str) -> str:
    """A test's group, from its file: "tests/test_hsdp.py" -> "nodes"."""
    stem = Path(path).stem
    return SHARED.get(stem, stem)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker (they collect; the controller hands out)
        rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
        # stable: a file's tests, a notebook's cells, keep their order
        items.sort(key=lambda item: rank.get(_group(item.nodeid.split("::")[0]), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: ignored where it is missing
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Hand out whole groups, not files: xdist's own `loadgroup` marks tests by rewriting their
    ids, which pytest 9.2 no longer lets it do (every notebook cell then ran in a kernel of its
    own)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::")[0])

    return ByGroup(config, log)
