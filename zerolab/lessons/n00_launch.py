"""Notebook 00: ranks, process groups and the first all-reduce, on N processes.

Every function here runs on each rank of `zerolab.launch(fn, world_size=N)`: N new processes,
each with the default process group already initialised. They return plain data (a small
dataclass per function, below), which `launch` brings back to the notebook as a list ordered by
rank. The last section's functions run in the notebook: each launches one of the classic hangs
and returns what the launcher's flight recorders found (`provoke_hang`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm
from zerolab.comm import CommLog


@dataclass
class FirstAllReduce:
    """One rank's view of `first_all_reduce`."""

    rank: int  # this rank, 0 .. world_size - 1
    world_size: int  # N, the number of ranks launched
    backend: str  # "gloo" on CPU, "nccl" on GPUs
    device: str  # where this rank's tensors live: "cpu", "cuda:r"
    pid: int  # the operating system's process id: one process per rank
    threads: int  # torch's intra-op threads in this rank
    before: list[int]  # x_r = (r + 1) * [1, 10, 100], before the all-reduce
    after: list[int]  # x_0 + ... + x_{N-1} = N(N+1)/2 * [1, 10, 100], on every rank
    log: CommLog  # what zerolab.comm recorded: the call (op, tag, bytes, times), "work" span


@dataclass
class PairSums:
    """One rank's view of `process_groups`."""

    rank: int  # global rank
    pair: list[int]  # the global ranks of its pair {2k, 2k + 1}
    rank_in_pair: int  # its rank inside the pair: 0 or 1
    world_sum: int  # all-reduce over every rank: 1 + 2 + ... + N
    pair_sum: int  # all-reduce over the pair only: (2k + 1) + (2k + 2)


def first_all_reduce(late_seconds: float = 0.25) -> FirstAllReduce:
    """Who am I, and the first collective: every rank adds its vector into everyone's.

    Rank r contributes x_r = (r + 1) * [1, 10, 100] (3,), and `all_reduce` (sum) overwrites
    x_r in place with x_0 + x_1 + ... + x_{N-1} on every rank: N(N+1)/2 * [1, 10, 100].
    Before the call, rank r is busy for (r + 1) * late_seconds (a sleep, standing in for a
    forward pass), so that the timeline shows who waits for whom.

    Returns this rank's FirstAllReduce: who it is, the vector before and after (lists of ints:
    the values are small integers, exact in float32) and the CommLog of the call.
    """
    ctx = zerolab.init_from_env()  # already initialised by launch: just reads where we are
    x = torch.tensor([1.0, 10.0, 100.0], device=ctx.device) * (ctx.rank + 1)  # (3,)
    before = [int(v) for v in x.tolist()]
    with zerolab.record_comm() as log:  # starts with a barrier: the ranks' clocks line up
        with log.span("work"):
            time.sleep((ctx.rank + 1) * late_seconds)  # the higher the rank, the later
        comm.all_reduce(x, tag="lesson00/first")  # in place; every rank must make this call
    return FirstAllReduce(rank=ctx.rank, world_size=ctx.world_size, backend=ctx.backend,
                          device=str(ctx.device), pid=os.getpid(),
                          threads=torch.get_num_threads(), before=before,
                          after=[int(v) for v in x.tolist()], log=log)


def process_groups() -> PairSums:
    """All-reduce over the whole world, then only within pairs of ranks (an even world size).

    Every rank creates every group, in the same order (group creation is itself collective);
    rank r then talks only in its own pair {2k, 2k+1}. Rank r contributes r + 1.

    Returns this rank's PairSums: its pair, its rank in it, the world sum (N(N+1)/2) and the
    pair sum ((2k+1) + (2k+2)), as ints.
    """
    ctx = zerolab.init_from_env()
    if ctx.world_size % 2:
        raise ValueError(f"process_groups pairs ranks up: use an even world size, "
                         f"not {ctx.world_size}")
    pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(ctx.world_size // 2)]
    mine = pairs[ctx.rank // 2]
    x = torch.tensor([ctx.rank + 1.0], device=ctx.device)  # (1,)
    world, pair = x.clone(), x.clone()
    comm.all_reduce(world, tag="lesson00/world")  # default group: every rank
    comm.all_reduce(pair, tag="lesson00/pair", group=mine)  # only the two ranks of `mine`
    return PairSums(rank=ctx.rank, pair=dist.get_process_group_ranks(mine),
                    rank_in_pair=dist.get_rank(mine), world_sum=int(world.item()),
                    pair_sum=int(pair.item()))


def fail_on(bad_rank: int, busy_seconds: float = 600.0) -> int:
    """Rank `bad_rank` raises at once; every other rank is busy for `busy_seconds`.

    Shows what `launch` does with a failure: it names the rank that raised, carries its
    traceback, and kills the ranks still running instead of waiting for them. (The others
    sleep rather than wait in a collective: gloo notices a dead peer within milliseconds and
    raises too, and then which failure is seen first would be a race. NCCL, on the contrary,
    would leave them waiting until its watchdog timeout, minutes later.)
    """
    rank = dist.get_rank()
    if rank == bad_rank:
        raise ValueError(f"rank {rank} found a NaN in its batch")
    time.sleep(busy_seconds)  # a long forward pass, or a collective waiting for bad_rank
    return rank


# --- when ranks hang: what the flight recorder says --------------------------------------------

# Three gradients of different sizes (elements), all-reduced one by one as DDP would.
GRADS = {"wte": 12, "wpe": 8, "ln_f": 4}


def set_orders(names: list[str], world_size: int) -> list[list[str]]:
    """For each rank: `list(set(names))` as a new Python process computes it, each rank with its
    own hash seed (PYTHONHASHSEED), the first seeds from 1 up whose orders all differ.

    Every rank is a Python with its own random str-hash salt, under torchrun and zerolab.launch
    alike (`string_hash`), so a loop over a set runs in its own order on each rank, and may by
    chance agree (1 time in 6 for 3 names): fixed seeds make the lesson's hang happen every run.
    """
    orders: list[list[str]] = []
    seed = 0
    while len(orders) < world_size:
        seed += 1
        out = subprocess.run([sys.executable, "-c", "import sys; print(*set(sys.argv[1:]))",
                              *names], env={**os.environ, "PYTHONHASHSEED": str(seed)},
                             capture_output=True, text=True, check=True).stdout.split()
        if out not in orders:
            orders.append(out)
    return orders


def hang_set_order() -> None:
    """Each rank all-reduces its gradients in the order of a set of their names: the orders
    differ, so rank 0's first all_reduce meets another rank's first, of another gradient.
    Sizes differ (12, 8, 4 elements): gloo aborts the rank whose sizes do not match. (Of the
    same size, nothing would stop: the gradients would be summed with the wrong ones.)"""
    grads = {name: torch.ones(numel) for name, numel in GRADS.items()}
    for name in set_orders(sorted(grads), dist.get_world_size())[dist.get_rank()]:
        dist.all_reduce(grads[name])  # torch.distributed directly: recorded all the same


def hang_skip(buckets: int = 3) -> None:
    """Rank 1 skips the all-reduce of the last bucket (say, a layer its batch did not use):
    the others wait in it for ever, while rank 1 returns."""
    for i in range(buckets):
        if dist.get_rank() == 1 and i == buckets - 1:
            continue
        comm.all_reduce(torch.ones(4 * (i + 1)), tag=f"lesson00/bucket{i}")


def hang_sizes(samples: int = 9) -> None:
    """Each rank all-gathers its share of `samples` predictions (rank r takes r, r+N, ...):
    9 over 2 ranks are 5 and 4, and an all-gather needs the same size from every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = torch.ones(len(range(rank, samples, world_size)))  # (5,) on rank 0, (4,) on rank 1
    everyone = torch.empty(world_size * mine.numel())
    dist.all_gather_into_tensor(everyone, mine)


HANGS = {"set order": hang_set_order, "skipped": hang_skip, "sizes": hang_sizes}


@dataclass
class HangVerdict:
    """What `zerolab.launch` said about one of the classic hangs (`provoke_hang`)."""

    case: str  # a key of HANGS
    error: str  # the exception's class: "LaunchTimeout" (hung) or "WorkerError" (aborted)
    headline: str  # its first line, less the seconds it measured (they vary from run to run)
    verdict: str  # where each rank was and the first collective where they differ
    seconds: float  # from the launch to the error (the launch's timeout was far longer)


# A deadlock's headline ends "(none moved for 1.0s)": measured, so 1.1s on a loaded machine.
_SECONDS = re.compile(r" \(none moved for [0-9.]+s\)")


def provoke_hang(case: str, world_size: int = 2, timeout: float = 60.0) -> HangVerdict:
    """In the notebook: launch one of HANGS and return what the launcher found."""
    start = time.perf_counter()
    try:
        zerolab.launch(HANGS[case], world_size, timeout=timeout)
    except (zerolab.LaunchTimeout, zerolab.WorkerError) as err:
        headline = _SECONDS.sub("", str(err).splitlines()[0])
        return HangVerdict(case, type(err).__name__, headline, err.explanation,
                           time.perf_counter() - start)
    raise AssertionError(f"{case}: the ranks did not hang")


def string_hash(name: str = "wte") -> int:
    """On each rank: Python's hash of `name`. Python salts str hashes with a seed it picks when it
    starts (PYTHONHASHSEED); torchrun's ranks are new Pythons, and zerolab's are forked from a
    helper of their own, each with its own seed (zerolab/launcher/zygote.py): the values differ
    from rank to rank, and so does the order of a set of names."""
    return hash(name)


# What the verdict says a rank did at the first differing collective: "waits in", "died in",
# "failed in", "called" (completed), "issued".
_RANK_DID = re.compile(r"\brank (\d+) (?:waits in|died in|failed in|called|issued) ")


def where_they_parted(verdict: str) -> str:
    """The verdict's last line (the first collective at which the ranks' records differ, each
    rank's record of it, and the likely cause), with what each rank did there reduced to "at".
    When gloo aborts one rank, whether its peer is then found failed, still waiting, or past
    the call depends on which the launcher sees first: a race, which the notebook's compared
    output must not show."""
    return _RANK_DID.sub(r"rank \1 at ", verdict.splitlines()[-1])
