"""When ranks hang or die: whether they still make progress, where each one is, and the first
collective at which they parted.

    watch = Watch(workdir, pids)        # the launcher polls it while the ranks run
    watch.poll(); watch.idle_s()        # seconds since any rank last made progress
    states = rank_states(...)           # each rank: running / returned / raised / died, its log
    deadlocked(states)                  # no rank can ever go on
    explain(states, fn_name)            # where each rank is, and where their collectives differ

Everything is read from files the ranks write as they go (their flight recorders, logs, stack
dumps: zerolab.wire.flight), so it works on ranks that are stuck, or dead.

Note: what counts as progress. A rank makes progress when it issues or completes a collective
(its flight recorder's activity counter moves), prints, returns, or uses the CPU (more than
CPU_BUSY of a core: computing, even for minutes, between collectives). A hung job does none of
these: every rank sleeps in a wait (gloo waits without spinning: 0.0 s of CPU a second,
measured). The launch's `timeout` is the time without progress after which the ranks are
stopped, not a limit on the whole run. Before that, a deadlock is recognised as soon as it is
certain: every rank waits in a collective or has returned, nothing moved for SETTLE_S, and no
call waited in can complete: no collective has all its group's ranks in it with the same
fingerprint (op, dtype, size, reduce op, root: zerolab.launcher.fingerprints), no send or recv
has its peer in a call of the other direction towards it (two ranks that both receive first).

On GPUs (NCCL) a collective returns to Python before it completes, and a rank waiting for one
(in a later synchronisation) may spin a core: neither test sees that hang, and NCCL's own
watchdog ends it at the group's timeout. The records still say where the ranks parted.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import re
import signal
import time
from dataclasses import dataclass

from zerolab.launcher import fingerprints
from zerolab.launcher.fingerprints import describe
from zerolab.wire import flight
from zerolab.wire.flight import Entry, FlightLog

CPU_BUSY = 0.05  # a rank using more than this share of a core is computing: progress
SETTLE_S = 1.0  # nothing moved for this long: the ranks' records are taken as their state
STACK_SIGNAL = signal.SIGUSR1  # a rank dumps its Python stacks (faulthandler) on this signal


def rank_file(workdir: str, kind: str, rank: int) -> str:
    """A rank's file in its launch's folder: log, error, result, flight, stack."""
    return os.path.join(workdir, f"{kind}-{rank}")


# --- progress ------------------------------------------------------------------------------------


class Watch:
    """Progress of a launch's ranks: `poll()` now and then; `idle_s()` since the last progress
    of any kind, `still_s()` since the last change in the ranks' collectives."""

    def __init__(self, workdir: str, pids: list[int]):
        self.workdir, self.pids = workdir, pids
        self.last_progress = self.last_change = time.monotonic()
        self._seen: tuple | None = None
        self._other: tuple | None = None
        self._cpu = [_tree_cpu_s(pid) for pid in pids]
        self._polled = self.last_progress

    def poll(self) -> None:
        now = time.monotonic()
        ranks = range(len(self.pids))
        seen = (tuple(flight.read_activity(rank_file(self.workdir, "flight", r)) for r in ranks),
                tuple(os.path.exists(rank_file(self.workdir, "result", r)) for r in ranks))
        other = tuple(_size(rank_file(self.workdir, "log", r)) for r in ranks)
        cpu = [_tree_cpu_s(pid) for pid in self.pids]
        busy = any(b - a > CPU_BUSY * (now - self._polled) for a, b in zip(self._cpu, cpu))
        if seen != self._seen:
            self.last_change = now
        if seen != self._seen or other != self._other or busy:
            self.last_progress = now
        self._seen, self._other, self._cpu, self._polled = seen, other, cpu, now

    def idle_s(self) -> float:
        return time.monotonic() - self.last_progress

    def still_s(self) -> float:
        """Seconds since a rank last issued or completed a collective, or returned (a thread
        that prints or computes beside a rank blocked in a collective does not unblock it)."""
        return time.monotonic() - self.last_change


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds used by `pid` and its descendants alive now (0 where /proc is missing)."""
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError, IndexError):
            continue
    return total


# --- each rank's state ---------------------------------------------------------------------------


@dataclass
class RankState:
    """What the launcher knows of one rank when it explains a failure or a hang."""

    rank: int
    status: str  # "running", "returned" (waiting for the others at the end), "raised", "died"
    log: FlightLog | None  # its flight recorder (None: it never got that far)
    detail: str = ""  # raised: the exception's last line; died: "killed by SIGABRT", ...
    where: str = ""  # where its main thread is, from a stack dump: "hang_on (x.py:39)"

    def waiting_in(self) -> Entry | None:
        return self.log.waiting_in() if self.log and self.status == "running" else None

    def last(self) -> Entry | None:
        return self.log.entries[-1] if self.log and self.log.entries else None


def rank_states(workdir: str, exitcodes: list[int | None],
                wheres: dict[int, str]) -> list[RankState]:
    """Every rank's state; exitcodes: None for a rank still running."""
    states = []
    for rank, code in enumerate(exitcodes):
        log = flight.read(rank_file(workdir, "flight", rank))
        error = _read(rank_file(workdir, "error", rank)).strip()
        returned = os.path.exists(rank_file(workdir, "result", rank))
        if error:  # gloo's own messages start with its source file: "[.../pair.cc:537] "
            status, detail = "raised", _clip(re.sub(r"\[[^\]]*\.cc:\d+\] ", "",
                                                     error.splitlines()[-1]))
        elif returned:
            status, detail = "returned", ""
        elif code is None:
            status, detail = "running", ""
        else:
            status, detail = "died", _exit_text(code)
        states.append(RankState(rank, status, log, detail, wheres.get(rank, "")))
    return states


def _clip(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


# --- stacks ------------------------------------------------------------------------------------


def dump_stacks(workdir: str, pids: dict[int, int], wait_s: float = 1.0) -> dict[int, str]:
    """Ask running ranks (rank -> pid) for their Python stacks; return where each main thread
    is, outside torch and zerolab's plumbing: "hang_on (tests/workers/launch.py:39)"."""
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACK_SIGNAL)
    deadline = time.monotonic() + wait_s
    wheres: dict[int, str] = {}
    while time.monotonic() < deadline and len(wheres) < len(pids):
        time.sleep(0.05)
        for rank in pids:
            if rank not in wheres:
                log = flight.read(rank_file(workdir, "flight", rank))
                where = where_in_stack(_read(rank_file(workdir, "stack", rank)),
                                       log.main_thread if log else 0)
                if where:
                    wheres[rank] = where
    return wheres


_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.M)
_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (.+)$', re.M)
# Frames that say nothing of where the user's code is: torch's, and zerolab's plumbing.
_PLUMBING = (os.sep + "torch" + os.sep, os.path.join("zerolab", "launcher"),
             os.path.join("zerolab", "wire"), os.path.join("zerolab", "comm.py"),
             os.sep + "threading.py", os.sep + "multiprocessing" + os.sep)


def where_in_stack(dump: str, main_thread: int) -> str:
    """The innermost frame of the main thread outside the plumbing, from a faulthandler dump."""
    blocks = _THREAD.split(dump)  # ["", id, frames, id, frames, ...]
    frames = ""
    for ident, body in zip(blocks[1::2], blocks[2::2]):
        if int(ident, 16) == main_thread or not main_thread:
            frames = body
    for path, line, function in _FRAME.findall(frames):
        if not any(part in path for part in _PLUMBING):
            source = linecache.getline(path, int(line)).strip()
            return (f"{function.strip()} ({_short(path)}:{line}"
                    + (f": `{_clip(source, 60)}`)" if source else ")"))
    return ""


def _short(path: str) -> str:
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            return relative
    return path


# --- the verdict -------------------------------------------------------------------------------


def _at(log: FlightLog | None, group: str, seq: int) -> Entry | None:
    if log is None:
        return None
    return next((e for e in reversed(log.entries) if e.kind == flight.COLLECTIVE
                 and e.group == group and e.seq == seq), None)


def deadlocked(states: list[RankState]) -> bool:
    """Certain that no rank can ever go on: every rank waits in a collective or has returned,
    at least one waits, and no collective waited in can complete (see the module's Note)."""
    if any(s.status in ("raised", "died") for s in states):
        return False  # a failure: reported as such
    waits = {s.rank: s.waiting_in() for s in states if s.status == "running"}
    if not waits or any(e is None for e in waits.values()):
        return False  # someone may still be computing
    return not any(_can_complete(e, rank, states) for rank, e in waits.items()
                   if e is not None)


def _can_complete(e: Entry, rank: int, states: list[RankState]) -> bool:
    """Whether the call `rank` waits in can complete, all ranks waiting: a collective, if
    every rank of its group waits in the same call (same fingerprint); a send or recv, if its
    peer has the other direction open towards it."""
    if e.kind == flight.P2P:
        if e.peer < 0 or e.peer >= len(states):
            return True  # unknown: assume it can
        peer = states[e.peer]
        return peer.status == "running" and fingerprints.can_meet(e, rank, peer.log)
    for member in e.ranks:
        if member >= len(states) or states[member].log is None:
            return True  # unknown: assume it can
        other = _at(states[member].log, e.group, e.seq)
        if other is None or not fingerprints.same(e, other):
            return False
    return True


def rank_line(s: RankState, fn_name: str, world_size: int) -> str:
    """Where one rank is: 'rank 0 waits in all_reduce #3 (...), called from f (x.py:9)'."""
    last = s.last()
    after = f"; its last collective: {describe(last, world_size)}, {last.state}" if last else \
        "; it issued no collective"
    if s.status == "returned":
        return (f"rank {s.rank} returned from {fn_name}"
                + (f" after {describe(last, world_size)}" if last else
                   " without issuing a collective"))
    if s.status in ("raised", "died"):
        what = "raised " + s.detail if s.status == "raised" else "died, " + s.detail
        if last is not None and last.state != "completed":
            return f"rank {s.rank} {what}, in {describe(last, world_size)}"
        return f"rank {s.rank} {what}" + after
    waiting = s.waiting_in()
    if waiting is not None:
        return (f"rank {s.rank} waits in {describe(waiting, world_size)}"
                + (f", called from {s.where}" if s.where else ""))
    if s.log is not None and s.log.phase == flight.PHASES[flight.RENDEZVOUS]:
        return f"rank {s.rank} waits for the other ranks to start"
    return (f"rank {s.rank} is not in a collective"
            + (f": it is in {s.where}" if s.where else "") + after)


def first_difference(states: list[RankState], fn_name: str) -> list[str]:
    """For each group whose ranks' records disagree: a sentence naming the first sequence
    number at which they do, each rank's call there, and what that means."""
    world_size = len(states)
    groups: dict[str, tuple[int, ...]] = {}
    for s in states:
        for e in s.log.entries if s.log else ():
            if e.kind == flight.COLLECTIVE:
                groups.setdefault(e.group, e.ranks)
    sentences = []
    for group, members in groups.items():
        logs = {m: states[m].log for m in members
                if m < world_size and states[m].log is not None}
        if len(logs) < 2:
            continue
        seqs = {m: {e.seq: e for e in log.entries
                    if e.kind == flight.COLLECTIVE and e.group == group}
                for m, log in logs.items()}
        start = 1  # every rank's ring still holds the group's calls from here on
        for m, log in logs.items():
            if log.written > len(log.entries):
                start = max(start, min(seqs[m], default=1 << 62))
        end = max((max(s, default=0) for s in seqs.values()), default=0)
        for seq in range(start, end + 1):
            at = {m: seqs[m].get(seq) for m in logs}
            present = [e for e in at.values() if e is not None]
            if len(present) == len(at) and all(fingerprints.same(present[0], e)
                                               for e in present):
                continue
            sentences.append(_difference(group, seq, at, states, fn_name, world_size))
            break
        else:  # every call held agrees: the digests say whether older ones did
            newest = min((max(s, default=0) for s in seqs.values()), default=0)
            digests = {seqs[m][newest].digest for m in logs if newest in seqs[m]}
            if len(digests) > 1:
                sentences.append(
                    f"The ranks' collectives{_of_group(list(logs), world_size)} differ before "
                    f"#{max(start, 1)}, in calls their flight recorders no longer hold (each "
                    f"keeps its last {flight.SLOTS}): the digests of their calls differ at "
                    f"#{newest}.")
    return sentences


def _of_group(members: list[int], world_size: int) -> str:
    return "" if tuple(sorted(members)) == tuple(range(world_size)) else \
        f" of group {sorted(members)}"


def _difference(group: str, seq: int, at: dict[int, Entry | None], states: list[RankState],
                fn_name: str, world_size: int) -> str:
    present = {m: e for m, e in at.items() if e is not None}
    missing = [m for m, e in at.items() if e is None]
    parts = []
    for m, e in present.items():
        s = states[m]
        verb = ("waits in" if s.waiting_in() is e else
                "died in" if s.status == "died" and e.state != "completed" else
                "failed in" if e.state == "failed" else
                "called" if e.state == "completed" else "issued")
        parts.append(f"rank {m} {verb} {describe(e, world_size)}")
    for m in missing:
        parts.append(f"rank {m} never issued #{seq}: " + _why_missing(states[m], fn_name,
                                                                      world_size))
    example = next(iter(present.values()), None)
    ops = {e.op for e in present.values()}
    if len(ops) > 1:
        verdict = f"the ranks called different collectives at #{seq}"
    elif missing and example is not None:
        verdict = _missing_verdict(missing, states, f"{example.op} #{seq}")
    else:
        verdict = fingerprints.what_differs(example.op, seq, present)
    return (f"The ranks' collectives{_of_group(list(at), world_size)} first differ at #{seq}: "
            + "; ".join(parts) + f": {verdict}.")


def _missing_verdict(missing: list[int], states: list[RankState], call: str) -> str:
    """'rank 1 skipped all_reduce #3 (...)', or why the missing ranks did not get there."""
    by_status: dict[str, list[int]] = {}
    for m in missing:
        by_status.setdefault(states[m].status, []).append(m)
    said = []
    for status, ranks in by_status.items():
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        said.append(
            f"{who} skipped {call} (or the others called one too many)" if status == "returned"
            else f"{who} {status} before {call}" if status in ("raised", "died")
            else f"{who} never got to {call}")
    return "; ".join(said)


def _why_missing(s: RankState, fn_name: str, world_size: int) -> str:
    last = s.last()
    after = f" after {describe(last, world_size)}" if last else ""
    if s.status == "returned":
        return f"it returned from {fn_name}{after}"
    if s.status in ("raised", "died"):
        return f"it {'raised' if s.status == 'raised' else 'died'} first ({s.detail})"
    waiting = s.waiting_in()
    if waiting is not None:
        return f"it waits in {describe(waiting, world_size)}"
    return "it is busy elsewhere" + (f", in {s.where}" if s.where else "") + after


def unmet_p2p(states: list[RankState], fn_name: str) -> list[str]:
    """For each rank waiting in a send or recv whose peer waits elsewhere or has returned: a
    sentence ('a receive met by a receive' for two ranks that both receive first)."""
    world_size = len(states)
    sentences = []
    for s in states:
        e = s.waiting_in()
        if e is None or e.kind != flight.P2P or not 0 <= e.peer < world_size:
            continue
        peer = states[e.peer]
        other = peer.waiting_in()
        if peer.status not in ("running", "returned") or (
                peer.status == "running" and (other is None or fingerprints.can_meet(
                    e, s.rank, peer.log))):
            continue  # it may yet meet it, or its failure is the story
        if (other is not None and other.kind == flight.P2P and other.peer == s.rank
                and fingerprints.receives(other) == fingerprints.receives(e)):
            if s.rank < e.peer:  # said once, for both
                sentences.append(_crossing(s.rank, e, e.peer, other, world_size))
            continue
        where = (f"waits in {describe(other, world_size)}" if other is not None
                 else f"returned from {fn_name}")
        sentences.append(f"Rank {s.rank} waits in {describe(e, world_size)}, which rank "
                         f"{e.peer} does not meet: it {where}.")
    return sentences


def _crossing(a: int, ea: Entry, b: int, eb: Entry, world_size: int) -> str:
    if fingerprints.receives(ea):
        what = ("a receive met by a receive: each rank waits for the other to send first, so "
                "neither ever sends. One of them must send first (or both post isend and irecv, "
                "then wait for both)")
    else:
        what = ("a send met by a send: each rank waits for the other to receive, which neither "
                "does while it sends. One of them must receive first (or both post isend and "
                "irecv, then wait for both)")
    return (f"The ranks' point-to-point calls cross: rank {a} waits in {describe(ea, world_size)}"
            f" and rank {b} in {describe(eb, world_size)}: {what}.")


def explain(states: list[RankState], fn_name: str) -> str:
    """Where each rank is, then where the ranks' collectives first differ (if they do)."""
    world_size = len(states)
    lines = ["Where each rank was (from its flight recorder):"]
    lines += ["  " + rank_line(s, fn_name, world_size) for s in states]
    differences = first_difference(states, fn_name) + unmet_p2p(states, fn_name)
    if differences:
        lines += differences
    elif any(s.log and s.log.entries for s in states):
        lines.append("The ranks' recorded collectives agree, call for call, as far as each got.")
    return "\n".join(lines)
