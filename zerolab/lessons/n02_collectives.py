"""Notebook 02: all-reduce, reduce-scatter and all-gather; a ring all-gather from send/recv.

`collectives_tour` runs on each rank of `zerolab.launch(collectives_tour, world_size=4)`. To
measure at world sizes 2, 3 and 4 without paying for three launches, it builds process groups
of the first k ranks (notebook 00) and runs each experiment inside one: ranks outside the group
skip it. Group rank and global rank coincide in these groups (they start at rank 0), which
keeps the send/recv code readable.

Every tensor here holds small integers, so every sum is exact in float32 and printed values
can be compared exactly. The results come back as the dataclasses below.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm
from zerolab.comm import CommLog
from zerolab.wire import backends, written

Ints = list[int | None]  # a tensor of small integers as a list; None: a slot not received yet


@dataclass
class ArticleExample:
    """One rank's view of `article_example`, on 3 ranks (tensors as lists of ints)."""

    input_chunks: list[Ints]  # this rank's input, 3 chunks of 2
    reduce_scatter: Ints  # (2,): chunk r summed over the ranks
    all_gather: Ints  # (6,): every rank's reduce-scatter result, in rank order
    all_reduce: Ints  # (6,): the inputs summed over the ranks
    rs_then_ag_equals_ar: bool  # all_gather == all_reduce, exactly: AR = RS + AG
    ring_snapshots: list[Ints]  # our ring all-gather's output after each step (None: empty)
    ring_equals_torch: bool  # the ring's final output == torch's all-gather, exactly


@dataclass
class CollectivesTour:
    """One rank's results of `collectives_tour`."""

    rank: int  # global rank, of 4
    example: ArticleExample | None  # ranks 0-2: the 3-rank example; None on rank 3
    bytes: dict[int, dict[str, CommLog]]  # k -> `bytes_experiment`'s logs in ranks 0..k-1
    torch_reduce_scatter: dict[int, int | None]  # k -> bytes torch's own gloo rs wrote here
    reduce_scatter_s: dict[str, list[float]]  # "zerolab" / "torch" -> seconds, call by call
    timeline: CommLog  # `timeline_experiment` on all 4 ranks


def pass_right(send: torch.Tensor, recv: torch.Tensor, rank: int, world_size: int,
               group: dist.ProcessGroup | None, tag: str) -> None:
    """One ring step: send `send` to rank + 1, receive `recv` (filled in place) from rank - 1.

    A blocking send returns only once the receiver has posted its receive. If every rank sent
    first, every rank would wait for ever; so even ranks send then receive and odd ranks
    receive then send. Rank 0 (even) starts, rank 1 receives it, and the ring unwinds (with an
    odd world size too: the last rank, even, waits on rank 0's receive, which comes after
    rank 0's send has been taken by rank 1).
    """
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if rank % 2 == 0:
        comm.send(send, right, tag=f"{tag}/send", group=group)
        comm.recv(recv, left, tag=f"{tag}/recv", group=group)
    else:
        comm.recv(recv, left, tag=f"{tag}/recv", group=group)
        comm.send(send, right, tag=f"{tag}/send", group=group)


def ring_all_gather(shard: torch.Tensor, group: dist.ProcessGroup | None = None,
                    tag: str = "ring_ag") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All-gather built from sends and receives around a ring.

    shard: (k,), this rank's piece. Returns (out, snapshots): out (N*k,) holds every rank's
    shard in rank order, like torch's all-gather; snapshots[s] is a copy of out after step s
    (slots not received yet are NaN), to watch the ring fill up.

    N - 1 steps. At step s, rank r forwards the shard it received at step s - 1 (its own at
    step 0), that is shard (r - s) mod N, and receives shard (r - s - 1) mod N from the left.
    Every rank sends N - 1 shards of k elements: (N-1)/N of the output's bytes.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = torch.full((n * shard.numel(),), float("nan"), dtype=shard.dtype, device=shard.device)
    slots = out.chunk(n)  # views into out: receiving into a slot fills out
    slots[rank].copy_(shard)
    snapshots = [out.clone()]
    for step in range(n - 1):
        pass_right(slots[(rank - step) % n], slots[(rank - step - 1) % n], rank, n, group,
                   tag=f"{tag}/step{step}")
        snapshots.append(out.clone())
    return out, snapshots


def _ints(t: torch.Tensor) -> Ints:
    """A tensor of small integers (NaN: not received yet) as a list of ints (None for NaN)."""
    return [None if v != v else int(v) for v in t.tolist()]


def article_example(group: dist.ProcessGroup, device: torch.device) -> ArticleExample:
    """The 3-rank example of "AI in Multiple GPUs: ZeRO & FSDP" (Towards Data Science), then
    all-gather, all-reduce and AR = RS + AG on it.

    Rank r's input is 3 chunks of 2: chunk j = [(r+1)*1, (r+1)*2] ** (j+1), laid end to end
    (6,). reduce-scatter (sum) gives rank r chunk r summed over the ranks (2,):
    rank 0 [6, 12], rank 1 [14, 56], rank 2 [36, 288].
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    base = torch.tensor([1.0, 2.0], device=device) * (rank + 1)
    x = torch.cat([base ** (j + 1) for j in range(n)])  # (n*2,): n chunks of 2

    mine = torch.empty(2, device=device)
    comm.reduce_scatter(mine, x, tag="lesson02/example/reduce_scatter", group=group)

    gathered = torch.empty(n * 2, device=device)  # everyone's reduce-scatter result, in order
    comm.all_gather(gathered, mine, tag="lesson02/example/all_gather", group=group)

    reduced = x.clone()
    comm.all_reduce(reduced, tag="lesson02/example/all_reduce", group=group)

    ring, snapshots = ring_all_gather(mine, group, tag="lesson02/example/ring")
    return ArticleExample(input_chunks=[_ints(c) for c in x.chunk(n)],
                        reduce_scatter=_ints(mine), all_gather=_ints(gathered),
                        all_reduce=_ints(reduced),
                        rs_then_ag_equals_ar=torch.equal(gathered, reduced),  # AR = RS + AG
                        ring_snapshots=[_ints(s) for s in snapshots],
                        ring_equals_torch=torch.equal(ring, gathered))


def bytes_experiment(group: dist.ProcessGroup, numel: int, device: torch.device
                     ) -> dict[str, CommLog]:
    """Each collective on a float32 tensor of S = 4 * numel bytes, logged separately.

    numel must divide by the group's size. Returns {name: this rank's CommLog}: "all_reduce",
    "reduce_scatter", "all_gather", "rs+ag" (a reduce-scatter then an all-gather: an
    all-reduce in two halves) and "ring all_gather" (ours: its bytes are the real payloads of
    its sends). In each log, nbytes is S and sent_bytes what this rank sends.
    """
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(rank)
    full = torch.randint(-9, 10, (numel,), generator=gen).float().to(device)  # (numel,)
    part = torch.empty(numel // n, device=device)  # (numel / n,)
    logs = {}
    with zerolab.record_comm(group) as logs["all_reduce"]:
        comm.all_reduce(full.clone(), tag="lesson02/bytes/all_reduce", group=group)
    with zerolab.record_comm(group) as logs["reduce_scatter"]:
        comm.reduce_scatter(part, full, tag="lesson02/bytes/reduce_scatter", group=group)
    with zerolab.record_comm(group) as logs["all_gather"]:
        comm.all_gather(torch.empty_like(full), part, tag="lesson02/bytes/all_gather",
                        group=group)
    with zerolab.record_comm(group) as logs["rs+ag"]:
        comm.reduce_scatter(part, full, tag="lesson02/bytes/rs", group=group)
        comm.all_gather(torch.empty_like(full), part, tag="lesson02/bytes/ag", group=group)
    with zerolab.record_comm(group) as logs["ring all_gather"]:
        ring_all_gather(part, group, tag="lesson02/bytes/ring")
    return logs


def torch_reduce_scatter_bytes(group: dist.ProcessGroup, numel: int, device: torch.device
                               ) -> int | None:
    """Bytes this rank wrote to its sockets during torch's own reduce-scatter (not zerolab's)
    of S = 4 * numel bytes, read from the kernel's counter around the call (None: no counter).
    The ranks meet at a barrier first, so that its few bytes fall outside the window."""
    n = dist.get_world_size(group)
    full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
    comm.barrier(tag="lesson02/bytes/torch_rs_start", group=group)
    before = written.read(threading.get_native_id())
    backends.torch_reduce_scatter(part, full, group=group)
    after = written.read(threading.get_native_id())
    return None if before is None or after is None else after.process - before.process


def time_reduce_scatters(numel: int, repeats: int, device: torch.device
                         ) -> dict[str, list[float]]:
    """zerolab's reduce-scatter (N-1 send/recv pairs on gloo) and torch's own (an all-reduce
    underneath on gloo), in turns, on every rank: each call's seconds, from a barrier."""
    n = dist.get_world_size()
    full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
    calls = {"zerolab": lambda: comm.reduce_scatter(part, full, tag="lesson02/time/rs_turns"),
             "torch": lambda: backends.torch_reduce_scatter(part, full)}
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            comm.barrier(tag="lesson02/time/rs_turns_start")
            start = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def timeline_experiment(group: dist.ProcessGroup | None, numel: int, device: torch.device
                        ) -> CommLog:
    """One log of: an all-reduce, a reduce-scatter + all-gather, and our ring all-gather, on
    a tensor big enough (4 * numel bytes) for each call to take visible time. Spans name the
    three phases ("phase 1: all-reduce", ...), so that the timeline's upper lane says which is
    which."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    full = torch.full((numel,), float(rank + 1), device=device)
    part = torch.empty(numel // n, device=device)
    with zerolab.record_comm(group) as log:
        with log.span("phase 1: all-reduce"):
            comm.all_reduce(full.clone(), tag="lesson02/time/all_reduce", group=group)
        with log.span("phase 2: RS + AG"):
            comm.reduce_scatter(part, full, tag="lesson02/time/rs", group=group)
            comm.all_gather(torch.empty_like(full), part, tag="lesson02/time/ag", group=group)
        with log.span("phase 3: ring AG"):
            ring_all_gather(part, group, tag="lesson02/time/ring")
    return log


def collectives_tour(bytes_numel: int = 12 * 1024, timeline_numel: int = 12 * 2**14
                     ) -> CollectivesTour:
    """Everything notebook 02 measures, in one launch of 4 ranks.

    Returns this rank's CollectivesTour: the article's example and friends on ranks 0-2 (see
    `article_example`); for the k = 2, 3, 4 this rank belongs to, the logs of
    `bytes_experiment` in the group of ranks 0..k-1 and the bytes torch's own reduce-scatter
    wrote there; the log of `timeline_experiment` on all 4 ranks; and zerolab's and torch's
    reduce-scatters timed in turns on all 4 (`time_reduce_scatters`, 3 MiB by default).
    """
    ctx = zerolab.init_from_env()
    # Group creation is collective: every rank creates every group, in the same order.
    groups = {k: dist.new_group(list(range(k))) for k in (2, 3)}
    groups[ctx.world_size] = None  # the default group: every rank
    example = article_example(groups[3], ctx.device) if ctx.rank < 3 else None
    logs = {k: bytes_experiment(group, bytes_numel, ctx.device)
            for k, group in groups.items() if ctx.rank < k}
    torch_rs = {k: torch_reduce_scatter_bytes(group, bytes_numel, ctx.device)
                for k, group in groups.items() if ctx.rank < k}
    timeline = timeline_experiment(None, timeline_numel, ctx.device)
    rs_seconds = time_reduce_scatters(4 * timeline_numel, 10, ctx.device)
    return CollectivesTour(rank=ctx.rank, example=example, bytes=logs,
                           torch_reduce_scatter=torch_rs, reduce_scatter_s=rs_seconds,
                           timeline=timeline)
