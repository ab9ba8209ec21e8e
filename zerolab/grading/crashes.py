"""A rank that died in a native library (a signal, no Python exception): which rank, which
signal, and what usually causes that signal in these exercises.

zerolab.launch says how a rank ended in the first line of its error ("rank 1 exited with code
-6 ...", or "rank 1 was killed by SIGABRT (exit code -6) ..."); `_parse_crash` reads either.
The explanation is the grader's own: the exercise may add a hint for a signal (a Mistake
with `signal=`), for the mistake that most often causes it there.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

_RANK = re.compile(r"\brank (\d+)\b")
_CODE = re.compile(r"(?:exited with|exit) code (-\d+)")
_NAME = re.compile(r"\b(SIG[A-Z0-9]+)\b")

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
}


@dataclass(frozen=True)
class Crash:
    """How a rank ended: its rank, the signal's name and the exit code (-signal number)."""

    rank: int
    signal: str
    code: int

    @property
    def cause(self) -> str:
        return _CAUSES.get(self.signal, "a crash in native code, with no Python exception")

    def message(self, case: str | None) -> str:
        where = f" during case '{case}'" if case else ""
        return (f"rank {self.rank} was killed by {self.signal} (exit code {self.code}){where}, "
                f"inside your function: no Python exception to show. Likely cause: "
                f"{self.cause}.")


def _parse_crash(failure: str | None) -> Crash | None:
    """The crash a launch failure describes, or None (a Python exception, a timeout, ...)."""
    if not failure or failure.startswith("timeout"):
        return None
    rank, code, name = _RANK.search(failure), _CODE.search(failure), _NAME.search(failure)
    if rank is None or (code is None and name is None):
        return None
    number = -int(code[1]) if code else int(getattr(signal, name[1], 0))
    if name is None:
        try:
            signame = signal.Signals(number).name
        except ValueError:
            return None
    else:
        signame = name[1]
    return Crash(int(rank[1]), signame, -number)
