"""Worker functions for test_comm.py: measured (wire) bytes next to the ring model.

One launch per world size runs `suite`: the small-tensor tour of every collective
(launch_workers.comm_suite), then the wire measurements on tensors of S >= 1 MiB.
"""

import os
import tempfile
import threading

import torch
import torch.distributed as dist

from workers import launch as launch_workers
from zerolab import comm
from zerolab.wire import backends
from zerolab.wire import written as wire


def suite(delay, numel):
    result = launch_workers.comm_suite(delay)
    if dist.get_world_size() > 1:
        result["wire"] = {"ops": one_at_a_time(numel), "native": torch_natives(numel),
                          "step": overlapping_step(numel), "groups": in_a_subgroup(numel)}
    return result


def written() -> wire.Written:
    """The counters for this process and this (the main) thread."""
    return wire.read(threading.get_native_id())


def outer(fn) -> dict:
    """What the process and this thread wrote while `fn` ran, all ranks starting together."""
    dist.barrier()
    before = written()
    fn()
    after = written()
    return {"process": after.process - before.process, "thread": after.thread - before.thread}


def one_at_a_time(numel):
    """Each zerolab collective alone, synchronous, over S = 4 * numel bytes (fp32)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    full, shard = torch.ones(numel), torch.ones(numel // n)  # (numel,), (numel / n,)
    calls = {
        "all_reduce": lambda: comm.all_reduce(full, tag="wire/all_reduce"),
        "all_gather": lambda: comm.all_gather(full, shard, tag="wire/all_gather"),
        "reduce_scatter": lambda: comm.reduce_scatter(shard, full, tag="wire/reduce_scatter"),
        "reduce_scatter_async": lambda: async_with_user_writes(
            lambda: comm.reduce_scatter(shard, full, tag="wire/rs_async", async_op=True)),
        "broadcast_from_0": lambda: comm.broadcast(full, 0, tag="wire/broadcast_from_0"),
        "broadcast_from_last": lambda: comm.broadcast(full, n - 1,
                                                      tag="wire/broadcast_from_last"),
    }
    out = {}
    with comm.record_comm() as log:
        for name, call in calls.items():
            measured = outer(call)
            event = log.events[-1]
            out[name] = {"event": event, "outer": measured["process"], "rank": rank}
    return out


def async_with_user_writes(issue) -> None:
    """Issue an async collective, print and write a file while it is in flight, then wait. gloo
    writes much of a send/recv from the calling thread, inside the issue or the wait: those
    bytes are the collective's; the print and the file in between are not."""
    handle = issue()
    print("in flight " + "." * 500, flush=True)
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "f.bin"), "wb") as f:
        f.write(b"\0" * (1 << 20))
    handle.wait()


def torch_natives(numel):
    """torch's own gloo all-gather and reduce-scatter, measured from outside (no recorder)."""
    n = dist.get_world_size()
    full, shard = torch.ones(numel), torch.ones(numel // n)
    return {
        "all_gather": outer(lambda: backends.torch_all_gather(full, shard))["process"],
        "reduce_scatter": outer(lambda: backends.torch_reduce_scatter(shard, full))["process"],
    }


def overlapping_step(numel):
    """Several async collectives in flight at once, a synchronous one among them, and the main
    thread printing and saving a file while they are open. Measured from outside as a whole."""
    n = dist.get_world_size()
    a, b, c = torch.ones(numel), torch.ones(numel), torch.ones(numel // 2)
    gathered, more = torch.empty(numel), torch.empty(numel)
    file_bytes = b"\0" * (1 << 20)  # 1 MiB: as much as a fraction of the step's traffic
    message = "step: collectives in flight " + "." * 200
    with tempfile.TemporaryDirectory() as tmp, comm.record_comm() as log:
        dist.barrier()
        before = written()
        handles = [comm.all_reduce(a, tag="step/ar.a", async_op=True),
                   comm.all_gather(gathered, torch.ones(numel // n), tag="step/ag.1",
                                   async_op=True),
                   comm.all_reduce(c, tag="step/ar.c", async_op=True)]
        print(message, flush=True)  # user code while they are in flight
        with open(os.path.join(tmp, "checkpoint.bin"), "wb") as f:
            f.write(file_bytes)
        comm.all_reduce(b, tag="step/ar.b")  # synchronous, while the others are open
        handles.append(comm.all_gather(more, torch.ones(numel // n), tag="step/ag.2",
                                       async_op=True))
        for handle in reversed(handles):
            handle.wait()
        after = written()
    return {"log": log, "process": after.process - before.process,
            "thread": after.thread - before.thread,
            "user_bytes": len(file_bytes) + len(message) + 1}  # + the newline


def in_a_subgroup(numel):
    """An all-reduce in the group of ranks 0 and 1 (every rank must create the group)."""
    pair = dist.new_group([0, 1])
    with comm.record_comm() as log:
        comm.all_reduce(torch.ones(numel), tag="wire/world")
        if dist.get_rank() in (0, 1):
            comm.all_reduce(torch.ones(numel), tag="wire/pair", group=pair)
    return log


def reduce_scatter_variants():
    """zerolab's gloo reduce-scatter in the ways the engines call it: into a separate tensor,
    in place (ZeRO-1: the output is this rank's own chunk of the input), asynchronously with
    another collective in flight, and with MAX (which still runs as an all-reduce)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    k = 5
    base = torch.arange(n * k, dtype=torch.float32)  # (n * k,)
    mine = base[rank * k:(rank + 1) * k]
    out = {}
    with comm.record_comm() as log:
        separate = torch.empty(k)
        comm.reduce_scatter(separate, base * (rank + 1), tag="v/separate")
        out["separate"] = separate
        full = base * (rank + 1)
        own = full[rank * k:(rank + 1) * k]  # a view: reduced in place
        comm.reduce_scatter(own, full, op="avg", tag="v/in_place")
        out["in_place"] = own.clone()
        out["in_place_rest_untouched"] = torch.equal(
            torch.cat([full[:rank * k], full[(rank + 1) * k:]]),
            torch.cat([(base * (rank + 1))[:rank * k], (base * (rank + 1))[(rank + 1) * k:]]))
        a, b = torch.empty(k), torch.empty(k)
        ha = comm.reduce_scatter(a, base + rank, tag="v/async.a", async_op=True)
        gathered = torch.empty(n * 2)
        hg = comm.all_gather(gathered, torch.full((2,), float(rank)), tag="v/ag", async_op=True)
        hb = comm.reduce_scatter(b, base - rank, tag="v/async.b", async_op=True)
        for h in (hb, hg, ha):
            h.wait()
        out["async.a"], out["async.b"], out["gathered"] = a, b, gathered
        biggest = torch.empty(k)
        comm.reduce_scatter(biggest, base * (1 if rank == n - 1 else -1), op="max", tag="v/max")
        out["max"] = biggest
    out["impl"] = {e.tag: e.impl for e in log.events}
    out["mine"] = mine
    return out


def reduce_scatter_into_another_chunk():
    """The output is a chunk of the input, but not this rank's own: refused."""
    n = dist.get_world_size()
    full = torch.ones(2 * n)
    other = (dist.get_rank() + 1) % n
    try:
        comm.reduce_scatter(full[2 * other:2 * other + 2], full, tag="v/wrong_chunk")
    except ValueError as error:
        return str(error)
    return None
