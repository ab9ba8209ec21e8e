"""Whether the ranks passed the same thing to each call, from their flight recorders.

    describe(entry)                 # "all_reduce #17 (ddp/bwd/bucket3, 400 KiB float32, ...)"
    same(a, b)                      # two ranks' entries at one call number: the same call?
    what_differs(op, seq, at)       # "the ranks called all_reduce with different reduce ops ..."
    silent_mismatch(logs)           # a call that returned although the ranks disagreed
    can_meet(e, rank, peer_log)     # a send or recv: does its peer have the other end open?

gloo checks nothing the ranks pass to a collective but what it needs to move the bytes. A
mismatch then shows in one of three ways, and each is named with both ranks, the call number
and what differs:

- the call never completes (a broadcast whose source differs between ranks; two ranks that
  both receive first): a hang, certain once nothing moved for hangs.SETTLE_S (hangs.deadlocked
  asks `same` and `can_meet`), explained by `what_differs` (and hangs.unmet_p2p);
- a rank aborts (sizes that differ): a failure, explained likewise;
- the call returns on every rank with a wrong result (a SUM met by a MAX; a float32 met by an
  int32 of the same size, whose bits each rank reads as its own type): nothing stops or fails.
  `silent_mismatch` finds it in the records; the launcher asks at every poll (local.POLL_S),
  the last one after every rank has returned, and the launch raises CollectiveMismatch. The
  ranks pay only for a digest in each record (flight.py); the launcher reads the digests alone
  (`agree`) unless they disagree.

Note: what is torch's and what is written here. TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every gloo
group in torch's ProcessGroupWrapper, which, before each collective, runs a monitored barrier
and all-gathers the call's fingerprint (torch's own sequence number from 0, op type, shapes,
dtypes, devices) over a helper group, and raises on the ranks where they differ ("Detected
mismatch between collectives on ranks..."): a dtype or shape mismatch is named before the call
runs, so no wrong result is ever seen. Its fingerprint has no reduce op and no root, and
send/recv pass unchecked. Those extra calls cost (measured: a 1 KiB all-reduce between 2 ranks
took 0.8 ms plain and 2.5 ms wrapped, on 2 shared cores), so zerolab.launch leaves it off; a
caller who sets the variable gets it in every rank (local._worker reads it again: the zygote
imported torch before), and the launcher's report adds its own call number and verdict.
Written here by hand, for what torch's check lacks: reduce ops, sources and destinations, a
receive met by a receive, and, with no collective added, every mismatch of a call that returned.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolab.wire import flight
from zerolab.wire.flight import Entry, FlightLog


def describe(e: Entry, world_size: int = 0) -> str:
    """'all_reduce #17 (ddp/bwd/bucket3, 400 KiB float32, shape (102400,))'."""
    details = [e.tag] if e.tag else []
    if e.nbytes or e.dtype:
        details.append(f"{size_text(e.nbytes)} {e.dtype}".strip())
    if e.shape:
        details.append(f"shape {e.shape}")
    if e.async_op:
        details.append("async")
    where = ""
    if e.kind == flight.P2P:
        direction = "from" if "recv" in e.op else "to"
        head = f"{e.op} {direction} rank {e.peer}" if e.peer >= 0 else e.op
        details.insert(0, f"p2p #{e.seq}")
    else:
        head = f"{e.op} #{e.seq}"
        if e.peer >= 0:
            details.append(("from" if e.op.startswith(("broadcast", "scatter")) else "to")
                           + f" rank {e.peer}")
    if e.ranks and world_size and e.ranks != tuple(range(world_size)):
        where = f" in group {list(e.ranks)}"
    return f"{head}{where}" + (f" ({', '.join(details)})" if details else "")


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{nbytes} B"


# What a fingerprint's fields are called in a verdict, in Entry.fingerprint's order (the root:
# a broadcast's or a scatter's source, a reduce's or a gather's destination).
_FIELDS = ("collectives", "dtypes", "reduce ops", "sizes", "sources")


def same(a: Entry, b: Entry) -> bool:
    """Whether two ranks' entries at one call number are the same call (sizes are compared only
    where both must match: not for object collectives or an uneven all-to-all)."""
    fa, fb = a.fingerprint(), b.fingerprint()
    if not (a.comparable and b.comparable):
        fa, fb = fa[:3] + fa[4:], fb[:3] + fb[4:]
    return fa == fb


def _per_rank(values: dict[int, str]) -> str:
    """{0: "sum", 1: "max", 2: "sum"} -> "sum on ranks 0, 2, max on rank 1"."""
    by_value: dict[str, list[int]] = {}
    for rank, value in values.items():
        by_value.setdefault(value, []).append(rank)
    return ", ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} "
                     f"{', '.join(map(str, ranks))}" for value, ranks in by_value.items())


def _root(e: Entry) -> str:
    if e.peer < 0:
        return "no root"
    return ("from" if e.op.startswith(("broadcast", "scatter")) else "to") + f" rank {e.peer}"


def what_differs(op: str, seq: int, at: dict[int, Entry]) -> str:
    """The verdict for one call number whose entries (rank -> entry, all present, of one op)
    differ: 'the ranks called all_reduce with different reduce ops at #1 (sum on rank 0, ...)'.
    The sizes' verdict is the one notebook 00 shows (its outputs are compared)."""
    prints = {m: e.fingerprint() for m, e in at.items()}
    differing = [i for i in range(1, len(_FIELDS))
                 if len({p[i] for p in prints.values()}) > 1]
    if differing == [3] or not differing:
        return (f"the ranks called {op} with different sizes at #{seq} (tensors of different "
                f"sizes, or the same calls in different orders: iterating a set or a dict "
                f"whose order differs per rank?)")
    shown = {1: lambda e: e.dtype or "no tensor", 2: lambda e: e.reduce_op or "none",
             3: lambda e: f"{e.numel} elements", 4: _root}
    details = "; ".join(_per_rank({m: shown[i](e) for m, e in at.items()}) for i in differing)
    fields = [_FIELDS[i] if i != 4 or op.startswith(("broadcast", "scatter")) else
              "destinations" for i in differing]
    verdict = f"the ranks called {op} with different {' and '.join(fields)} at #{seq} ({details})"
    returned = all(e.state == "completed" for e in at.values())
    if differing == [1] and returned and len({e.nbytes for e in at.values()}) == 1:
        verdict += (": the same bytes, so gloo moved them and each rank read the others' bits "
                    "as its own type")
    elif 2 in differing and returned:
        verdict += ": each rank reduced its share of the tensor with its own op, so the result " \
                   "mixes them"
    elif differing == [4]:
        verdict += ": each rank follows its own root, so the data goes nowhere it is awaited"
    return verdict


# --- calls that returned although the ranks disagreed -----------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """The first call of a group whose ranks passed different things, though it completed."""

    group: str
    seq: int  # the call number: where the ranks' records first differ
    at: dict[int, Entry]  # rank -> its entry at `seq` (two ranks that disagree)
    exact: bool  # False: the first difference is older still, in calls no longer held


def silent_mismatch(logs: dict[int, FlightLog]) -> Mismatch | None:
    """The first call, completed on every rank of its group, whose fingerprints differ between
    two ranks; None if every such call agrees. logs: rank -> its flight recorder.

    Only the newest call completed everywhere is compared first: equal digests there say that
    every call before agreed (flight.py's Note), so a launch that agrees costs one comparison
    per group and rank. Otherwise the first held call whose digests differ is the one named."""
    held: dict[tuple[str, tuple[int, ...]], dict[int, dict[int, Entry]]] = {}
    for rank, log in logs.items():
        for e in log.entries:
            if e.kind == flight.COLLECTIVE and e.state == "completed":
                held.setdefault((e.group, e.ranks), {}).setdefault(rank, {})[e.seq] = e
    for (group, members), by_rank in held.items():
        if any(m not in by_rank for m in members):
            continue  # a member has completed nothing held in it yet
        seqs = sorted(set.intersection(*(set(by_rank[m]) for m in members)))
        if not seqs or _agree(by_rank, members, seqs[-1]):
            continue
        first = next(s for s in seqs if not _agree(by_rank, members, s))
        a = members[0]
        b = next(m for m in members if by_rank[m][first].digest != by_rank[a][first].digest)
        earlier = first - 1
        exact = first == 1 or (earlier in seqs and _agree(by_rank, members, earlier))
        return Mismatch(group, first, {a: by_rank[a][first], b: by_rank[b][first]}, exact)
    return None


def agree(held: dict[int, dict[tuple[str, tuple[int, ...]], dict[int, int]]]) -> bool:
    """Whether every group's ranks agree up to the newest call completed on all of them, from
    their digests alone (rank -> flight.completed_digests): the launcher's check at every poll,
    cheap; `silent_mismatch` then names what differs."""
    groups = {key for by_group in held.values() for key in by_group}
    for key in groups:
        members = key[1]
        if any(key not in held.get(m, {}) for m in members):
            continue
        common = set.intersection(*(set(held[m][key]) for m in members))
        if common and len({held[m][key][max(common)] for m in members}) > 1:
            return False
    return True


def _agree(by_rank: dict[int, dict[int, Entry]], members: tuple[int, ...], seq: int) -> bool:
    return len({by_rank[m][seq].digest for m in members}) == 1


def mismatch_text(m: Mismatch) -> str:
    """The headline of a launch stopped for `m`, naming both ranks, the call and what differs."""
    (a, ea), (b, eb) = m.at.items()
    if not m.exact and same(ea, eb):
        return (f"ranks {a} and {b} passed different things to a collective of group "
                f"{list(ea.ranks)} before #{m.seq}, in calls their flight recorders no longer "
                f"hold (each keeps its last {flight.SLOTS}): the digests of their calls differ "
                f"from #{m.seq} on. The calls returned without an error (gloo compares nothing "
                f"the ranks pass), their results wrong; the launch was stopped.")
    verdict = (what_differs(ea.op, m.seq, m.at) if ea.op == eb.op
               else f"the ranks called different collectives at #{m.seq}")
    earlier = "" if m.exact else " (or earlier, in calls no longer held)"
    return (f"ranks {a} and {b} disagree at {ea.op} #{m.seq}{earlier}, which returned on both "
            f"without an error (gloo compares nothing the ranks pass), so its result is wrong: "
            f"{verdict}. The launch was stopped.")


# --- point to point ---------------------------------------------------------------------------


def receives(e: Entry) -> bool:
    """Whether a p2p entry receives (recv, irecv, recv_object_list) rather than sends."""
    return "recv" in e.op


def can_meet(e: Entry, rank: int, peer_log: FlightLog | None) -> bool:
    """Whether the p2p call `e` that `rank` waits in can still be met by its peer, which also
    waits (hangs.deadlocked asks only then): only if the peer has a call of the other direction
    open towards `rank` (or one whose other end it did not name)."""
    if e.peer < 0 or peer_log is None:
        return True  # an unnamed peer (batch_isend_irecv): unknown, so assume it can
    for f in peer_log.entries:
        if f.kind == flight.P2P and f.state == "issued" and (f.peer in (rank, -1)) and (
                f.peer == -1 or receives(f) != receives(e)):
            return True
    return False
