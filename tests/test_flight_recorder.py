"""The flight recorder (zerolab/wire/flight.py) and what the launcher says when ranks hang or
abort (zerolab/launcher/hangs.py): every rank's last collectives, through zerolab.comm and
torch.distributed, and the first sequence number at which the ranks' records disagree."""

import time

import pytest
from workers import hangs as H

import zerolab
from zerolab.launcher import fingerprints, hangs
from zerolab.wire import flight

TIMEOUT = 60  # far above what any case takes: each must end well before it


def hang(fn, world_size=2, args=(), timeout=TIMEOUT):
    """Launch a case that must hang, abort or be stopped for a call whose ranks disagree;
    (the error, its message, seconds taken)."""
    start = time.perf_counter()
    with pytest.raises((zerolab.LaunchTimeout, zerolab.WorkerError,
                        zerolab.CollectiveMismatch)) as info:
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
        assert [(e.reduce_op, e.numel) for e in world[:4]] == [
            ("sum", 6), ("sum", 6), ("", 2 * 3), ("sum", 9)]  # all-gather: its output's
        assert len({e.digest for e in world}) == len(world)  # chained: each call's its own
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


# --- calls whose ranks pass different things: each named, with both ranks and the call --------

AGREE = "agree, call for call"  # what the launcher said of each case below before it compared


def test_a_reduce_op_mismatch_is_named_while_the_ranks_run():
    """gloo returns a mix of SUM and MAX on both ranks; the ranks then sleep a minute, so only
    the launcher's comparison while they run can stop them in seconds."""
    err, message, seconds = hang(H.reduce_ops, args=(TIMEOUT,))
    assert isinstance(err, zerolab.CollectiveMismatch), message
    assert (err.ranks, err.seq) == ((0, 1), 1)
    assert message.startswith("ranks 0 and 1 disagree at all_reduce #1, which returned on both "
                              "without an error"), message
    assert ("the ranks called all_reduce with different reduce ops at #1 (sum on rank 0, max "
            "on rank 1)") in message, message
    assert "rank 0 is not in a collective: it is in reduce_ops" in message, message
    assert AGREE not in message and seconds < 15


def test_an_equal_size_dtype_mismatch_is_named_at_the_launchs_end():
    """float32 against int32, 16 bytes each: gloo returns garbage on both ranks and the ranks
    return at once; the records are compared once more before the results come back."""
    err, message, seconds = hang(H.equal_size_dtypes)
    assert isinstance(err, zerolab.CollectiveMismatch), message
    assert (err.ranks, err.seq) == ((0, 1), 1)
    assert ("rank 0 called all_reduce #1 (test/dtypes, 16 B float32, shape (4,)); rank 1 called "
            "all_reduce #1 (test/dtypes, 16 B int32, shape (4,)): the ranks called all_reduce "
            "with different dtypes at #1 (float32 on rank 0, int32 on rank 1): the same bytes"
            ) in err.explanation, message
    assert AGREE not in message and seconds < 15


def test_torchs_own_check_names_a_dtype_mismatch_before_the_call_runs(monkeypatch):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL, set after the zygote imported torch: the ranks read it
    again, and torch's fingerprint check raises on the ranks before gloo moves a byte."""
    zerolab.launch(H.skipped, 2, args=(-1,))  # the zygotes run before the variable is set
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    err, message, seconds = hang(H.equal_size_dtypes)
    assert isinstance(err, zerolab.WorkerError), message
    assert "raised RuntimeError: Detected mismatch between collectives on ranks" in message
    assert ("rank 0 failed in all_reduce #1 (test/dtypes, 16 B float32, shape (4,)); rank 1 "
            "failed in all_reduce #1 (test/dtypes, 16 B int32, shape (4,)): the ranks called "
            "all_reduce with different dtypes at #1 (float32 on rank 0, int32 on rank 1).") \
        in message, message
    assert seconds < 15


def test_a_broadcast_whose_source_differs_is_a_certain_deadlock():
    err, message, seconds = hang(H.own_sources)
    assert isinstance(err, zerolab.LaunchTimeout), message
    assert message.startswith("ranks [0, 1] were stopped: they wait on each other in "
                              "collectives that can never complete"), message
    assert ("rank 0 waits in broadcast #1 (16 B float32, shape (4,), from rank 0); rank 1 waits "
            "in broadcast #1 (16 B float32, shape (4,), from rank 1): the ranks called broadcast "
            "with different sources at #1 (from rank 0 on rank 0, from rank 1 on rank 1)"
            ) in message, message
    assert AGREE not in message and seconds < 15


def test_a_receive_met_by_a_receive_is_a_certain_deadlock():
    err, message, seconds = hang(H.both_receive_first)
    assert isinstance(err, zerolab.LaunchTimeout), message
    assert message.startswith("ranks [0, 1] were stopped: they wait on each other"), message
    assert ("The ranks' point-to-point calls cross: rank 0 waits in recv from rank 1 (p2p #1, "
            "16 B float32, shape (4,)) and rank 1 in recv from rank 0 (p2p #1, 16 B float32, "
            "shape (4,)): a receive met by a receive") in message, message
    assert AGREE not in message and seconds < 15


# --- the verdict, from records made up here ----------------------------------------------------


def entry(seq, op="all_reduce", nbytes=40, dtype="float32", state="issued", ranks=(0, 1),
          pos=None, tag="", kind=flight.COLLECTIVE, peer=-1, digest=0, reduce_op=""):
    return flight.Entry(pos=seq - 1 if pos is None else pos, seq=seq, state=state,
                        async_op=False, comparable=True, kind=kind, peer=peer,
                        nbytes=nbytes, t_issue=1.0, t_done=0.0, op=op, dtype=dtype, group="0",
                        ranks=ranks, shape="(10,)", tag=tag, numel=nbytes // 4, digest=digest,
                        reduce_op=reduce_op)


def state(rank, entries, status="running", blocked=None, written=None):
    """A rank's state; blocked: the position it waits in (default: its last entry's);
    written: the entries it wrote (default: those given, the ring holding them all)."""
    if blocked is None:
        blocked = entries[-1].pos if entries else -1
    log = flight.FlightLog(rank=rank, world_size=2, pid=1, main_thread=0,
                           written=len(entries) if written is None else written, activity=1,
                           blocked=blocked, phase="running", entries=entries)
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


def test_a_p2p_wait_is_certain_only_when_its_peer_cannot_meet_it():
    def p2p(op, peer):
        return entry(1, op=op, kind=flight.P2P, peer=peer)

    crossing = [state(0, [p2p("recv", 1)]), state(1, [p2p("recv", 0)])]
    assert hangs.deadlocked(crossing)
    assert "a receive met by a receive" in hangs.explain(crossing, "f")
    assert hangs.deadlocked([state(0, [p2p("send", 1)]), state(1, [p2p("send", 0)])])
    assert not hangs.deadlocked([state(0, [p2p("recv", 1)]), state(1, [p2p("send", 0)])])
    pending = [state(0, [p2p("recv", 1)]),  # rank 1's isend is still open: it may yet arrive
               state(1, [p2p("isend", 0), entry(1, pos=1)], blocked=1)]
    assert not hangs.deadlocked(pending)
    gone = [state(0, [p2p("recv", 1)]), state(1, [], status="returned")]
    assert hangs.deadlocked(gone)
    assert hangs.explain(gone, "f").endswith(
        "Rank 0 waits in recv from rank 1 (p2p #1, 40 B float32, shape (10,)), which rank 1 "
        "does not meet: it returned from f.")


def test_a_mismatch_older_than_the_rings_is_still_found_by_the_digests():
    """Records made up here: rank 1 passed another reduce op at #1, and the rings now hold #5-#8
    only, alike on both ranks; the digests, chained from #1, differ from #1 on."""
    def calls(rank):
        return [entry(s, state="completed", reduce_op="sum",
                      digest=s if rank == 0 else 100 + s) for s in range(5, 9)]

    logs = {r: state(r, calls(r), blocked=-1, written=8).log for r in (0, 1)}
    found = fingerprints.silent_mismatch(logs)
    assert (found.seq, found.exact, list(found.at)) == (5, False, [0, 1])
    assert fingerprints.mismatch_text(found).startswith(
        "ranks 0 and 1 passed different things to a collective of group [0, 1] before #5"), \
        fingerprints.mismatch_text(found)
    states = [state(r, calls(r), status="returned", blocked=-1, written=8) for r in (0, 1)]
    assert hangs.first_difference(states, "f") == [
        "The ranks' collectives differ before #5, in calls their flight recorders no longer "
        f"hold (each keeps its last {flight.SLOTS}): the digests of their calls differ at #8."]
    agreeing = {r: state(r, calls(0), blocked=-1, written=8).log for r in (0, 1)}
    assert fingerprints.silent_mismatch(agreeing) is None


def test_the_recorders_digests_chain_the_fingerprints(tmp_path):
    """Two recorders of the same calls agree call for call; a reduce op changed at the second
    call makes their digests differ from there on, and only from there."""
    import torch

    digests = []
    for rank, second_op in ((0, "sum"), (1, "max")):
        rec = flight.FlightRecorder(str(tmp_path / f"flight-{rank}"), rank, 2)
        for op in ("sum", second_op, "sum"):
            rec.complete(rec.issue("all_reduce", torch.ones(3), None, False, reduce_op=op))
        log = flight.read(rec.path)
        rec.close()
        assert [(e.reduce_op, e.numel) for e in log.entries] == [
            ("sum", 3), (second_op, 3), ("sum", 3)]
        digests.append([e.digest for e in log.entries])
    assert digests[0][0] == digests[1][0]
    assert digests[0][1] != digests[1][1] and digests[0][2] != digests[1][2]


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (40, "40 B"), (1024, "1 KiB"),
                                          (400 * 1024, "400 KiB"), (3 * 2**20 // 2, "1.5 MiB"),
                                          (2**31, "2 GiB")])
def test_sizes_read_as_people_write_them(nbytes, text):
    assert fingerprints.size_text(nbytes) == text


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
