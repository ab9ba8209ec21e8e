"""The flight recorder (zerolab/wire/flight.py) and what the launcher says when ranks hang or
abort (zerolab/launcher/hangs.py): every rank's last collectives, through zerolab.comm and
torch.distributed, and the first sequence number at which the ranks' records disagree."""

import time

import pytest
from workers import hangs as H

import zerolab
from zerolab.launcher import hangs
from zerolab.wire import flight

TIMEOUT = 60  # far above what any case takes: each must end well before it


def hang(fn, world_size=2, args=(), timeout=TIMEOUT):
    """Launch a case that must hang or abort; (the error, its message, seconds taken)."""
    start = time.perf_counter()
    with pytest.raises((zerolab.LaunchTimeout, zerolab.WorkerError)) as info:
        zerolab.launch(fn, world_size, args=args, timeout=timeout)
    return info.value, str(info.value), time.perf_counter() - start


# --- what is recorded ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded():
    return zerolab.launch(H.recorded_calls, 3)


def test_every_call_is_recorded_once_with_its_sequence_number(recorded):
    for rank, result in enumerate(recorded):
        log = result["log"]
        assert log.rank == rank and log.world_size == 3 and log.phase == "running"
        world = [e for e in log.entries if e.kind == flight.COLLECTIVE and e.ranks == (0, 1, 2)]
        # One entry per call the code made: zerolab's all-gather (3 broadcasts on gloo), its
        # reduce-scatter (send/recv pairs) and broadcast_object_list (2 broadcasts) once each.
        assert [(e.seq, e.op, e.tag) for e in world] == [
            (1, "all_reduce", ""), (2, "all_reduce", "test/ar"), (3, "all_gather", "test/ag"),
            (4, "reduce_scatter", "test/rs"), (5, "broadcast_object_list", ""),
            (6, "all_reduce", ""), (7, "barrier", "")]
        assert all(e.state == "completed" and e.t_done >= e.t_issue > 0 for e in log.entries)
        assert (world[0].shape, world[0].dtype, world[0].nbytes) == ("(6,)", "float32", 24)
        assert (world[2].shape, world[2].dtype, world[2].nbytes) == ("(6,)", "float64", 48)
        assert world[3].nbytes == 9 * 4  # S: the reduce-scatter's input
        assert world[5].async_op and result["async_before_wait"] == "issued"
        assert world[4].peer == 0 and not world[4].comparable  # objects: sizes may differ


def test_groups_and_point_to_point_are_numbered_apart(recorded):
    logs = [r["log"] for r in recorded]
    pairs = [[(e.seq, e.op) for e in log.entries if e.ranks == (0, 1)
              and e.kind == flight.COLLECTIVE] for log in logs]
    assert pairs == [[(1, "all_reduce")], [(1, "all_reduce")], []]
    p2p = [[(e.seq, e.op, e.peer) for e in log.entries if e.kind == flight.P2P] for log in logs]
    assert p2p == [[(1, "send", 1)], [(1, "recv", 0)], []]


def test_the_record_of_a_rank_killed_outright_is_read_all_the_same(tmp_path):
    """SIGKILL: no Python runs at the end, yet its entries (written to a mapped file as it went)
    are in the error, next to those of the rank that waited for it."""
    err, message, _ = hang(H.record_then_die, args=(str(tmp_path),))
    assert isinstance(err, zerolab.WorkerError) and err.rank == 1, message
    assert message.startswith("rank 1 was killed by SIGKILL"), message
    assert ("rank 1 died, killed by SIGKILL; its last collective: broadcast #3 (24 B float32, "
            "shape (6,), from rank 1), completed") in message, message
    assert "rank 0 failed in all_reduce #4" in message or "rank 0 waits in all_reduce #4" \
        in message, message


# --- hangs and aborts: the first difference, named -------------------------------------------


def test_collectives_in_different_orders():
    err, message, seconds = hang(H.different_orders)
    assert "The ranks' collectives first differ at #1: " in message, message
    assert "all_reduce #1 (12 B float32, shape (3,))" in message  # rank 0: bias
    assert "all_reduce #1 (20 B float32, shape (5,))" in message  # rank 1: weight
    assert "the ranks called all_reduce with different sizes at #1" in message
    assert "rank 0" in err.explanation and "rank 1" in err.explanation
    assert seconds < TIMEOUT / 2


def test_different_collectives_at_one_sequence_number():
    err, message, seconds = hang(H.different_ops)
    assert isinstance(err, zerolab.LaunchTimeout), message
    assert message.startswith("ranks [0, 1] were stopped: they wait on each other in "
                              "collectives that can never complete"), message
    assert ("rank 0 waits in all_reduce #2 (40 B float32, shape (10,)), called from "
            "different_ops") in message, message
    assert "rank 1 waits in broadcast #2 (40 B float32, shape (10,), from rank 0)" in message
    assert message.endswith("the ranks called different collectives at #2."), message
    assert seconds < TIMEOUT / 2  # seen as certain, long before the timeout


@pytest.mark.parametrize("world_size, skipper", [(2, 1), (3, 0)])
def test_a_skipped_collective_names_the_rank_that_skipped_it(world_size, skipper):
    err, message, seconds = hang(H.skipped, world_size, args=(skipper,))
    assert isinstance(err, zerolab.LaunchTimeout), message
    waiting = [r for r in range(world_size) if r != skipper]
    for r in waiting:
        assert f"rank {r} waits in all_reduce #3 (48 B float32, shape (12,))" in message
    assert (f"rank {skipper} never issued #3: it returned from skipped after all_reduce #2 "
            f"(32 B float32, shape (8,))") in message, message
    assert f"rank {skipper} skipped all_reduce #3" in message
    assert seconds < TIMEOUT / 2


def test_a_skipped_collective_of_zerolab_comm_names_its_tag():
    _, message, _ = hang(H.skipped_in_comm)
    assert "rank 0 waits in all_reduce #2 (test/bucket1, 32 B float32, shape (8,))" in message
    assert "rank 1 skipped all_reduce #2" in message, message


def test_mismatched_sizes_are_explained():
    """gloo aborts a rank (SIGABRT: a WorkerError), or, now and then, both wait for ever (a
    deadlock: LaunchTimeout). Either way the sizes are named."""
    err, message, seconds = hang(H.mismatched_sizes)
    if isinstance(err, zerolab.WorkerError):
        assert "was killed by SIGABRT" in message.splitlines()[0], message
    assert "all_reduce #1 (40 B float32, shape (10,))" in message
    assert "all_reduce #1 (80 B float32, shape (20,))" in message
    assert "the ranks called all_reduce with different sizes at #1" in message
    assert seconds < TIMEOUT / 2


def test_mismatched_dtypes_are_named_first():
    _, message, _ = hang(H.mismatched_dtypes)
    assert "first differ at #1" in message and "with different dtypes at #1" in message, message
    assert "broadcast #1 (32 B float32" in message and "broadcast #1 (32 B int32" in message


def test_a_hang_in_a_subgroup_names_the_group():
    err, message, _ = hang(H.in_a_subgroup, 3)
    assert isinstance(err, zerolab.LaunchTimeout), message
    assert "rank 0 waits in all_reduce #1 in group [0, 1] (8 B float32, shape (2,))" in message
    assert "rank 1 waits in barrier #1" in message and "rank 2 waits in barrier #1" in message
    assert "The ranks' collectives of group [0, 1] first differ at #1" in message, message


def test_async_collectives_waited_for_later():
    err, message, _ = hang(H.async_skipped)
    assert isinstance(err, zerolab.LaunchTimeout), message
    assert "rank 0 waits in all_reduce #3 (16 B float32, shape (4,), async)" in message, message
    assert "rank 1 skipped all_reduce #3" in message


# --- the verdict, from records made up here ----------------------------------------------------


def entry(seq, op="all_reduce", nbytes=40, dtype="float32", state="issued", ranks=(0, 1),
          pos=None, tag=""):
    return flight.Entry(pos=seq - 1 if pos is None else pos, seq=seq, state=state,
                        async_op=False, comparable=True, kind=flight.COLLECTIVE, peer=-1,
                        nbytes=nbytes, t_issue=1.0, t_done=0.0, op=op, dtype=dtype, group="0",
                        ranks=ranks, shape="(10,)", tag=tag)


def state(rank, entries, status="running", blocked=None):
    """A rank's state; blocked: the position it waits in (default: its last entry's)."""
    if blocked is None:
        blocked = entries[-1].pos if entries else -1
    log = flight.FlightLog(rank=rank, world_size=2, pid=1, main_thread=0,
                           written=len(entries), activity=1, blocked=blocked,
                           phase="running", entries=entries)
    return hangs.RankState(rank, status, log)


def test_the_issue_example_verdict():
    done = [entry(s, state="completed") for s in range(1, 17)]
    states = [state(0, [*done, entry(17, nbytes=400 * 1024, tag="ddp/bwd/bucket3")]),
              state(1, [*done, entry(17, op="broadcast", nbytes=400 * 1024)], blocked=-1)]
    assert hangs.first_difference(states, "train") == [
        "The ranks' collectives first differ at #17: rank 0 waits in all_reduce #17 "
        "(ddp/bwd/bucket3, 400 KiB float32, shape (10,)); rank 1 issued broadcast #17 "
        "(400 KiB float32, shape (10,)): the ranks called different collectives at #17."]


def test_a_deadlock_is_certain_only_when_no_waited_collective_can_complete():
    both_in_3 = [state(0, [entry(1, state="completed"), entry(2)]),
                 state(1, [entry(1, state="completed"), entry(2)])]
    assert not hangs.deadlocked(both_in_3)  # a slow collective: every rank is in it
    sizes = [state(0, [entry(1)]), state(1, [entry(1, nbytes=80)])]
    assert hangs.deadlocked(sizes)
    computing = [state(0, [entry(1)]), state(1, [entry(1, state="completed")], blocked=-1)]
    assert not hangs.deadlocked(computing)  # rank 1 may still issue #2... of its own
    returned = [state(0, [entry(1)]), state(1, [], status="returned")]
    assert hangs.deadlocked(returned)
    assert hangs.first_difference(returned, "f") == [
        "The ranks' collectives first differ at #1: rank 0 waits in all_reduce #1 (40 B "
        "float32, shape (10,)); rank 1 never issued #1: it returned from f: rank 1 skipped "
        "all_reduce #1 (or the others called one too many)."]


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (40, "40 B"), (1024, "1 KiB"),
                                          (400 * 1024, "400 KiB"), (3 * 2**20 // 2, "1.5 MiB"),
                                          (2**31, "2 GiB")])
def test_sizes_read_as_people_write_them(nbytes, text):
    assert hangs.size_text(nbytes) == text


def test_where_in_a_stack_dump_skips_the_plumbing():
    dump = ('Thread 0x00000000000000aa (most recent call first):\n'
            '  File "/x/threading.py", line 320 in wait\n\n'
            'Current thread 0x00000000000000bb (most recent call first):\n'
            '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 9 in '
            'all_reduce\n'
            '  File "/w/zerolab/wire/flight.py", line 3 in recorded\n'
            '  File "/w/tests/workers/hangs.py", line 29 in different_ops\n'
            '  File "/w/zerolab/launcher/local.py", line 263 in _worker\n')
    assert hangs.where_in_stack(dump, 0xbb) == "different_ops (/w/tests/workers/hangs.py:29)"
    assert hangs.where_in_stack(dump, 0xaa) == ""  # only plumbing in that thread


# --- the lesson --------------------------------------------------------------------------------


def test_the_lessons_classic_hangs_each_end_with_a_verdict():
    from zerolab.lessons import n00_launch

    orders = n00_launch.set_orders(sorted(n00_launch.GRADS), 2)
    assert sorted(orders[0]) == sorted(orders[1]) == sorted(n00_launch.GRADS)
    assert orders[0] != orders[1]
    verdicts = {case: n00_launch.provoke_hang(case) for case in n00_launch.HANGS}
    assert "the ranks called all_reduce with different sizes at #1" in \
        verdicts["set order"].verdict
    assert verdicts["skipped"].error == "LaunchTimeout"
    assert "rank 1 skipped all_reduce #3" in verdicts["skipped"].verdict
    assert "lesson00/bucket2" in verdicts["skipped"].verdict
    assert "all_gather_into_tensor with different sizes at #1" in verdicts["sizes"].verdict
    assert all(v.seconds < 30 for v in verdicts.values())


def test_the_overhead_measurement_runs():
    """Its figures are the bench's to judge (timings here are noisy): that it runs and pairs."""
    times = zerolab.launch(H.recorder_overhead, 2, args=(2,))
    for rank in times:
        assert len(rank["on"]) == len(rank["off"]) == 2
        assert all(t > 0 for t in rank["on"] + rank["off"])
