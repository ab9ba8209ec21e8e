"""Notebook 00's measurements (zerolab.lessons.n00_launch) on real ranks: the first all-reduce,
process groups, and a rank that fails.

The first all-reduce runs inside two launches that other lessons' tests share (conftest.py:
lessons_00_01_at_2 and lessons_00_03_at_4); the failing rank has a launch of its own.
"""

from __future__ import annotations

import pytest

import zerolab
from zerolab.lessons import n00_launch


@pytest.mark.parametrize("fixture", ["lessons_00_01_at_2", "lessons_00_03_at_4"])
def test_first_all_reduce_sums_and_sends_the_ring_figure(fixture, request):
    results = request.getfixturevalue(fixture)
    n = len(results)
    for rank, r in enumerate(results):
        first = r["first"]
        assert (first.rank, first.world_size) == (rank, n)
        assert first.before == [(rank + 1) * v for v in (1, 10, 100)]
        assert first.after == [n * (n + 1) // 2 * v for v in (1, 10, 100)]
        (event,) = first.log.events
        assert (event.op, event.nbytes) == ("all_reduce", 12)
        assert first.log.total_ring_bytes() == 2 * (n - 1) * 12 // n
    assert len({r["first"].pid for r in results}) == n


def test_process_groups_reduce_within_pairs(lessons_00_03_at_4):
    for rank, r in enumerate(lessons_00_03_at_4):
        groups = r["groups"]
        assert groups.rank == rank
        assert groups.pair == [rank - rank % 2, rank - rank % 2 + 1]
        assert groups.rank_in_pair == rank % 2
        assert groups.world_sum == 1 + 2 + 3 + 4
        assert groups.pair_sum == sum(p + 1 for p in groups.pair)


def test_fail_on_is_reported_by_rank_and_leaves_nothing_running():
    import multiprocessing

    with pytest.raises(zerolab.WorkerError) as info:
        zerolab.launch(n00_launch.fail_on, world_size=3, args=(2,))
    assert info.value.rank == 2
    assert str(info.value).splitlines()[0] == (
        "rank 2 raised ValueError: rank 2 found a NaN in its batch")
    assert multiprocessing.active_children() == []


def test_ranks_hash_strings_as_separate_pythons_do():
    """Notebook 00's hang section prints this: each rank salts str hashes with its own seed, as
    torchrun's ranks (new Pythons) do, unless the caller fixed PYTHONHASHSEED for all of them."""
    import os

    hashes = zerolab.launch(n00_launch.string_hash, world_size=3)
    if "PYTHONHASHSEED" in os.environ:
        assert len(set(hashes)) == 1
    else:
        assert len(set(hashes)) == 3


def test_where_they_parted_keeps_the_last_line_without_the_racy_verbs():
    verdict = ("Where each rank was (from its flight recorder):\n  rank 0 died, ...\n"
               "The ranks' collectives first differ at #1: rank 0 died in all_gather #1 (40 B); "
               "rank 1 failed in all_gather #1 (32 B): the ranks called all_gather with "
               "different sizes at #1.")
    assert n00_launch.where_they_parted(verdict) == (
        "The ranks' collectives first differ at #1: rank 0 at all_gather #1 (40 B); rank 1 at "
        "all_gather #1 (32 B): the ranks called all_gather with different sizes at #1.")
    for verb in ("waits in", "called", "issued"):
        assert n00_launch.where_they_parted(f"rank 2 {verb} x #4") == "rank 2 at x #4"
    skipped = "rank 1 never issued #3: it returned: rank 1 skipped all_reduce #3"
    assert n00_launch.where_they_parted(skipped) == skipped


def test_a_deadlocks_headline_loses_its_measured_seconds():
    """The launcher's own message (zerolab/launcher/diagnose.py) with a measured 1.1 s in it."""
    from zerolab.launcher.diagnose import hang_error

    head = str(hang_error([0, 1], 120.0, True, 1.1, "where each rank was")).splitlines()[0]
    assert "1.1s" in head
    assert n00_launch._SECONDS.sub("", head) == (
        "ranks [0, 1] were stopped: they wait on each other in collectives that can never "
        "complete.")
