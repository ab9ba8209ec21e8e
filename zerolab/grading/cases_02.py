"""Notebook 02's exercises (ex02_collectives): ring reduce-scatter and all-gather, and an
all-reduce built from them. All run on ranks, and their zerolab.comm traffic is checked."""

from __future__ import annotations

import torch

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import _gen, _ints


def _cases_2_1(n: int) -> list[Case]:
    def seeds(rank: int) -> tuple:
        base = torch.tensor([1.0, 2.0]) * (rank + 1)
        return (torch.cat([base ** (j + 1) for j in range(n)]),)

    cases = [Case("the seeds' example: chunk j of rank r is [(r+1)*1, (r+1)*2] ** (j+1)", seeds)]
    for k in (1, 3):
        cases.append(Case(f"random integers, {n} chunks of {k}",
                          lambda rank, k=k: (_ints(_gen("2.1", k, rank), n * k),)))
    return cases


def _cases_2_2(n: int) -> list[Case]:
    return [Case(f"shards of {k}",
                 lambda rank, k=k: (torch.randn(k, generator=_gen("2.2", k, rank)),))
            for k in (1, 2, 5)]


def _cases_2_3(n: int) -> list[Case]:
    return [Case(f"shape {shape}", lambda rank, s=shape: (_ints(_gen("2.3", s, rank), *s),))
            for shape in ((1,), (5, 3), (2 * n,), (2, 3, 4))]


EXERCISES = [
    Exercise("2.1", "ex02_collectives", "ring_reduce_scatter",
             "reduce-scatter as a ring of send/recv: N-1 steps, (N-1)/N of the bytes",
             "At step s rank r sends chunk (r-s-1) % N and adds what it receives into chunk "
             "(r-s-2) % N; after N-1 steps chunk r is complete. Send only through "
             "ring_exchange (zerolab.comm.send/recv), one chunk per step.",
             _cases_2_1, distributed=True, comm_checked=True),
    Exercise("2.2", "ex02_collectives", "ring_all_gather",
             "all-gather as a ring of send/recv",
             "Copy your own shard into chunk `rank` first; at step s send chunk (r-s) % N and "
             "receive into chunk (r-s-1) % N. Try it on paper for 3 ranks.",
             _cases_2_2, distributed=True, comm_checked=True),
    Exercise("2.3", "ex02_collectives", "all_reduce_mean",
             "all-reduce = reduce-scatter + all-gather, with padding for any size",
             "Use op='avg' in the reduce-scatter; pad the flat tensor to world_size * "
             "ceil(numel / world_size), and keep only the first numel elements at the end.",
             _cases_2_3, distributed=True, comm_checked=True),
]
