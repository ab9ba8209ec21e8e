"""Notebook 02's exercises (ex02_collectives): ring reduce-scatter and all-gather, and an
all-reduce built from them. All run on ranks, and their zerolab.comm traffic is checked."""

from __future__ import annotations

import itertools

import torch

from zerolab.grading.exercise import (
    Case,
    Exercise,
    new_memory_outputs,
    own_memory_outputs,
)
from zerolab.grading.inputs import ints, non_contiguous, rng
from zerolab.grading.mistakes import (
    DTYPE_LOST,
    Evidence,
    Mistake,
    any_of,
    bytes_times,
    matches,
    memory_mistakes,
    over_world_size,
    padding_kept,
    same_value,
    times_world_size,
    used_any_of,
    used_instead,
)

# Other kinds of input: (label, dtype, contiguous). Small integers are exact in bfloat16 too.
_KINDS = (("float64", torch.float64, True), ("bfloat16", torch.bfloat16, True),
          ("a non-contiguous view", torch.float32, False))


def _kind(t: torch.Tensor, dtype: torch.dtype, contiguous: bool) -> torch.Tensor:
    t = t.to(dtype)
    return t if contiguous else non_contiguous(t)


def _cases_2_1(n: int) -> list[Case]:
    def article(rank: int) -> tuple:
        base = torch.tensor([1.0, 2.0]) * (rank + 1)
        return (torch.cat([base ** (j + 1) for j in range(n)]),)

    cases = [Case("the article's example: chunk j of rank r is [(r+1)*1, (r+1)*2] ** (j+1)",
                  article)]
    for k in (1, 3):
        cases.append(Case(f"random integers, {n} chunks of {k}",
                          lambda rank, k=k: (ints(rng("2.1", k, rank), n * k),)))
    return cases + [Case(f"random integers, {n} chunks of 2, {label}",
                         lambda rank, d=dtype, c=contiguous: (
                             _kind(ints(rng("2.1", 2, rank), n * 2), d, c),))
                    for label, dtype, contiguous in _KINDS]


def _cases_2_2(n: int) -> list[Case]:
    cases = [Case(f"shards of {k}", lambda rank, k=k: (torch.randn(k, generator=rng(
                 "2.2", k, rank)),)) for k in (1, 2, 5)]
    return cases + [Case(f"shards of 3, {label}", lambda rank, d=dtype, c=contiguous: (
                    _kind(ints(rng("2.2", 3, rank), 3), d, c),))
                    for label, dtype, contiguous in _KINDS]


def _cases_2_3(n: int) -> list[Case]:
    cases = [Case(f"shape {shape}", lambda rank, s=shape: (ints(rng("2.3", s, rank), *s),))
             for shape in ((1,), (5, 3), (2 * n,), (2, 3, 4))]
    return cases + [Case(f"shape (5, 3), {label}", lambda rank, d=dtype, c=contiguous, k=label: (
                    _kind(ints(rng("2.3", k, rank), 5, 3), d, c),))
                    for label, dtype, contiguous in _KINDS]


# ---- what the grader can tell apart ------------------------------------------------------------

_RING_ONLY = (
    Mistake("a library collective instead of the ring",
            "The exercise is the ring itself: talk to the other ranks only through "
            "ring_exchange (zerolab.comm.send and recv), one chunk per step.",
            used_any_of(("all_reduce", "reduce_scatter", "all_gather", "broadcast")),
            output="comm ops"),
    Mistake("the whole tensor sent at every step",
            "Each step of the ring sends one chunk (k elements), not the whole tensor: pass "
            "ring_exchange a chunk.",
            bytes_times(lambda ev: ev.world_size), output="bytes sent"),
    Mistake("one step too many",
            "The ring needs world_size - 1 steps: after them every rank has what it needs.",
            bytes_times(lambda ev: ev.world_size / (ev.world_size - 1)), output="bytes sent"),
)


def _chunk_sum(ev: Evidence, chunk: int) -> torch.Tensor:
    """2.1's right answer for `chunk`, from every rank's inputs."""
    total = sum(ev.inputs(r)[0] for r in range(ev.world_size))
    return total.chunk(ev.world_size)[chunk % ev.world_size]


def _partial_sum(ev: Evidence) -> bool:
    """2.1's chunk `rank` summed over some of the ranks only."""
    n = ev.world_size
    mine = [ev.inputs(r)[0].chunk(n)[ev.rank] for r in range(n)]
    return any(same_value(sum(mine[r] for r in subset), ev.got)
               for size in range(1, n) for subset in itertools.combinations(range(n), size))


def _own_shard_missing(ev: Evidence) -> bool:
    k = ev.inputs()[0].numel()
    mine = ev.got.reshape(-1)[ev.rank * k:(ev.rank + 1) * k]
    return ev.got.shape == ev.expected.shape and not same_value(ev.inputs()[0], mine)


def _shards_misplaced(ev: Evidence) -> bool:
    """Every rank's shard arrived, in the wrong places."""
    def rows(t: torch.Tensor) -> list[tuple[float, ...]]:
        return sorted(tuple(c.tolist()) for c in t.reshape(ev.world_size, -1))
    return ev.got.shape == ev.expected.shape and rows(ev.got) == rows(ev.expected)


def _padded_numel(ev: Evidence) -> int:
    numel = ev.inputs()[0].numel()
    return -(-numel // ev.world_size) * ev.world_size


def _stripped_at_the_wrong_end(ev: Evidence) -> bool:
    """2.3 padded at one end and stripped at the other: the mean shifted by the padding."""
    mean = ev.expected.reshape(-1)
    zeros = torch.zeros(_padded_numel(ev) - mean.numel())
    front = torch.cat([zeros, mean])[:mean.numel()]
    back = torch.cat([mean, zeros])[zeros.numel():]
    return zeros.numel() > 0 and any(same_value(w.view(ev.expected.shape), ev.got)
                                     for w in (front, back))


EXERCISES = [
    Exercise("2.1", "ex02_collectives", "ring_reduce_scatter",
             "reduce-scatter as a ring of send/recv: N-1 steps, (N-1)/N of the bytes",
             "Each step, every rank passes the running sum of one chunk to the next rank and "
             "adds the chunk it receives into its own copy of that chunk; work on a copy of "
             "`tensor`. Choose the first chunk so that chunk r's complete sum lands on rank r "
             "at the last step.",
             _cases_2_1, distributed=True, comm_checked=True, outputs=own_memory_outputs,
             hints=("At step s, rank r sends chunk (r - s - 1) % N and adds what it receives "
                    "into chunk (r - s - 2) % N. Receive into a fresh buffer "
                    "(torch.empty_like) and add it; tensor.clone().chunk(N) gives views of one "
                    "copy.",),
             mistakes=(
                 Mistake("an average, not a sum",
                         "A reduce-scatter here sums over the ranks: do not divide by "
                         "world_size.", over_world_size),
                 Mistake("a partial sum: some ranks' contributions missing",
                         "Chunk r on rank r lacks some ranks' contributions. Add what you "
                         "receive into your copy of that chunk (do not overwrite it), and pick "
                         "the first chunk so that chunk r is the last to receive, at step N-2.",
                         _partial_sum),
                 Mistake("the ring's start off by one: another rank's chunk",
                         "Your rank ends with the complete sum of a neighbour's chunk: the "
                         "chunk each rank sends first is off by one. Count back from the "
                         "last step, where rank r must receive the last part of chunk r.",
                         any_of(matches(lambda ev: _chunk_sum(ev, ev.rank + 1)),
                                matches(lambda ev: _chunk_sum(ev, ev.rank - 1)))),
                 Mistake("the input changed",
                         "tensor.chunk() and tensor.view() share the caller's memory: adding "
                         "into them changes `tensor`. Clone it first.",
                         output="input tensor"),
                 DTYPE_LOST, *memory_mistakes("the chunk"), *_RING_ONLY),
             read_only=("tensor",)),
    Exercise("2.2", "ex02_collectives", "ring_all_gather",
             "all-gather as a ring of send/recv",
             "Put your own shard in its place first; then at each step send the shard you "
             "received last (your own at the first step) and receive the next one straight "
             "into its place in the output. Try it on paper for 3 ranks.",
             _cases_2_2, distributed=True, comm_checked=True, outputs=own_memory_outputs,
             hints=("out = torch.empty(N * k); chunks = out.chunk(N) are views into it; "
                    "chunks[rank].copy_(shard); at step s send chunk (r - s) % N and receive "
                    "into chunk (r - s - 1) % N.",),
             mistakes=(
                 Mistake("your own shard missing from its place",
                         "Rank r's own shard belongs at elements r*k to (r+1)*k of the "
                         "output: copy it there before the ring starts.", _own_shard_missing),
                 Mistake("every shard arrived, in the wrong places",
                         "The shard received at step s comes from rank (r - s - 1) % N: put "
                         "it in that rank's place, not in the next free one.",
                         _shards_misplaced),
                 DTYPE_LOST, *memory_mistakes("the gathered tensor"), *_RING_ONLY),
             read_only=("shard",)),
    Exercise("2.3", "ex02_collectives", "all_reduce_mean",
             "all-reduce = reduce-scatter + all-gather, with padding for any size",
             "Flatten, pad with zeros to world_size * ceil(numel / world_size) elements, "
             "reduce-scatter with op='avg', all-gather the shards, then strip the padding and "
             "restore the shape.",
             _cases_2_3, distributed=True, comm_checked=True, outputs=new_memory_outputs,
             hints=("With k = ceil(numel / world_size): comm.reduce_scatter(mine, padded, "
                    "op='avg', tag=..., group=group) reads padded (N*k,) and fills mine (k,); "
                    "comm.all_gather(full, mine, tag=..., group=group) fills full (N*k,); "
                    "return full[:numel].view(tensor.shape).",),
             mistakes=(
                 DTYPE_LOST,
                 Mistake("the input itself returned",
                         "Return a new tensor: at N = 1 the mean is the input's values, but "
                         "the caller's tensor is not the result (the caller may change it).",
                         lambda ev: ev.got == "a view of an input", output="memory"),
                 Mistake("a sum, not the mean (N times too big)",
                         "The mean, not the sum: pass op='avg' to the reduce-scatter.",
                         times_world_size),
                 Mistake("the padding not stripped",
                         "The padding zeros are still there: keep the first numel elements "
                         "of the gathered tensor, then give it the input's shape.",
                         padding_kept),
                 Mistake("flat, not in the input's shape",
                         "Return the input's shape: view the flat result as tensor.shape.",
                         lambda ev: ev.got.shape != ev.expected.shape and same_value(
                             ev.expected.reshape(-1), ev.got.reshape(-1))),
                 Mistake("the padding stripped at the wrong end",
                         "Pad and strip at the same end: the zeros go after the last element, "
                         "and the first numel elements are the result.",
                         _stripped_at_the_wrong_end),
                 Mistake("the padding not stripped",
                         "The gathered tensor still holds the padding: keep its first numel "
                         "elements before giving it the input's shape.",
                         lambda ev: f"input of size {_padded_numel(ev)}" in ev.got,
                         output="raised"),
                 Mistake("an all-reduce where a reduce-scatter belongs",
                         "Build it from comm.reduce_scatter then comm.all_gather: the exercise "
                         "is seeing that these two halves make an all-reduce.",
                         used_instead("all_reduce", "reduce_scatter"), output="comm ops"),
                 Mistake("more padding than needed",
                         "Pad to the smallest multiple of world_size (ceil(numel / world_size) "
                         "elements per rank): extra padding is extra bytes on the wire.",
                         lambda ev: ev.got > ev.expected and ev.got_outputs["comm ops"]
                         == ev.expected_outputs["comm ops"], output="bytes sent")),
             read_only=("tensor",)),
]
