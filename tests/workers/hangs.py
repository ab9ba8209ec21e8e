"""The classic hangs, issued through torch.distributed directly (and one through zerolab.comm):
the ranks of test_flight_recorder.py run these."""

import os
import signal
import time

import torch
import torch.distributed as dist

from zerolab import comm


def different_orders():
    """Every rank all-reduces the same named tensors, in the order of a set of their names as a
    new process would iterate it (per-rank hash seeds: reversed on odd ranks here)."""
    tensors = {"bias": torch.ones(3), "weight": torch.ones(5), "embedding": torch.ones(7)}
    order = sorted(tensors, reverse=dist.get_rank() % 2 == 1)
    for name in order:
        dist.all_reduce(tensors[name])


def different_ops():
    """Rank 0 all-reduces where the others broadcast (same size): both wait for ever."""
    t = torch.ones(10)
    dist.all_reduce(t)  # #1 on every rank
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def skipped(skipping_rank):
    """`skipping_rank` skips the third all-reduce and returns; the others wait in it."""
    for i in range(3):
        if dist.get_rank() == skipping_rank and i == 2:
            continue
        dist.all_reduce(torch.ones(4 * (i + 1)))


def skipped_in_comm():
    """Rank 1 skips zerolab's tagged all-reduce of bucket 1."""
    for i in range(2):
        if dist.get_rank() == 1 and i == 1:
            continue
        comm.all_reduce(torch.ones(8), tag=f"test/bucket{i}")


def mismatched_sizes():
    """An all-reduce of 10 floats on rank 0, of 20 elsewhere: gloo aborts a rank."""
    dist.all_reduce(torch.ones(10 if dist.get_rank() == 0 else 20))


def mismatched_dtypes():
    """Broadcast of the same bytes, float32 on rank 0 and int32 elsewhere (8 x 4 bytes)."""
    t = torch.ones(8, dtype=torch.float32 if dist.get_rank() == 0 else torch.int32)
    dist.broadcast(t, src=0)
    dist.all_reduce(torch.ones(1 + dist.get_rank()))  # then a size mismatch, to end it


def in_a_subgroup():
    """Ranks 0 and 1 of 3 form a group; rank 1 skips its all-reduce in it, and every rank then
    waits at a world barrier (rank 0 never gets there)."""
    pair = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(2), group=pair)
    dist.barrier()


def async_skipped():
    """Async all-reduces waited for later; rank 1 issues one fewer."""
    works = [dist.all_reduce(torch.ones(4), async_op=True)
             for _ in range(2 if dist.get_rank() == 1 else 3)]
    for work in works:
        work.wait()


def record_then_die(folder):
    """Issue a few collectives, then rank 1 kills itself with SIGKILL in the middle of one."""
    t = torch.ones(6)
    dist.all_reduce(t)
    comm.all_reduce(t, tag="test/tagged")
    dist.broadcast(t, src=1)
    if dist.get_rank() == 1:
        (open(os.path.join(folder, "pid-1"), "w")).write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    dist.all_reduce(t)


def recorded_calls():
    """A little of everything, then what this rank's flight recorder holds."""
    from zerolab.wire import flight

    rank, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(6)
    dist.all_reduce(t)                                             # #1
    comm.all_reduce(t, tag="test/ar")                              # #2, tagged
    out = torch.empty(2 * n, dtype=torch.float64)
    comm.all_gather(out, torch.ones(2, dtype=torch.float64), tag="test/ag")  # #3 (N broadcasts)
    comm.reduce_scatter(torch.empty(3), torch.ones(3 * n), tag="test/rs")    # #4 (send/recv)
    objects = [{"a": 1}] if rank == 0 else [None]
    dist.broadcast_object_list(objects, src=0)                     # #5 (two broadcasts inside)
    work = dist.all_reduce(torch.ones(2), async_op=True)           # #6, async
    pending = flight.read(flight.recorder().path).entries[-1].state
    work.wait()
    pair = dist.new_group([0, 1])
    if rank < 2:
        dist.all_reduce(torch.ones(1), group=pair)                 # pair's #1
    if rank == 0:                                                  # p2p, numbered apart
        dist.send(torch.ones(4), dst=1)
    elif rank == 1:
        dist.recv(torch.empty(4), src=0)
    dist.barrier()                                                 # #7
    return {"log": flight.read(flight.recorder().path), "async_before_wait": pending}


def recorder_overhead(pairs, steps_per_turn=1):
    """Step times of ZeRO-3 on the course GPT with the flight recorder on and off, in pairs in
    alternating order (ABBA), on this rank: {"on": [...], "off": [...]} in seconds.

    The recorder of this rank stays open; "off" takes it and torch's wrappers away (what a
    process without zerolab.launch runs), "on" puts them back."""
    from zerolab import engines, harness
    from zerolab.data import Corpus
    from zerolab.models import GPT, GPTConfig
    from zerolab.wire import flight, flight_torch

    corpus = Corpus.builtin()
    model = GPT(GPTConfig(vocab_size=corpus.tokenizer.vocab_size, block_size=64, n_layer=2,
                          n_head=4, n_embd=64, seed=0))
    engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=1e-3)
    x, y = corpus.batch(8, 64, seed=dist.get_rank())
    recorder = flight.recorder()

    def turn(on):
        if on:
            flight._recorder = recorder
            flight_torch.hook()
        else:
            flight_torch.unhook()
            flight._recorder = None
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps_per_turn):
            harness.train_step(engine, x, y)
        return (time.perf_counter() - start) / steps_per_turn

    for _ in range(3):
        harness.train_step(engine, x, y)  # warm up
    times = {"on": [], "off": []}
    for i in range(pairs):
        order = (True, False) if i % 2 == 0 else (False, True)
        for on in order:
            times["on" if on else "off"].append(turn(on))
    turn(True)  # leave it as it was
    return times


# --- calls whose ranks pass different things (zerolab/launcher/fingerprints.py) -----------------


def reduce_ops(then_s=0.0):
    """SUM on rank 0, MAX on rank 1: gloo returns a mix of both, on both ranks, without an
    error; then the ranks sleep `then_s` (the launcher must name it while they run)."""
    t = torch.tensor([2.0, 2.0, 1.0, 1.0]) * (dist.get_rank() + 1)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if dist.get_rank() == 0 else dist.ReduceOp.MAX)
    time.sleep(then_s)
    return t


def equal_size_dtypes():
    """An all-reduce of 4 float32 on rank 0 and 4 int32 on rank 1: the same 16 bytes."""
    t = torch.ones(4, dtype=torch.float32 if dist.get_rank() == 0 else torch.int32)
    comm.all_reduce(t, tag="test/dtypes")
    return t


def own_sources():
    """Every rank broadcasts from itself: each waits for a root that follows another."""
    dist.broadcast(torch.ones(4), src=dist.get_rank())


def both_receive_first():
    """Each rank receives from the other before sending to it."""
    t = torch.ones(4)
    dist.recv(t, src=1 - dist.get_rank())
    dist.send(t, dst=1 - dist.get_rank())

