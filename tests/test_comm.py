"""zerolab.comm: results of every collective, the recorder's byte counts, timing and traces.

Ring-model byte counts are checked against integers computed by hand from the ring formulas, for
tensors of 12 elements (12 divides by every world size 1-4), S = 48 bytes in fp32:
  all-reduce     2(N-1)/N * S : N=2 -> 48, N=3 -> 64, N=4 -> 72
  reduce-scatter  (N-1)/N * S : N=2 -> 24, N=3 -> 32, N=4 -> 36   (all-gather the same)

Measured (wire) bytes are checked on S = 1.5 MiB, against the same formulas and against what the
kernel counted from outside the recorder (tests/workers/comm.py).
"""

import json

import pytest
import torch
from workers import comm as comm_workers

import zerolab
from zerolab import comm, theory
from zerolab.wire import backends, trace, written

WORLD_SIZES = (1, 2, 3, 4)
DELAY = 0.3  # rank 0 arrives this late at record_comm, and again at the "align" all-reduce
NUMEL = 12 << 15  # the wire tests' tensors: S = 4 * NUMEL = 1.5 MiB, divisible by 1-4 ranks
S = 4 * NUMEL

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
    results = zerolab.launch(comm_workers.suite, n, args=(DELAY if n > 1 else 0.0, NUMEL))
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
            assert (e.op, e.nbytes, e.ring_bytes) == (op, nbytes[n], sent[n]), tag
        bc = events["bc"]
        assert (bc.op, bc.nbytes) == ("broadcast", 48)
        assert bc.ring_bytes == (0 if n == 1 or rank == BROADCAST_SILENT_RANK[n] else 48)
        if n > 1:
            assert (events["p2p/send"].op, events["p2p/send"].ring_bytes) == ("send", 48)
            assert (events["p2p/recv"].op, events["p2p/recv"].ring_bytes) == ("recv", 0)
            assert events["p2p/recv"].nbytes == 48
        assert log.total_ring_bytes() == log.total_ring_bytes() == TOTAL[(n, rank)]
        # ar/sum, ar/avg, ar/max (fp32) and ar/fp16: 3*48+24, 3*64+32, 3*72+36
        assert log.total_ring_bytes("ar/") == {1: 0, 2: 168, 3: 224, 4: 252}[n]
        by_op = log.bytes_by_op()
        assert sum(by_op.values()) == log.total_ring_bytes()
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
    trace.save_chrome_trace(str(path), logs)
    saved = json.loads(path.read_text())
    assert saved == json.loads(json.dumps(trace.chrome_trace(logs)))
    events = saved["traceEvents"]
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
            assert (args["op"], args["nbytes"], args["ring_bytes"], args["wire_bytes"],
                    args["impl"], args["group_ranks"]) == (e.op, e.nbytes, e.ring_bytes,
                                                           e.wire_bytes, e.impl,
                                                           list(e.group_ranks))
        spans = [e for e in events if e["pid"] == log.rank and e.get("cat") == "compute"]
        assert [s["name"] for s in spans] == ["compute"]
    one = trace.rank_events(logs[-1])  # a single rank
    assert {e["pid"] for e in one} == {n - 1}
    assert len(one) == len(logs[-1].events) + len(logs[-1].spans)


# --- measured bytes (wire), S = 1.5 MiB --------------------------------------------------------


def near(measured: int, expected: float, rel: float) -> bool:
    return abs(measured - expected) <= rel * expected


def wire_results(suite):
    n, results = suite
    if n == 1:
        pytest.skip("nothing goes on the wire with one rank")
    return n, [r["wire"] for r in results]


def test_every_event_says_what_ran_in_which_group_and_what_it_wrote(suite):
    n, results = suite
    impl = {"all_reduce": "all_reduce (gloo)", "broadcast": "broadcast (gloo)",
            "reduce_scatter": "reduce_scatter as all_reduce (gloo)" if n == 1 else
            f"reduce_scatter as {'1 send/recv pair' if n == 2 else f'{n - 1} send/recv pairs'}"
            " (gloo)",
            "all_gather": f"all_gather as {n} broadcast{'s' if n > 1 else ''} (gloo)",
            "send": "send (gloo)", "recv": "recv (gloo)"}
    for r in results:
        log = r["log"]
        for e in log.events:
            assert e.impl == impl[e.op], e
            assert e.group_ranks == tuple(range(n))
            assert isinstance(e.wire_bytes, int) and e.wire_bytes >= 0, e
        assert log.total_wire_bytes() == sum(e.wire_bytes for e in log.events)
        assert log.total_wire_bytes(group=tuple(range(n))) == log.total_wire_bytes()
        assert log.total_wire_bytes(group=(n,)) == 0  # a group nothing ran in
        by_op = log.wire_bytes_by_op()
        assert sorted(by_op) == sorted(log.bytes_by_op())
        assert sum(by_op.values()) == log.total_wire_bytes()
        if n == 1:
            assert log.total_wire_bytes() == 0  # one rank writes nothing


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_measured_bytes_match_the_ring_formula(suite, op):
    n, ranks = wire_results(suite)
    for w in ranks:
        e, outer = w["ops"][op]["event"], w["ops"][op]["outer"]
        factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op]
        assert e.ring_bytes == round(factor * (n - 1) / n * S)
        assert near(e.wire_bytes, e.ring_bytes, 0.02), (e.wire_bytes, e.ring_bytes)
        # alone and synchronous: the event's window is what was counted around the call (but
        # for a gloo control message or two landing on either side of its boundaries)
        assert e.wire_exact and abs(e.wire_bytes - outer) <= 1e-3 * S


def test_gloo_reduce_scatter_sends_half_what_torchs_own_sends(suite):
    """torch's gloo reduce-scatter all-reduces (twice the ring figure); zerolab's sends each
    chunk straight to its owner: the ring figure, half as much."""
    n, ranks = wire_results(suite)
    for w in ranks:
        rs, ar = w["ops"]["reduce_scatter"]["event"], w["ops"]["all_reduce"]["event"]
        assert "send/recv pair" in rs.impl
        # issued async, with the user's 1 MiB file and a print while it was in flight: the ring
        # figure still, the bytes gloo wrote from the calling thread in, the user's out
        rs_async = w["ops"]["reduce_scatter_async"]["event"]
        assert near(rs_async.wire_bytes, rs.ring_bytes, 0.02), (rs_async.wire_bytes, rs.ring_bytes)
        assert near(w["native"]["reduce_scatter"], ar.wire_bytes, 0.02)  # torch's: an all-reduce
        assert near(2 * rs.wire_bytes, w["native"]["reduce_scatter"], 0.03)


def test_all_gather_as_broadcasts_sends_the_ring_figure_like_torchs_own(suite):
    """N binomial trees, one rooted at each rank: every rank takes each tree position once."""
    n, ranks = wire_results(suite)
    for w in ranks:
        ag = w["ops"]["all_gather"]["event"]
        assert ag.impl == f"all_gather as {n} broadcasts (gloo)"
        assert near(w["native"]["all_gather"], ag.wire_bytes, 0.02)  # torch's gloo all-gather


# gloo's broadcast is a binomial tree, not the ring model's pipeline. By position in the tree,
# q = (rank - src) mod N, each sender sends S to each of its children: N=2: 0 -> 1; N=3: 0 -> 1
# and 2; N=4: 0 -> 1 and 2, then 1 -> 3. Bytes sent by position, in units of S (measured):
TREE = {2: [1, 0], 3: [2, 0, 0], 4: [2, 1, 0, 0]}


@pytest.mark.parametrize("src", ["0", "last"])
def test_broadcast_bytes_are_the_binomial_tree(suite, src):
    n, ranks = wire_results(suite)
    root = 0 if src == "0" else n - 1
    for rank, w in enumerate(ranks):
        e = w["ops"][f"broadcast_from_{src}"]["event"]
        expected = TREE[n][(rank - root) % n] * S
        assert abs(e.wire_bytes - expected) <= 0.02 * S, (rank, e.wire_bytes, expected)
    # the ring model says S for all ranks but one: the two agree only at N = 2
    assert ([w["ops"][f"broadcast_from_{src}"]["event"].ring_bytes > 0 for w in ranks]
            == [(rank - root) % n != n - 1 for rank in range(n)])


def test_overlapping_step_adds_up_and_leaves_the_users_writes_out(suite):
    n, ranks = wire_results(suite)
    for w in ranks:
        step, log = w["step"], w["step"]["log"]
        events_wire = log.total_wire_bytes()
        # The main thread printed and saved a file while collectives were open: the kernel
        # saw it write those bytes, and none of them went into an event.
        assert step["thread"] >= step["user_bytes"]
        comm_only = step["process"] - step["user_bytes"]
        assert near(events_wire, comm_only, 0.03), (events_wire, step)
        assert events_wire < step["process"] - step["user_bytes"] / 2  # not even half the file
        assert near(events_wire, log.total_ring_bytes(), 0.03)  # all-reduces and all-gathers
        assert not any(e.wire_exact for e in log.events)  # every window overlapped another


def test_wire_bytes_by_group(suite):
    n, ranks = wire_results(suite)
    if n == 2:
        pytest.skip("the pair of ranks 0 and 1 is the whole world")
    for rank, w in enumerate(ranks):
        log = w["groups"]
        world, pair = tuple(range(n)), (0, 1)
        assert [e.group_ranks for e in log.events] == [world] + ([pair] if rank < 2 else [])
        assert near(log.total_wire_bytes(group=world), 2 * (n - 1) / n * S, 0.02)
        assert near(log.total_wire_bytes(group=pair), S if rank < 2 else 0, 0.02)
        assert log.total_ring_bytes(group=pair) == (S if rank < 2 else 0)


# --- without a process group (one process, in this test process) ------------------------------


def test_ring_sent_bytes_by_hand():
    s = 48  # 12 fp32
    assert theory.rank_sent_bytes("all_reduce", s, 3) == 64  # 2*2*48/3
    assert theory.rank_sent_bytes("all_reduce", s, 4) == 72  # 2*3*48/4
    assert theory.rank_sent_bytes("reduce_scatter", s, 3) == 32  # 2*48/3
    assert theory.rank_sent_bytes("all_gather", s, 4) == 36  # 3*48/4
    assert theory.rank_sent_bytes("all_reduce", 1 << 30, 8) == 7 * (1 << 28)  # 2*7/8 GiB
    for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "send"):
        assert theory.rank_sent_bytes(op, s, 1) == 0  # nothing to send to
    # broadcast from src along src -> src+1 -> ...: all but the ring's last rank send S
    assert [theory.rank_sent_bytes("broadcast", s, 3, rank=r, src=0) for r in range(3)] == [
        48, 48, 0]
    assert [theory.rank_sent_bytes("broadcast", s, 4, rank=r, src=2) for r in range(4)] == [
        48, 0, 48, 48]
    assert theory.rank_sent_bytes("send", s, 2) == 48
    assert theory.rank_sent_bytes("recv", s, 2) == 0
    with pytest.raises(ValueError, match="unknown op"):
        theory.rank_sent_bytes("scatter", s, 2)


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
    assert [(e.op, e.tag, e.nbytes, e.ring_bytes) for e in log.events] == [
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
    assert outer.total_ring_bytes() == 0  # one rank sends nothing


def test_wire_bytes_is_none_where_it_cannot_be_measured(monkeypatch):
    with zerolab.record_comm() as log:
        comm.all_reduce(torch.ones(3), tag="measured")
    assert log.events[0].wire_bytes is not None and log.total_wire_bytes() is not None

    monkeypatch.setattr(written, "read", lambda thread: None)  # not Linux, no /proc
    with zerolab.record_comm() as log:
        comm.all_reduce(torch.ones(3), tag="a")
        comm.all_gather(torch.empty(3), torch.ones(3), tag="b")
    assert [e.wire_bytes for e in log.events] == [None, None]
    assert [e.ring_bytes for e in log.events] == [0, 0]  # the model is still there
    assert log.total_wire_bytes() is None and log.total_ring_bytes() == 0
    assert log.wire_bytes_by_op() == {"all_reduce": None, "all_gather": None}

    monkeypatch.undo()
    monkeypatch.setattr(backends, "writes_through_os", lambda group: False)  # NCCL
    with zerolab.record_comm() as log:
        comm.all_reduce(torch.ones(3), tag="nccl")
    assert log.events[0].wire_bytes is None and log.total_wire_bytes() is None


def test_overlapping_windows_share_by_expected_bytes(monkeypatch):
    """The attribution by hand, with made-up counter readings (process, recording thread)."""
    big = comm.CommEvent("all_reduce", "big", nbytes=0, ring_bytes=300, wire_bytes=0)
    small = comm.CommEvent("all_gather", "small", nbytes=0, ring_bytes=100, wire_bytes=0)
    rec = comm._Recording(comm.CommLog(0, 2), thread=1, last=written.Written(1000, 50))
    rec.open = [comm._Open(big, weight=300, blocking=False)]
    rec.advance(written.Written(1500, 70))  # big alone, async: 500 written, 20 of it the user's
    assert (big.wire_bytes, big.wire_exact) == (480, True)
    rec.open.append(comm._Open(small, weight=100, blocking=False))
    rec.advance(written.Written(1900, 70))  # both open: 400 shared 3:1
    assert (big.wire_bytes, small.wire_bytes) == (780, 100)
    assert not big.wire_exact and not small.wire_exact
    rec.open = [comm._Open(small, weight=100, blocking=True)]
    rec.advance(written.Written(2000, 90))  # synchronous: the thread's 20 bytes were the call's
    assert small.wire_bytes == 200
    rec.open = []
    rec.advance(written.Written(5000, 3000))  # nothing open: nobody's
    assert big.wire_bytes + small.wire_bytes == 980 == (2000 - 1000) - 20


@pytest.mark.parametrize("n", [2, 3, 4])
def test_reduce_scatter_by_sends_in_place_async_and_max(n):
    """The engines' ways of calling it: ZeRO-1 reduces in place (the output is its own chunk
    of the input, whose other chunks must be left as they were), ZeRO-2/3 into a separate
    tensor, asynchronously beside other collectives; MAX is not a sum and all-reduces."""
    results = zerolab.launch(comm_workers.reduce_scatter_variants, n)
    total = n * (n + 1) // 2  # sum of (rank + 1)
    for r in results:
        mine = r["mine"]
        assert torch.equal(r["separate"], mine * total)
        assert torch.equal(r["in_place"], mine * total / n)
        assert r["in_place_rest_untouched"]
        assert torch.equal(r["async.a"], mine * n + total - n)  # sum of (base + rank)
        assert torch.equal(r["async.b"], mine * n - (total - n))
        assert r["gathered"].tolist() == [float(q) for q in range(n) for _ in range(2)]
        assert torch.equal(r["max"], mine)
        pairs = "1 send/recv pair" if n == 2 else f"{n - 1} send/recv pairs"
        assert r["impl"]["v/separate"] == r["impl"]["v/in_place"] == \
            f"reduce_scatter as {pairs} (gloo)"
        assert r["impl"]["v/max"] == "reduce_scatter as all_reduce (gloo)"


def test_a_reduce_scatter_into_another_ranks_chunk_is_refused():
    messages = zerolab.launch(comm_workers.reduce_scatter_into_another_chunk, 2)
    for message in messages:
        assert message is not None and "shares memory with the input but is not this rank's " \
            "own chunk" in message
