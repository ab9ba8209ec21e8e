"""How a learner's process ended early, said for the learner: a timeout, an exit, a signal,
a flood of output, a record of the run the grader did not write. Each is a wrong answer (the
grader stopped or lost the process: session.py), never a pass, and the message says what
happened, where, and its likely cause.

For a rank killed by a signal the grader also reads what every rank was issuing (flight.py):
where the ranks' collectives parted (different sizes, or another order), or a receive buffer of
another dtype than what was sent, which is what makes gloo abort a process. An exercise may add
its own explanation of a signal (a Mistake with `signal=`, and a test on the case).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from zerolab.grading import defaults, flight
from zerolab.grading.defaults import FILE_LIMIT, OUTPUT_LIMIT
from zerolab.grading.mistakes import (
    COLLECTIVES_DIFFER,
    COLLECTIVES_REORDERED,
    DTYPES_MIXED,
    Evidence,
    Mistake,
)
from zerolab.grading.session import Stop

# What a signal most often means when a rank runs a learner's tensor code on gloo.
_CAUSES = {
    "SIGABRT": "a native library (gloo, torch's C++ code) stopped the process on an error: "
               "most often a collective called with different sizes on different ranks "
               "(e.g. an uneven all-gather: every rank must pass the same number of "
               "elements), or ranks calling different collectives at the same point",
    "SIGSEGV": "memory read or written after it was freed: a tensor whose storage was "
               "resized to 0 bytes (or a view of it) used afterwards",
    "SIGBUS": "memory read or written after it was freed or unmapped (a freed storage?)",
    "SIGKILL": "killed from outside, most often because the machine ran out of memory (a "
               "tensor far bigger than intended?)",
    "SIGFPE": "an arithmetic error in native code (an integer division by zero?)",
    "SIGXFSZ": f"a file bigger than {FILE_LIMIT >> 20} MiB written: past the grader's "
               f"file-size limit",
    "SIGXCPU": "more CPU time used than the grader's CPU-time limit per case allows (threads "
               "spinning, or a loop that never ends)",
}


@dataclass(frozen=True)
class Explained:
    """What to tell the learner about a run that stopped: the message, the kind of mistake
    when it is known, whether it was a timeout."""

    message: str
    mistake: Mistake | None = None
    timed_out: bool = False
    printed: str = ""  # the head of what the process printed


def _where(stop: Stop) -> str:
    if stop.case == "import":
        return "while importing your file"
    return f"during case '{stop.label}'" if stop.label else ""


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def explain(stop: Stop, timeout: float, mistakes: tuple[Mistake, ...],
            flights: list[list[dict]], evidence: Evidence | None,
            distributed: bool = True) -> Explained:
    """The message for a run that stopped while this task ran (see the module docstring)."""
    where = _where(stop)
    if stop.how == "timeout":
        if not distributed:
            return Explained(f"timed out after {timeout:g} s {where}: an endless loop? "
                             "(stopped by the grader)", timed_out=True)
        stuck = f"rank(s) {stop.stuck} never finished: " if stop.stuck else ""
        return Explained(f"timed out after {timeout:g} s {where}: {stuck}an endless loop, or "
                         "a rank waiting for a message no other rank sends? (stopped by the "
                         "grader)", timed_out=True)
    if stop.how == "output":
        return Explained(f"printed more than {OUTPUT_LIMIT >> 20} MiB {where}: the grader "
                         f"stopped the process (output capped).", printed=stop.output)
    if stop.how == "malformed":
        return Explained(f"your code wrote into the grader's record of the run {where}: the "
                         f"line {stop.output!r} is not one the grader writes, so nothing after "
                         f"it can be trusted (stopped by the grader).",
                         Mistake("the grader's files written", "Leave the grader's files (the "
                                 "run's folder, the files your process holds open) alone: "
                                 "your answer returns its results, the grader records them."))
    if stop.how == "exited":
        how = ("os._exit()? " if stop.code == 0 else "")
        return Explained(f"your code ended the process (exit status {stop.code}) {where}: "
                         f"{how}the grader runs your code in a process of its own, and an exit "
                         f"is a wrong answer, not a pass.", printed=stop.output)
    name = _signal_name(stop.code or 0)
    message = (f"rank {stop.rank} was killed by {name} (exit code {stop.code}) {where}, inside "
               f"your code: no Python exception to show.")
    mistake = None
    difference = flight.first_difference(flights, finished=False) if flights else None
    if difference is not None:
        message += " " + difference.describe() + "."
        mistake = COLLECTIVES_REORDERED if difference.tags_differ else None
    elif len(flight.dtypes(flights)) > 1:
        message += f" The ranks moved {' and '.join(flight.dtypes(flights))} data."
        mistake = DTYPES_MIXED
    if mistake is None and evidence is not None:
        mistake = next((m for m in mistakes if m.signal == name
                        and (m.test is None or _holds(m, evidence))), None)
    if mistake is None and difference is not None:
        mistake = COLLECTIVES_DIFFER
    cause = _CAUSES.get(name, "a crash in native code")
    if name == "SIGXCPU":
        cause += f": {defaults.CPU_LIMIT} s"
    return Explained(f"{message} Likely cause: {cause}.",
                     mistake, printed=stop.output)


def _holds(mistake: Mistake, evidence: Evidence) -> bool:
    try:
        return bool(mistake.test(evidence))
    except Exception:
        return False
