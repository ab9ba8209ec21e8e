"""What actually runs underneath zerolab's collectives, backend by backend.

A lesson says "all-gather"; on gloo zerolab runs something else that gives the same result
faster, and every recorded event says which (`CommEvent.impl`), so that the measured bytes
belong to what ran:

- all-gather on gloo: N async broadcasts, rank r's shard straight into chunk r of everyone's
  output. torch's gloo all-gather goes through a temporary flat buffer and a copy out, and takes
  several times as long. Bytes: gloo's broadcast is a binomial tree, and over the N broadcasts
  every rank takes every position in the tree once, so each rank sends (N-1) shards: the ring
  all-gather's (N-1)/N·S exactly.
- reduce-scatter on gloo: gloo has none of its own (torch's gloo reduce-scatter all-reduces a
  copy of the input and keeps one chunk: an all-reduce's 2(N-1)/N·S bytes, twice the ring
  reduce-scatter's). zerolab sends each chunk straight to the rank that owns it instead: rank r
  sends chunk j to rank j and receives chunk r from each other rank (N-1 send/recv pairs, all
  in flight at once), then adds what it received to its own chunk. Bytes: (N-1)/N·S, the ring
  figure exactly; measured, it takes about half the time and CPU of the all-reduce. A MAX or
  MIN reduce-scatter still all-reduces (and so does one rank alone, which sends nothing).
- all-to-all (ZeRO++'s qgZ): torch's own on gloo too (`all_to_all_single`): it sends chunk j
  straight to rank j, (N-1)/N·S per rank (measured: that, plus ~150 bytes of gloo's own per
  peer), and was faster than the same exchange as N-1 send/recv pairs when timed here.
- everything else, and every op on NCCL: torch's own collective.

Each public collective in zerolab.comm asks this module once for a `Plan` and runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single and warns on the old names; torch 2.6 only has the old ones.
torch_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

LOCAL = "local (one process, no group)"


@dataclass(frozen=True)
class Plan:
    """How one collective runs: a description, a byte model, and the call that issues it."""

    impl: str  # recorded on the event: "all_gather as 3 broadcasts (gloo)"
    ring_factor: float  # what runs sends this many times the op's ring figure (gloo's rs: 2)
    call: Callable[[], object]  # issues it; returns a waitable work (async) or None (done)


def native(op: str, group: dist.ProcessGroup | None, call: Callable[[], object]) -> Plan:
    """torch's own collective, as it is."""
    if not dist.is_initialized():
        return Plan(LOCAL, 1.0, lambda: None)
    return Plan(f"{op} ({dist.get_backend(group)})", 1.0, call)


def writes_through_os(group: dist.ProcessGroup | None) -> bool:
    """Whether this group's traffic is written with write(2), so that wire.written counts it.

    gloo's TCP transport is; NCCL moves bytes by DMA over NVLink or InfiniBand, which no process
    counter sees. Without a process group nothing is sent, which counts as a measured 0.
    """
    return not dist.is_initialized() or dist.get_backend(group) == "gloo"


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def _copy_locally(output: torch.Tensor, input: torch.Tensor) -> None:
    output.view(-1).copy_(input.view(-1))  # one rank: its shard is the whole tensor


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
               async_op: bool) -> Plan:
    """input: (k,) on every rank; output: (world_size * k,)."""
    if not dist.is_initialized():
        return Plan(LOCAL, 1.0, lambda: _copy_locally(output, input))
    if _is_gloo(group):
        n = dist.get_world_size(group)
        broadcasts = "1 broadcast" if n == 1 else f"{n} broadcasts"
        return Plan(f"all_gather as {broadcasts} (gloo)", 1.0,
                    lambda: _all_gather_by_broadcasts(output, input, group, async_op))
    return Plan(f"all_gather ({dist.get_backend(group)})", 1.0,
                lambda: torch_all_gather(output, input, group=group, async_op=async_op))


def all_to_all(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
               async_op: bool, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None) -> Plan:
    """input, output: (world_size, ...) or (world_size * k,), contiguous; chunk j of input goes
    to rank j, chunk i of output comes from rank i (of the split sizes' lengths, if given)."""
    if not dist.is_initialized():
        return Plan(LOCAL, 1.0, lambda: _copy_locally(output, input))
    return Plan(f"all_to_all ({dist.get_backend(group)})", 1.0,
                lambda: dist.all_to_all_single(output, input, output_split_sizes,
                                               input_split_sizes, group=group,
                                               async_op=async_op))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, red: dist.ReduceOp,
                   group: dist.ProcessGroup | None, async_op: bool,
                   scratch_input: bool) -> Plan:
    """input: (world_size * k,) on every rank; output: (k,), this rank's chunk of the reduction."""
    if not dist.is_initialized():
        return Plan(LOCAL, 1.0, lambda: _copy_locally(output, input))
    n = dist.get_world_size(group)
    if _is_gloo(group) and red == dist.ReduceOp.SUM and n > 1:
        pairs = "1 send/recv pair" if n == 2 else f"{n - 1} send/recv pairs"
        return Plan(f"reduce_scatter as {pairs} (gloo)", 1.0,
                    lambda: _reduce_scatter_by_sends(output, input, group, async_op))
    if _is_gloo(group):
        return Plan("reduce_scatter as all_reduce (gloo)", 2.0,
                    lambda: _reduce_scatter_by_all_reduce(output, input, red, group, async_op,
                                                          scratch_input))
    return Plan(f"reduce_scatter ({dist.get_backend(group)})", 1.0,
                lambda: torch_reduce_scatter(output, input, op=red, group=group,
                                               async_op=async_op))


# ---- gloo: reduce-scatter and all-gather from its fast collectives -----------------------------


class Joined:
    """Several collectives in flight as one: wait() waits for each, then runs `then` once."""

    def __init__(self, works: list, then: Callable[[], object] | None = None):
        self._works = works
        self._then = then

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._then is not None:
            self._then()
            self._then = None
        return True


def _finish_or_return(works: Joined, async_op: bool) -> Joined | None:
    if async_op:
        return works
    works.wait()
    return None


def _reduce_scatter_by_all_reduce(output: torch.Tensor, input: torch.Tensor, red, group,
                                  async_op: bool, scratch_input: bool) -> Joined | None:
    rank, k = dist.get_rank(group), output.numel()
    buffer = input if scratch_input else input.clone()  # (world_size * k,)
    work = dist.all_reduce(buffer, op=red, group=group, async_op=True)
    own = buffer.view(-1)[rank * k:(rank + 1) * k]  # (k,)
    return _finish_or_return(Joined([work], lambda: output.view(-1).copy_(own)), async_op)


# gloo matches point-to-point messages by (peer, tag) in the order they are posted, and every
# rank issues its collectives in the same order: one tag of zerolab's own keeps these apart
# from a lesson's hand-written sends (tag 0) without numbering each call.
_REDUCE_SCATTER_TAG = 0x7A5C


def _reduce_scatter_by_sends(output: torch.Tensor, input: torch.Tensor, group,
                             async_op: bool) -> Joined | None:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    chunks = input.view(n, -1)  # (world_size, k): chunk j is rank j's to reduce
    out = output.view(-1)  # (k,)
    # ZeRO-1 reduces in place: its output is its own chunk of the input. Otherwise the first
    # peer's chunk lands in the output itself, and only the others need scratch rows.
    in_place = out.data_ptr() == chunks[rank].data_ptr()
    if not in_place and out.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
        raise ValueError("reduce_scatter: the output shares memory with the input but is not "
                         "this rank's own chunk of it; the chunks sent to other ranks would be "
                         "overwritten. Pass this rank's chunk (input[rank * k:(rank + 1) * k]) "
                         "or a tensor of its own.")
    # Peers in the order rank + 1, rank + 2, ...: every rank starts with a different peer, so
    # that the sends of one moment go to N different ranks rather than all to rank 0.
    peers = [(rank + i) % n for i in range(1, n)]
    scratch = torch.empty(len(peers) - (0 if in_place else 1), out.numel(),
                          dtype=out.dtype, device=out.device)  # (n - 1 or n - 2, k)
    landing = list(scratch) if in_place else [out, *scratch]
    works = []
    for peer, into in zip(peers, landing):
        global_peer = peer if group is None else dist.get_global_rank(group, peer)
        works.append(dist.isend(chunks[peer], global_peer, group=group, tag=_REDUCE_SCATTER_TAG))
        works.append(dist.irecv(into, global_peer, group=group, tag=_REDUCE_SCATTER_TAG))

    def add() -> None:
        if not in_place:
            out.add_(chunks[rank])
        for row in scratch:
            out.add_(row)

    return _finish_or_return(Joined(works, add), async_op)


def _all_gather_by_broadcasts(output: torch.Tensor, input: torch.Tensor, group,
                              async_op: bool) -> Joined | None:
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    k = input.numel()
    chunks = [output.view(-1)[r * k:(r + 1) * k] for r in range(world_size)]  # N x (k,)
    chunks[rank].copy_(input.view(-1))
    # broadcast's src is a global rank; r is this group's rank r
    works = [dist.broadcast(chunk, r if group is None else dist.get_global_rank(group, r),
                            group=group, async_op=True)
             for r, chunk in enumerate(chunks)]
    return _finish_or_return(Joined(works), async_op)
