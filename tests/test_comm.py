"""zerolab.comm: results of every collective, the recorder's byte counts, timing and traces.

Byte counts are checked against integers computed by hand from the ring formulas, for tensors of
12 elements (12 divides by every world size 1-4), S = 48 bytes in fp32:
  all-reduce     2(N-1)/N * S : N=2 -> 48, N=3 -> 64, N=4 -> 72
  reduce-scatter  (N-1)/N * S : N=2 -> 24, N=3 -> 32, N=4 -> 36   (all-gather the same)
"""

import json

import pytest
import torch
import workers

import zerolab
from zerolab import comm

WORLD_SIZES = (1, 2, 3, 4)
DELAY = 0.3  # rank 0 arrives this late at record_comm, and again at the "align" all-reduce

# tag -> (op, S in bytes per world size, sent bytes per world size), by hand.
SENT = {
    "ar/sum": ("all_reduce", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 48, 3: 64, 4: 72}),
    "ar/avg": ("all_reduce", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 48, 3: 64, 4: 72}),
    "ar/max": ("all_reduce", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 48, 3: 64, 4: 72}),
    # 12 fp16 = 24 bytes: 2*1*24/2 = 24, 2*2*24/3 = 32, 2*3*24/4 = 36
    "ar/fp16": ("all_reduce", {1: 24, 2: 24, 3: 24, 4: 24}, {1: 0, 2: 24, 3: 32, 4: 36}),
    "rs/sum": ("reduce_scatter", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 24, 3: 32, 4: 36}),
    "rs/avg": ("reduce_scatter", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 24, 3: 32, 4: 36}),
    # the seeds' example: input 2N fp32 = 8N bytes; sent (N-1)/N * 8N = 8(N-1)
    "rs/seeds": ("reduce_scatter", {1: 8, 2: 16, 3: 24, 4: 32}, {1: 0, 2: 8, 3: 16, 4: 24}),
    "ag": ("all_gather", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 24, 3: 32, 4: 36}),
    "async/avg": ("all_reduce", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 48, 3: 64, 4: 72}),
    "async/ag": ("all_gather", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 24, 3: 32, 4: 36}),
    "align": ("all_reduce", {1: 48, 2: 48, 3: 48, 4: 48}, {1: 0, 2: 48, 3: 64, 4: 72}),
}
# Broadcast from src = N-1 along the ring src -> src+1 -> ...: every rank forwards S = 48 bytes
# except the last one, rank src-1 = N-2 (at N=1 nobody sends).
BROADCAST_SILENT_RANK = {2: 0, 3: 1, 4: 2}
# (N, rank) -> this rank's sum of sent bytes over the suite, by hand: five fp32 all-reduces, one
# fp16 all-reduce, two reduce-scatters, the seeds' reduce-scatter, two all-gathers, a broadcast
# and a send (48; recv sends nothing).
TOTAL = {
    (1, 0): 0,
    (2, 0): 416,  # 48*5 + 24 + 24*2 + 8 + 24*2 + 0 (silent in broadcast) + 48
    (2, 1): 464,  # 48*5 + 24 + 24*2 + 8 + 24*2 + 48 + 48
    (3, 0): 592,  # 64*5 + 32 + 32*2 + 16 + 32*2 + 48 + 48
    (3, 1): 544,  # silent in broadcast
    (3, 2): 592,
    (4, 0): 660,  # 72*5 + 36 + 36*2 + 24 + 36*2 + 48 + 48
    (4, 1): 660,
    (4, 2): 612,  # silent in broadcast
    (4, 3): 660,
}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def suite(request):
    """One launch per world size runs every collective; the tests below read its results."""
    n = request.param
    results = zerolab.launch(workers.comm_suite, n, args=(DELAY if n > 1 else 0.0,))
    return n, results


# --- results of the collectives ---------------------------------------------------------------


def test_all_reduce_results(suite):
    n, results = suite
    arange = torch.arange(12, dtype=torch.float32)
    for r in results:
        out = r["out"]
        # rank r holds arange + 100 r
        assert torch.equal(out["ar/sum"], n * arange + 100 * n * (n - 1) // 2)
        assert torch.equal(out["ar/avg"], arange + 50 * (n - 1))
        # rank r holds arange * (r + 1): the max is rank N-1's
        assert torch.equal(out["ar/max"], arange * n)
        assert out["ar/fp16"].dtype == torch.float16
        assert out["ar/fp16"].tolist() == [n * (n + 1) / 2] * 12
        assert out["async/avg"].tolist() == [(n + 1) / 2] * 12  # mean of 1..N


def test_reduce_scatter_results(suite):
    n, results = suite
    k = 12 // n
    full_sum = torch.arange(12, dtype=torch.float32) * (n * (n + 1) // 2)  # sum of (r+1)
    for rank, r in enumerate(results):
        mine = slice(rank * k, (rank + 1) * k)
        assert torch.equal(r["out"]["rs/sum"], full_sum[mine])
        assert torch.equal(r["out"]["rs/avg"], full_sum[mine] / n)


def test_the_seeds_reduce_scatter_example(suite):
    """Rank r holds [(r+1)*1, (r+1)*2] ** (j+1) as chunk j; rank j gets the sum of chunks j."""
    n, results = suite
    got = [r["out"]["rs/seeds"].tolist() for r in results]
    expected = [[sum(((r + 1) * i) ** (j + 1) for r in range(n)) for i in (1, 2)]
                for j in range(n)]
    assert got == expected
    if n == 3:
        assert got == [[6, 12], [14, 56], [36, 288]]  # the seeds' figures


def test_all_gather_broadcast_and_send_recv_results(suite):
    n, results = suite
    k = 12 // n
    gathered = [100.0 * r + i for r in range(n) for i in range(k)]
    for rank, r in enumerate(results):
        out = r["out"]
        assert out["ag"].tolist() == gathered
        assert out["async/ag"].tolist() == [float(q) for q in range(n) for _ in range(k)]
        assert torch.equal(out["bc"], torch.arange(12, dtype=torch.float32))  # from rank N-1
        if n > 1:
            assert out["p2p/recv"].tolist() == [float((rank - 1) % n)] * 12  # ring neighbour


# --- the recorder -----------------------------------------------------------------------------


def test_recorded_bytes_are_the_ring_figures(suite):
    n, results = suite
    for rank, r in enumerate(results):
        log = r["log"]
        assert (log.rank, log.world_size) == (rank, n)
        events = {e.tag: e for e in log.events}
        expected_tags = [*SENT, "bc"] + (["p2p/send", "p2p/recv"] if n > 1 else [])
        assert sorted(events) == sorted(expected_tags)
        assert len(log.events) == len(expected_tags)  # one event per call
        for tag, (op, nbytes, sent) in SENT.items():
            e = events[tag]
            assert (e.op, e.nbytes, e.sent_bytes) == (op, nbytes[n], sent[n]), tag
        bc = events["bc"]
        assert (bc.op, bc.nbytes) == ("broadcast", 48)
        assert bc.sent_bytes == (0 if n == 1 or rank == BROADCAST_SILENT_RANK[n] else 48)
        if n > 1:
            assert (events["p2p/send"].op, events["p2p/send"].sent_bytes) == ("send", 48)
            assert (events["p2p/recv"].op, events["p2p/recv"].sent_bytes) == ("recv", 0)
            assert events["p2p/recv"].nbytes == 48
        assert log.total_bytes() == TOTAL[(n, rank)]
        # ar/sum, ar/avg, ar/max (fp32) and ar/fp16: 3*48+24, 3*64+32, 3*72+36
        assert log.total_bytes("ar/") == {1: 0, 2: 168, 3: 224, 4: 252}[n]
        by_op = log.bytes_by_op()
        assert sum(by_op.values()) == log.total_bytes()
        assert by_op["reduce_scatter"] == {1: 0, 2: 56, 3: 80, 4: 96}[n]  # 2 x 12 + seeds


def test_async_ops_are_recorded_at_issue_and_at_completion(suite):
    n, results = suite
    for r in results:
        out, events = r["out"], {e.tag: e for e in r["log"].events}
        e = events["async/avg"]
        assert e.async_op and not events["ar/sum"].async_op
        assert out["async/end_before_wait"] is None  # issued, not yet waited on
        assert e.start <= out["async/issued_by"] <= e.end  # recorded at issue; end at wait
        assert events["async/ag"].end is not None


def test_event_times_are_ordered(suite):
    _, results = suite
    for r in results:
        log = r["log"]
        starts = [e.start for e in log.events]
        assert starts == sorted(starts) and starts[0] >= 0
        for e in log.events:
            assert e.end is not None and e.end >= e.start, e


def test_clock_is_aligned_across_ranks(suite):
    """Rank 0 came DELAY late to record_comm: the entry barrier must make that disappear."""
    n, results = suite
    if n == 1:
        pytest.skip("alignment needs two ranks")
    # perf_counter is one system-wide monotonic clock on Linux: t0s can be compared directly.
    t0s = [r["out"]["t0"] for r in results]
    assert max(t0s) - min(t0s) < DELAY / 3
    # Rank 0 sleeps DELAY in a "compute" span before the last all-reduce; everyone else waits
    # inside it, so it ends at about the same aligned time on every rank.
    align = [next(e for e in r["log"].events if e.tag == "align") for r in results]
    ends = [e.end for e in align]
    assert max(ends) - min(ends) < DELAY / 3
    assert align[0].start >= DELAY
    for e in align[1:]:
        assert e.end - e.start >= DELAY * 2 / 3  # waited for rank 0
    span = results[0]["log"].spans[-1]
    assert span.name == "compute" and span.end - span.start >= DELAY


def test_chrome_trace_of_all_ranks(suite, tmp_path):
    n, results = suite
    logs = [r["log"] for r in results]
    path = tmp_path / "trace.json"
    comm.save_chrome_trace(str(path), logs)
    trace = json.loads(path.read_text())
    assert trace == json.loads(json.dumps(comm.chrome_trace(logs)))
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {r: f"rank {r}" for r in range(n)}
    for log in logs:
        comm_events = [e for e in events if e["pid"] == log.rank and e.get("tid") == "comm"]
        assert [e["name"] for e in comm_events] == [e.tag for e in log.events]
        for te, e in zip(comm_events, log.events):
            assert te["ph"] == "X" and te["cat"] == e.op
            assert te["ts"] == pytest.approx(e.start * 1e6)  # microseconds
            assert te["dur"] == pytest.approx((e.end - e.start) * 1e6)
            args = te["args"]
            assert (args["op"], args["nbytes"], args["sent_bytes"]) == (e.op, e.nbytes,
                                                                        e.sent_bytes)
        spans = [e for e in events if e["pid"] == log.rank and e.get("cat") == "compute"]
        assert [s["name"] for s in spans] == ["compute"]
    one = logs[-1].chrome_trace_events()  # a single rank
    assert {e["pid"] for e in one} == {n - 1}
    assert len(one) == len(logs[-1].events) + len(logs[-1].spans)


# --- without a process group (one process, in this test process) ------------------------------


def test_ring_sent_bytes_by_hand():
    s = 48  # 12 fp32
    assert comm.ring_sent_bytes("all_reduce", s, 3) == 64  # 2*2*48/3
    assert comm.ring_sent_bytes("all_reduce", s, 4) == 72  # 2*3*48/4
    assert comm.ring_sent_bytes("reduce_scatter", s, 3) == 32  # 2*48/3
    assert comm.ring_sent_bytes("all_gather", s, 4) == 36  # 3*48/4
    assert comm.ring_sent_bytes("all_reduce", 1 << 30, 8) == 7 * (1 << 28)  # 2*7/8 GiB
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send"):
        assert comm.ring_sent_bytes(op, s, 1) == 0  # nothing to send to
    # broadcast from src along src -> src+1 -> ...: all but the ring's last rank send S
    assert [comm.ring_sent_bytes("broadcast", s, 3, rank=r, src=0) for r in range(3)] == [
        48, 48, 0]
    assert [comm.ring_sent_bytes("broadcast", s, 4, rank=r, src=2) for r in range(4)] == [
        48, 0, 48, 48]
    assert comm.ring_sent_bytes("send", s, 2) == 48
    assert comm.ring_sent_bytes("recv", s, 2) == 0
    with pytest.raises(ValueError, match="unknown op"):
        comm.ring_sent_bytes("all_to_all", s, 2)


def test_wrappers_without_a_process_group_act_as_one_rank():
    assert not torch.distributed.is_initialized()
    with zerolab.record_comm() as log:
        t = torch.arange(4.0)
        comm.all_reduce(t, tag="x/ar", op="avg")
        out = torch.empty(4)
        comm.reduce_scatter(out, torch.arange(4.0) * 2, tag="x/rs")
        gathered = torch.empty(4)
        handle = comm.all_gather(gathered, torch.arange(4.0) + 1, tag="x/ag", async_op=True)
        handle.wait()
    assert (log.rank, log.world_size) == (0, 1)
    assert t.tolist() == [0, 1, 2, 3]  # the average over one rank
    assert out.tolist() == [0, 2, 4, 6]
    assert gathered.tolist() == [1, 2, 3, 4]
    assert [(e.op, e.tag, e.nbytes, e.sent_bytes) for e in log.events] == [
        ("all_reduce", "x/ar", 16, 0), ("reduce_scatter", "x/rs", 16, 0),
        ("all_gather", "x/ag", 16, 0)]
    assert all(e.end is not None for e in log.events)


def test_nested_logs_both_record_and_nothing_is_recorded_outside():
    comm.all_reduce(torch.ones(3), tag="outside")
    with zerolab.record_comm() as outer:
        comm.all_reduce(torch.ones(3), tag="a")
        with zerolab.record_comm() as inner, comm.span("forward"):
            comm.broadcast(torch.ones(5), 0, tag="b")
        comm.all_reduce(torch.ones(3), tag="c")
    comm.all_reduce(torch.ones(3), tag="after")
    assert [e.tag for e in outer.events] == ["a", "b", "c"]
    assert [e.tag for e in inner.events] == ["b"]
    assert inner.events[0].nbytes == 20
    assert [s.name for s in outer.spans] == [s.name for s in inner.spans] == ["forward"]
    assert outer.total_bytes() == 0  # one rank sends nothing
