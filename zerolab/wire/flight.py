"""The flight recorder: the last collectives a rank issued, in a file that outlives the rank.

    flight.install(path, rank, world_size)   # zerolab.launch does this in every rank
    ...                                      # collectives: zerolab.comm's and torch.distributed's
    log = flight.read(path)                  # from any process, even after the rank died
    log.entries[-1].op, .seq, .state         # "all_reduce", 17, "issued"

Every collective a rank issues gets one entry: a sequence number per process group (every rank
of the group counts the same calls, so #17 on one rank must be #17 on the others), the op, the
tag where zerolab issued it, shapes, dtype, bytes, element count, reduce op, source or
destination, the group, and whether it completed. When ranks hang, comparing their entries finds
the first number at which they parted (zerolab.launcher.hangs does it for the launcher); when a
call returned although the ranks passed different things (gloo compares nothing: a SUM met by a
MAX, a float32 met by an int32 of the same size), comparing them names it too
(zerolab.launcher.fingerprints, while the ranks run).

Note: the fingerprint and its digest. What the ranks of a group must agree on for call #k is its
`Entry.fingerprint`: op, dtype, element count (where sizes must match), reduce op, and the
source or destination of a rooted call. Each entry also carries a digest: a CRC-32 of its
fingerprint chained onto the digest of the group's previous call. Equal digests at #k on two ranks
say that every call up to #k agreed, even where the ring has overwritten the older ones (a
launcher reading the files now and then can fall more than SLOTS calls behind); CRC-32 is
deterministic across processes (Python's hash() of text is not: each rank has its own seed).

Note: how it is kept cheap and readable after a crash. The entries live in a ring of SLOTS
fixed-size records in a file mapped into the rank's memory (mmap, MAP_SHARED): writing one is a
`struct.pack_into` into memory, no system call, and the kernel holds the pages, so the
file has every entry written up to the instant the rank died, even by SIGKILL or a native abort.
The launcher reads the files with plain reads while the ranks run or after they died.

What is recorded: zerolab.comm's calls, with their tags, and torch.distributed's functions
called directly (zerolab/wire/flight_torch.py wraps them). What a recorded call runs inside
(zerolab's all-gather is N broadcasts on gloo) is not recorded again: one entry per call the
user's code made.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

SLOTS = 256  # entries kept: the last 256 collectives (ranks part within a few)
MAGIC = b"ZLFLIGHT"
# magic, rank, world_size, pid, main thread, written (entries so far), activity (bumped at each
# issue, wait, completion and phase change), blocked (position of the entry the rank waits in,
# -1 if none), phase, slots
HEADER = struct.Struct("<8siiqQqqqii")
# position, seq, state, async, comparable, kind, peer, nbytes, t_issue, t_done,
# op, dtype, group name, group ranks, shape, tag, numel, digest, reduce op
SLOT = struct.Struct("<qqBBBBiqdd24s16s24s40s48s64sqI12s")
_STATE_AT = 16  # offset of `state` in a slot: a completion rewrites state and t_done only
_DONE_AT = 40  # offset of t_done
_WRITTEN_AT = 32  # offsets in the header of written, activity, blocked, phase
_ACTIVITY_AT = 40
_BLOCKED_AT = 48
_PHASE_AT = 56

ISSUED, COMPLETED, FAILED = 1, 2, 3
STATES = {ISSUED: "issued", COMPLETED: "completed", FAILED: "failed"}
COLLECTIVE, P2P = 0, 1  # kind: p2p calls (send, recv) are numbered apart, per group

# The rank's phase, written by zerolab.launch around the function it runs.
STARTING, RENDEZVOUS, RUNNING, RETURNED, RAISED = range(5)
PHASES = ("starting", "waiting for the other ranks to start", "running", "returned",
          "raised")

SWITCH = "ZEROLAB_FLIGHT_RECORDER"  # "0" in the environment: install() records nothing


@dataclass(frozen=True)
class Entry:
    """One collective as a rank recorded it."""

    pos: int  # the rank's count of entries before this one
    seq: int  # number of this call in its group (collectives and p2p counted apart), from 1
    state: str  # "issued", "completed" or "failed" (raised)
    async_op: bool  # issued with async_op=True: "issued" until waited for
    comparable: bool  # ranks must agree on nbytes (false: object collectives, uneven all-to-all)
    kind: int  # COLLECTIVE or P2P
    peer: int  # global rank: broadcast's source, reduce's and gather's root, p2p's other end
    nbytes: int  # bytes of the tensor(s) ranks must agree on (see HOOKS); 0 if none
    t_issue: float  # time.time() at issue
    t_done: float  # time.time() at completion (0 if none)
    op: str  # "all_reduce", "broadcast", ... (torch's function name, or zerolab.comm's op)
    dtype: str  # "float32", "" if none
    group: str  # the group's name (torch's group_name: the same on every rank)
    ranks: tuple[int, ...]  # the group's global ranks
    shape: str  # "(1024,)", "4 x (256,)"
    tag: str  # zerolab's tag ("zero3/fwd/blocks.2"); "" when issued through torch directly
    numel: int = 0  # elements of the tensor(s) ranks must agree on
    digest: int = 0  # CRC-32 of the fingerprints of the group's calls up to this one (collectives)
    reduce_op: str = ""  # "sum", "max", "avg", ... for a reducing call; "" otherwise

    def fingerprint(self) -> tuple[str, str, str, int, int]:
        """What every rank of the group must pass alike at this call (see the Note above):
        (op, dtype, reduce op, element count or -1 where sizes may differ, root or -1)."""
        return (self.op, self.dtype, self.reduce_op, self.numel if self.comparable else -1,
                self.peer)


def _chained(digest: int, op: bytes, dtype: bytes, reduce_op: bytes, numel: int,
             peer: int) -> int:
    """The digest of a call: its fingerprint's CRC-32, continued from the previous call's
    (the fields as `Entry.fingerprint` reads them back)."""
    return zlib.crc32(b"%s|%s|%s|%d|%d" % (op, dtype, reduce_op, numel, peer), digest)


def reduce_op_name(op: Any) -> str:
    """torch's ReduceOp (or zerolab.comm's "sum") as "sum", "max", "avg", "premul_sum"."""
    if op is None or isinstance(op, str):
        return op or ""
    name = getattr(op, "name", None) or getattr(getattr(op, "op", None), "name", None)
    return (name or str(op)).lower()


@dataclass(frozen=True)
class FlightLog:
    """What a rank's flight recorder file holds (`read`)."""

    rank: int
    world_size: int
    pid: int
    main_thread: int  # threading.main_thread().ident: names its stack in a faulthandler dump
    written: int  # entries written so far (the ring keeps the last SLOTS)
    activity: int  # changes so far: it stands still while the rank makes no collective progress
    blocked: int  # position of the entry the rank waits in now, -1 if none
    phase: str  # one of PHASES
    entries: list[Entry]  # the ring, oldest first

    def waiting_in(self) -> Entry | None:
        """The entry this rank is blocked in now (a synchronous call, or a wait()), if any."""
        return next((e for e in self.entries if e.pos == self.blocked
                     and e.state == "issued"), None)


def _text(value: str, size: int) -> bytes:
    return value.encode("utf-8", "replace")[:size]


_ENCODED: dict[tuple[str, int], bytes] = {}  # ops and tags repeat every step: encoded once


def _encoded(value: str, size: int) -> bytes:
    found = _ENCODED.get((value, size))
    if found is None:
        if len(_ENCODED) > 4096:
            _ENCODED.clear()
        found = _ENCODED[value, size] = _text(value, size)
    return found


class _Calling:
    """FlightRecorder.calling's context (a class: cheaper than a generator, per collective)."""

    __slots__ = ("rec", "pos", "blocking")

    def __init__(self, rec: FlightRecorder, pos: int, blocking: bool):
        self.rec, self.pos, self.blocking = rec, pos, blocking

    def __enter__(self) -> None:
        local = self.rec._local
        local.depth = getattr(local, "depth", 0) + 1
        if self.blocking:  # a change the launcher must see: the rank now waits in it
            with self.rec._lock:
                struct.pack_into("<q", self.rec._map, _BLOCKED_AT, self.pos)
                self.rec._bump()

    def __exit__(self, kind: type | None, value: object, tb: object) -> None:
        self.rec._local.depth -= 1
        if self.blocking:
            struct.pack_into("<q", self.rec._map, _BLOCKED_AT, -1)
        if kind is not None:
            self.rec.complete(self.pos, FAILED)


class FlightRecorder:
    """The writing end, one per rank: `issue` at a call, `complete` when it is done."""

    def __init__(self, path: str, rank: int, world_size: int, slots: int = SLOTS):
        size = HEADER.size + slots * SLOT.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.slots = path, slots
        self._written = self._activity = 0
        self._lock = threading.Lock()  # gloo's threads never write here, a user's may
        self._local = threading.local()  # .depth: calls of this thread being recorded
        # group -> [name, ranks text, [collective count, p2p count, collectives' digest]]
        self._groups: dict[Any, list] = {}
        HEADER.pack_into(self._map, 0, MAGIC, rank, world_size, os.getpid(),
                         threading.main_thread().ident or 0, 0, 0, -1, STARTING, slots)

    # --- what is recorded --------------------------------------------------------------------

    def issue(self, op: str, tensors: Any, group: Any, async_op: bool, *, tag: str = "",
              kind: int = COLLECTIVE, peer: int = -1, comparable: bool = True,
              reduce_op: str = "") -> int:
        """Record a call being issued; returns its position (for `complete`)."""
        name, ranks_text, counts = self._group(group)
        shape, dtype, nbytes, numel = _described(tensors)
        op_b, red_b = _encoded(op, 24), _encoded(reduce_op, 12)
        with self._lock:
            counts[kind] += 1
            digest = 0
            if kind == COLLECTIVE:  # p2p calls differ by design (a send meets a recv)
                digest = counts[2] = _chained(counts[2], op_b, dtype, red_b,
                                              numel if comparable else -1, peer)
            pos = self._written
            SLOT.pack_into(self._map, HEADER.size + (pos % self.slots) * SLOT.size, pos,
                           counts[kind], ISSUED, async_op, comparable, kind, peer, nbytes,
                           time.time(), 0.0, op_b, dtype, name, ranks_text,
                           shape, _encoded(tag, 64), numel, digest, red_b)
            self._written = pos + 1
            self._bump(written=True)
        return pos

    def complete(self, pos: int, state: int = COMPLETED) -> None:
        """Mark the entry at `pos` completed (or failed), if the ring still holds it."""
        offset = HEADER.size + (pos % self.slots) * SLOT.size
        with self._lock:
            if struct.unpack_from("<q", self._map, offset)[0] == pos:
                self._map[offset + _STATE_AT] = state
                struct.pack_into("<d", self._map, offset + _DONE_AT, time.time())
            self._bump()

    def set_phase(self, phase: int) -> None:
        with self._lock:
            struct.pack_into("<i", self._map, _PHASE_AT, phase)
            self._bump()

    def calling(self, pos: int, blocking: bool) -> _Calling:
        """Around the call (or the wait) of the entry at `pos`: what it calls inside is not
        recorded again, and, if `blocking`, the rank is marked as waiting in it."""
        return _Calling(self, pos, blocking)

    def inside(self) -> bool:
        """Whether this thread is inside a recorded call (whose own calls are not recorded)."""
        return getattr(self._local, "depth", 0) > 0

    def close(self) -> None:
        self._map.close()

    def _bump(self, written: bool = False) -> None:
        self._activity += 1
        if written:
            struct.pack_into("<qq", self._map, _WRITTEN_AT, self._written, self._activity)
        else:
            struct.pack_into("<q", self._map, _ACTIVITY_AT, self._activity)

    def _group(self, group: Any) -> list:
        """[name, ranks text, counts] of a process group (None: the default group), cached."""
        key = group if group is not None else dist.group.WORLD
        found = self._groups.get(key)
        if found is None:
            if key is None:  # no process group: a one-process run
                name, ranks = "", [0]
            else:
                name, ranks = key.group_name, dist.get_process_group_ranks(key)
            found = [_text(name, 24), _text(_ranks_text(ranks), 40), [0, 0, 0]]
            self._groups[key] = found
        return found


def _ranks_text(ranks: list[int]) -> str:
    """"0,2,5", or "0-15" for a run of consecutive ranks (a large world fits its 40 bytes)."""
    if len(ranks) > 2 and list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _parse_ranks(text: str) -> tuple[int, ...]:
    if "-" in text:
        first, last = text.split("-")
        return tuple(range(int(first), int(last) + 1))
    return tuple(int(r) for r in text.split(",") if r.isdigit())


_DESCRIBED: dict[tuple, tuple[bytes, bytes, int]] = {}  # (shape, dtype) -> encoded, item size


def _described(tensors: Any) -> tuple[bytes, bytes, int, int]:
    """`describe`, encoded for a slot, and the element count; a single tensor's shapes and
    dtypes are cached."""
    if isinstance(tensors, torch.Tensor):
        key = (tensors.shape, tensors.dtype)
        found = _DESCRIBED.get(key)
        if found is None:
            if len(_DESCRIBED) > 4096:
                _DESCRIBED.clear()
            shape, dtype, _ = describe(tensors)
            found = _DESCRIBED[key] = (_text(shape, 48), _text(dtype, 16),
                                       tensors.element_size())
        numel = tensors.numel()
        return found[0], found[1], numel * found[2], numel
    shape, dtype, nbytes = describe(tensors)
    numel = sum(t.numel() for t in tensors or () if isinstance(t, torch.Tensor))
    return _text(shape, 48), _text(dtype, 16), nbytes, numel


def describe(tensors: Any) -> tuple[str, str, int]:
    """(shape, dtype, nbytes) of a tensor or a list of tensors ("", "", 0 for none)."""
    if isinstance(tensors, torch.Tensor):
        return (str(tuple(tensors.shape)), str(tensors.dtype).removeprefix("torch."),
                tensors.numel() * tensors.element_size())
    tensors = [t for t in (tensors or ()) if isinstance(t, torch.Tensor)]
    if not tensors:
        return "", "", 0
    shapes = {tuple(t.shape) for t in tensors}
    shape = (f"{len(tensors)} x {shapes.pop()}" if len(shapes) == 1
             else f"{len(tensors)} tensors")
    return (shape, str(tensors[0].dtype).removeprefix("torch."),
            sum(t.numel() * t.element_size() for t in tensors))


# --- this process's recorder -------------------------------------------------------------------

# Note: the recorder is process-wide, like torch's own flight recorder for NCCL: the collectives
# to record are issued deep inside engines, torch's optimizers and the user's code, which pass
# no recorder around. zerolab.comm asks `issue` below; it costs one global read when no recorder
# is installed (outside zerolab.launch's ranks).
_recorder: FlightRecorder | None = None


def install(path: str, rank: int, world_size: int) -> FlightRecorder | None:
    """Start recording this process's collectives into `path` (None if switched off).
    zerolab.comm's calls are recorded from now on; torch.distributed's once
    zerolab.wire.flight_torch.hook() has wrapped its functions (zerolab.launch does both)."""
    global _recorder
    if os.environ.get(SWITCH, "1") == "0":
        return None
    _recorder = FlightRecorder(path, rank, world_size)
    return _recorder


def uninstall() -> None:
    """Stop recording (the file stays)."""
    global _recorder
    if _recorder is not None:
        _recorder.close()
    _recorder = None


def recorder() -> FlightRecorder | None:
    return _recorder


def issue(op: str, tag: str, tensors: Any, group: Any, async_op: bool, *, kind: int = COLLECTIVE,
          peer: int = -1, reduce_op: str = "", comparable: bool = True) -> int:
    """zerolab.comm's call: record one of its collectives; -1 when no recorder is installed.
    comparable=False: its size differs across ranks by design (an uneven all-to-all)."""
    rec = _recorder
    if rec is None:
        return -1
    return rec.issue(op, tensors, group, async_op, tag=tag, kind=kind, peer=peer,
                     reduce_op=reduce_op, comparable=comparable)


def calling(pos: int, blocking: bool) -> contextlib.AbstractContextManager:
    """Around the call or the wait of the entry `issue` returned (no-op for -1)."""
    rec = _recorder
    if rec is None or pos < 0:
        return _NOTHING
    return _Calling(rec, pos, blocking)


_NOTHING = contextlib.nullcontext()


def complete(pos: int) -> None:
    rec = _recorder
    if rec is not None and pos >= 0:
        rec.complete(pos)


def set_phase(phase: int) -> None:
    if _recorder is not None:
        _recorder.set_phase(phase)


# --- the reading end --------------------------------------------------------------------------


def read_activity(path: str) -> int | None:
    """The activity counter alone (cheap: the launcher polls it); None if there is no file."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
    except OSError:
        return None
    if len(head) < HEADER.size or head[:8] != MAGIC:
        return None
    return struct.unpack_from("<q", head, _ACTIVITY_AT)[0]


def _recorder_bytes(path: str) -> bytes | None:
    """The file at `path`, if it holds a flight recorder (its header and magic); else None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data if len(data) >= HEADER.size and data[:8] == MAGIC else None


def completed_digests(path: str) -> dict[tuple[str, tuple[int, ...]], dict[int, int]] | None:
    """(group name, its ranks) -> {call number: digest} of the completed collectives the file
    at `path` holds; None if there is none. What the launcher compares at every poll: the slots
    are unpacked in one pass and no Entry is built (a tenth of a millisecond for a full ring,
    where `read` takes milliseconds)."""
    data = _recorder_bytes(path)
    if data is None:
        return None
    header = HEADER.unpack_from(data, 0)
    written, slots = header[5], header[9]
    ring = memoryview(data)[HEADER.size:HEADER.size + slots * SLOT.size]
    if len(ring) < slots * SLOT.size:
        return None
    held: dict[tuple[str, tuple[int, ...]], dict[int, int]] = {}
    groups: dict[tuple[bytes, bytes], tuple[str, tuple[int, ...]]] = {}
    for index, row in enumerate(SLOT.iter_unpack(ring)):
        pos, seq, state, kind = row[0], row[1], row[2], row[5]
        if (pos % slots != index or not written - slots <= pos < written or kind != COLLECTIVE
                or state != COMPLETED):
            continue  # not written yet, a leftover of another turn of the ring, or not asked
        key = groups.get((row[12], row[13]))
        if key is None:
            key = groups[row[12], row[13]] = (_str(row[12]), _parse_ranks(_str(row[13])))
        held.setdefault(key, {})[seq] = row[17]
    return held


def read(path: str) -> FlightLog | None:
    """Everything the file at `path` holds; None if there is none (the rank never started)."""
    data = _recorder_bytes(path)
    if data is None:
        return None
    (_, rank, world_size, pid, main_thread, written, activity, blocked, phase,
     slots) = HEADER.unpack_from(data, 0)
    entries = []
    for pos in range(max(0, written - slots), written):
        offset = HEADER.size + (pos % slots) * SLOT.size
        if offset + SLOT.size > len(data):
            break
        fields = SLOT.unpack_from(data, offset)
        if fields[0] != pos:  # overwritten since (a torn read of a running rank): skip it
            continue
        (_, seq, state, async_op, comparable, kind, peer, nbytes, t_issue, t_done, op, dtype,
         group, ranks, shape, tag, numel, digest, reduce_op) = fields
        entries.append(Entry(
            pos, seq, STATES.get(state, "issued"), bool(async_op), bool(comparable), kind,
            peer, nbytes, t_issue, t_done, _str(op), _str(dtype), _str(group),
            _parse_ranks(_str(ranks)), _str(shape), _str(tag), numel, digest,
            _str(reduce_op)))
    return FlightLog(rank, world_size, pid, main_thread, written, activity, blocked,
                     PHASES[phase] if 0 <= phase < len(PHASES) else "running", entries)


def _str(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")
