"""Worker functions for the tests: the ranks import them from here."""

import importlib
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from zerolab import comm


def rank_and_size():
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(t, tag="test/all_reduce")
    return t


def return_tensors(n):
    return {"rank": dist.get_rank(), "t": torch.arange(n) * dist.get_rank(),
            "nested": [torch.ones(2)]}


def raise_on(rank):
    if dist.get_rank() == rank:
        raise KeyError(f"boom from {rank}")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others wait here for the rank that raised
    return t


def hang_on(rank):
    if dist.get_rank() == rank:
        time.sleep(600)
    t = torch.zeros(1)
    dist.all_reduce(t)
    return t


def exit_hard(rank):
    if dist.get_rank() == rank:
        os._exit(3)
    return dist.get_rank()


def noisy():
    print("hello from a rank")
    print("to stderr", file=sys.stderr)
    warnings.warn("a warning from a rank", stacklevel=2)
    return dist.get_rank()


def pid():
    return os.getpid()


# --- added for test_launch.py / test_comm.py ----------------------------------------------------


def all_reduce_value(value):
    """Sum of value * (rank + 1) over the ranks, on every rank."""
    t = torch.tensor([float(value) * (dist.get_rank() + 1)])
    comm.all_reduce(t, tag="test/all_reduce_value")
    return t


def describe(n, payload):
    """Where this rank sits, what it was given, and tensors of several kinds to send back."""
    import zerolab

    rank = dist.get_rank()
    base = torch.arange(10, dtype=torch.float32) * rank
    grad_holder = torch.full((3,), float(rank), requires_grad=True)
    return {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "context": zerolab.init_from_env(),  # the group is already up: it must just report it
        "pid": os.getpid(),
        "float": torch.arange(n, dtype=torch.float32) * rank,
        "int64": torch.arange(n, dtype=torch.int64) + 10**12,
        "bf16": torch.full((n,), 1.5 + rank, dtype=torch.bfloat16),
        "base": base,
        "view": base[2:5],  # must come back as a view of "base", not a copy
        "transposed": torch.arange(6.0).view(2, 3).t(),
        "requires_grad": grad_holder,
        "big": torch.full((1 << 20,), float(rank)),  # 4 MiB
        "nested": [torch.ones(2) * rank, (torch.zeros(1),)],
        "payload": payload,  # the caller's args, as this rank received them
    }


def comm_suite(delay):
    """Every zerolab collective once, on 12-element tensors, inside one record_comm block.

    Rank 0 sleeps `delay` seconds before entering record_comm (its aligning barrier must absorb
    it) and again inside a span before the last all-reduce (every rank's "align" event must then
    end at the same aligned time).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    k = 12 // n
    out = {}
    if rank == 0:
        time.sleep(delay)
    with comm.record_comm() as log:
        t = torch.arange(12, dtype=torch.float32) + 100 * rank
        comm.all_reduce(t, tag="ar/sum")
        out["ar/sum"] = t
        t = torch.arange(12, dtype=torch.float32) + 100 * rank
        comm.all_reduce(t, tag="ar/avg", op="avg")
        out["ar/avg"] = t
        t = torch.arange(12, dtype=torch.float32) * (rank + 1)
        comm.all_reduce(t, tag="ar/max", op="max")
        out["ar/max"] = t
        t = torch.full((12,), float(rank + 1), dtype=torch.float16)
        comm.all_reduce(t, tag="ar/fp16")
        out["ar/fp16"] = t

        inp = torch.arange(12, dtype=torch.float32) * (rank + 1)
        o = torch.empty(k)
        comm.reduce_scatter(o, inp, tag="rs/sum")
        out["rs/sum"] = o
        o = torch.empty(k)
        comm.reduce_scatter(o, inp, tag="rs/avg", op="avg")
        out["rs/avg"] = o
        # The seeds' example: chunk j of rank r is [(r+1)*1, (r+1)*2] ** (j+1).
        chunks = [torch.tensor([(rank + 1) * 1.0, (rank + 1) * 2.0]) ** (j + 1) for j in range(n)]
        o = torch.empty(2)
        comm.reduce_scatter(o, torch.cat(chunks), tag="rs/seeds")
        out["rs/seeds"] = o

        o = torch.empty(12)
        comm.all_gather(o, torch.arange(k, dtype=torch.float32) + 100 * rank, tag="ag")
        out["ag"] = o

        src = n - 1
        t = torch.arange(12, dtype=torch.float32) if rank == src else torch.zeros(12)
        comm.broadcast(t, src, tag="bc")
        out["bc"] = t

        if n > 1:  # a ring of send/recv; even ranks send first so that odd rings cannot deadlock
            mine, got = torch.full((12,), float(rank)), torch.empty(12)
            if rank % 2 == 0:
                comm.send(mine, (rank + 1) % n, tag="p2p/send")
                comm.recv(got, (rank - 1) % n, tag="p2p/recv")
            else:
                comm.recv(got, (rank - 1) % n, tag="p2p/recv")
                comm.send(mine, (rank + 1) % n, tag="p2p/send")
            out["p2p/recv"] = got

        t = torch.full((12,), float(rank + 1))
        handle = comm.all_reduce(t, tag="async/avg", op="avg", async_op=True)
        event = log.events[-1]
        out["async/end_before_wait"] = event.end
        out["async/issued_by"] = log.now()
        handle.wait()
        out["async/avg"] = t
        o = torch.empty(12)
        handle = comm.all_gather(o, torch.full((k,), float(rank)), tag="async/ag", async_op=True)
        handle.wait()
        out["async/ag"] = o

        with comm.span("compute"):
            if rank == 0:
                time.sleep(delay)
        comm.all_reduce(torch.ones(12), tag="align")
    out["t0"] = log.t0  # perf_counter: one system-wide monotonic clock on Linux
    return {"out": out, "log": log}


def all_reduce_cuda():
    """NCCL path: rank r contributes r + 1 on its own GPU."""
    t = torch.tensor([float(dist.get_rank() + 1)], device="cuda")
    comm.all_reduce(t, tag="test/cuda")
    return {"device": str(t.device), "current": torch.cuda.current_device(), "value": t}


def destroys_its_group():
    """Ends like a torchrun script: tears down its own process group before returning."""
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


# --- added for the launch error messages (test_launch.py) ---------------------------------------


def kill_self_with(rank, signal_name):
    """Rank `rank` is killed by the named signal, as a crash or the OOM killer would do it."""
    import signal

    if dist.get_rank() == rank:
        os.kill(os.getpid(), getattr(signal, signal_name))
        time.sleep(60)  # the signal is delivered before this returns
    return dist.get_rank()


def uneven_broadcast():
    """A collective whose sizes differ across ranks: rank 0 sends 3 floats, rank 1 expects 2.
    gloo cannot raise this as a Python exception on the receiving rank: it aborts it."""
    t = torch.ones(3 if dist.get_rank() == 0 else 2)
    dist.broadcast(t, src=0)
    return t


def where_am_i(module_name):
    """What a rank sees of the caller: its environment, directory and sys.path (a module
    importable only from there), and who started it."""
    module = importlib.import_module(module_name)
    return {"probe": os.environ.get("ZEROLAB_PROBE"), "cwd": os.getcwd(),
            "module": module.__file__, "ppid": os.getppid(), "pid": os.getpid()}


def sleep_and_note_pid(folder):
    """Write this rank's pid to `folder`, then sleep: a rank for a test to kill its caller."""
    (Path(folder) / f"rank-{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(600)


def unseeded_draws():
    """Random numbers drawn without seeding: a new process's own, from each generator."""
    import random

    import numpy as np
    return (torch.rand(4).tolist(), np.random.rand(4).tolist(), [random.random() for _ in range(4)])


# --- added for the launch's idle timeout, loopback and clean-up (test_launch*.py) -------------


def listening_addresses():
    """The addresses this rank's sockets listen on (gloo's), after a collective."""
    import psutil

    t = torch.ones(1)
    dist.all_reduce(t)
    return sorted({c.laddr.ip for c in psutil.Process().net_connections("inet")
                   if c.status == psutil.CONN_LISTEN})


def slow_but_progressing(compute_s, steps, pause_s):
    """Longer than a short timeout, but never idle: rank 1 computes for compute_s while rank 0
    waits for it in an all-reduce (CPU: progress), then every rank sleeps pause_s between
    all-reduces, steps times (collectives: progress)."""
    t = torch.ones(1)
    if dist.get_rank() == 1:
        end = time.perf_counter() + compute_s
        x = torch.rand(64, 64)
        while time.perf_counter() < end:
            x = (x @ x).softmax(-1)  # busy
    dist.all_reduce(t)
    for _ in range(steps):
        time.sleep(pause_s)
        dist.all_reduce(t)
    return t.item()


def start_children(folder, then):
    """Start two grandchildren that would sleep for 10 minutes (one in this rank's process
    group, one in a session of its own), note their pids in `folder`, then `then`: "return",
    "raise", "hang" (rank 0 waits in an all-reduce rank 1 never joins) or "sleep"."""
    import subprocess

    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    kids = [subprocess.Popen(sleeper), subprocess.Popen(sleeper, start_new_session=True)]
    rank = dist.get_rank()
    (Path(folder) / f"kids-{rank}").write_text(" ".join(str(k.pid) for k in kids))
    (Path(folder) / f"rank-{rank}").write_text(str(os.getpid()))
    if then == "raise":
        raise RuntimeError("a rank that failed after starting children")
    if then == "hang" and rank == 0:
        dist.all_reduce(torch.ones(1))
    if then in ("hang", "sleep"):
        time.sleep(600)
    return rank


class Unpicklable:
    """An argument that cannot be sent to the ranks."""

    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def set_order() -> tuple[str, ...]:
    """The order in which this rank iterates a set of parameter-like names."""
    return tuple({f"blocks.{i}.{part}" for i in range(8) for part in ("attn", "mlp", "ln")})
