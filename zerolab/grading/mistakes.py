"""Telling mistakes apart: when an output differs, which known kind of mistake explains it.

A `Mistake` is a kind ("a sum, not an average"), the hint for that kind, and a test that
looks at the `Evidence` of one failed comparison: the output that differed, expected against
got, and the case's inputs on any rank (cases are seeded by rank, so every rank can rebuild
every other rank's inputs). The first mistake of an exercise whose test says yes gives the
hint; when none does, the grader falls back to the exercise's general hint.

The builders below make the usual tests: the result N times too big or too small, the answer
a known wrong formula gives (`matches`), the padding kept or put at the wrong end, one
collective used where another belongs, more bytes sent than the algorithm needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerolab.grading.compare import compare_values
from zerolab.grading.data import Freed


@dataclass
class Evidence:
    """What the grader saw when one output differed (on one rank, in one case)."""

    output: str  # the output that differed: "result", "comm ops", "input tensor", "raised"
    expected: Any
    got: Any
    expected_outputs: dict[str, Any]
    got_outputs: dict[str, Any]
    rank: int
    world_size: int
    make: Callable[[int], tuple]  # the case's inputs, fresh, for any rank
    solution: Callable | None = None  # plain exercises: the solution, to try other inputs
    case: str = ""  # the case's label

    def inputs(self, rank: int | None = None) -> tuple:
        """Fresh inputs of this case on `rank` (default: this rank)."""
        return self.make(self.rank if rank is None else rank)


Test = Callable[[Evidence], bool]


@dataclass(frozen=True)
class Mistake:
    """A kind of mistake the grader can recognise, and what to say about it.

    output: the output whose difference this explains ("" for any output; "raised" for an
    exception, whose message is then `got`; "input NAME" for an argument the function
    changed, where no test is needed). signal: instead, the signal that killed a rank
    ("SIGABRT", ...), for a crash in a native library.
    """

    kind: str
    hint: str
    test: Test | None = None
    output: str = "result"
    signal: str = ""


def diagnose(mistakes: tuple[Mistake, ...], evidence: Evidence) -> Mistake | None:
    """The first mistake that explains the evidence (a test that raises explains nothing).
    A tensor of another dtype than expected is that, whatever else differs: its values would
    mislead the other tests. Outputs whose storage was freed are not looked into."""
    if not _all_readable(evidence.got_outputs):
        return None
    if evidence.output != "raised" and _safe(dtype_lost, evidence):
        return DTYPE_LOST
    for mistake in mistakes:
        if mistake.signal or mistake.test is None:
            continue
        if mistake.output and mistake.output != evidence.output:
            continue
        try:
            if mistake.test(evidence):
                return mistake
        except Exception:  # the learner's output was too odd for this test: not this mistake
            continue
    return None


def _all_readable(value: Any) -> bool:
    if isinstance(value, Freed):
        return False
    if isinstance(value, dict):
        return all(_all_readable(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_all_readable(v) for v in value)
    return True


def same_value(a: Any, b: Any) -> bool:
    return compare_values(a, b) is None


# ---- builders of tests ------------------------------------------------------------------------


def matches(wrong: Callable[[Evidence], Any]) -> Test:
    """The learner's output equals what a known wrong answer gives on the same inputs."""
    def test(ev: Evidence) -> bool:
        value = wrong(ev)
        return not same_value(ev.expected, value) and same_value(value, ev.got)
    return test


def any_of(*tests: Test) -> Test:
    return lambda ev: any(_safe(test, ev) for test in tests)


def _safe(test: Test, ev: Evidence) -> bool:
    try:
        return bool(test(ev))
    except Exception:
        return False


def solution_with(replace: Callable[[tuple], dict[int, Any]]) -> Callable[[Evidence], Any]:
    """What the solution returns (a plain exercise) on the case's inputs with some arguments
    replaced: `replace(args)` gives {position: new value} (another rank, another stage)."""
    def wrong(ev: Evidence) -> Any:
        args = list(ev.inputs())
        for position, value in replace(tuple(args)).items():
            args[position] = value
        return ev.solution(*args)
    return wrong


def neighbour_rank(position: int) -> Test:
    """A plain exercise whose arguments hold (..., rank, world_size, ...) at `position`: the
    answer for rank r+1 or r-1 (mod world_size) instead of rank r."""
    return any_of(*(matches(solution_with(
        lambda args, d=d: {position: (args[position] + d) % args[position + 1]}))
        for d in (1, -1)))


def scaled(factor: Callable[[Evidence], float]) -> Test:
    """got = expected * factor (tensors, numbers, or lists and dicts of them)."""
    def test(ev: Evidence) -> bool:
        f = factor(ev)
        return f != 1 and same_value(_scale(ev.expected, f), ev.got)
    return test


def _scale(value: Any, factor: float) -> Any:
    if isinstance(value, dict):
        return {k: _scale(v, factor) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scale(v, factor) for v in value]
    if isinstance(value, torch.Tensor):
        return value * factor
    return float(value) * factor


times_world_size = scaled(lambda ev: ev.world_size)
over_world_size = scaled(lambda ev: 1 / ev.world_size)


def padding_kept(ev: Evidence) -> bool:
    """A tensor with more elements than expected, which starts with the expected ones."""
    got, expected = ev.got, ev.expected
    if not isinstance(got, torch.Tensor) or got.numel() <= expected.numel():
        return False
    return same_value(expected.reshape(-1), got.reshape(-1)[:expected.numel()])


def used_instead(wrong_op: str, right_op: str) -> Test:
    """The comm log: `wrong_op` called where the solution calls `right_op`."""
    return lambda ev: (right_op in ev.expected and wrong_op in ev.got
                       and right_op not in ev.got)


def used_any_of(ops: tuple[str, ...]) -> Test:
    """The comm log: a collective the solution does not call (e.g. a library collective
    where the exercise builds its own from send and recv)."""
    return lambda ev: any(op in ev.got and op not in ev.expected for op in ops)


def bytes_times(factor: Callable[[Evidence], float]) -> Test:
    """The comm log: the ops are right but `factor` times the bytes were sent."""
    def test(ev: Evidence) -> bool:
        same_ops = ev.got_outputs.get("comm ops") == ev.expected_outputs.get("comm ops")
        return same_ops and ev.expected > 0 and ev.got == ev.expected * factor(ev)
    return test


def numel_is(numel: Callable[[Evidence], int]) -> Test:
    """A tensor result of the wrong size, exactly `numel` elements (e.g. floor, not ceil)."""
    def test(ev: Evidence) -> bool:
        want = numel(ev)
        return (isinstance(ev.got, torch.Tensor) and ev.got.numel() == want
                and ev.expected.numel() != want)
    return test


def element(test: Test, index: Callable[[Evidence], int | str]) -> Test:
    """Apply `test` to one item of a list or dict output (the item that differed first)."""
    def item_test(ev: Evidence) -> bool:
        i = index(ev)
        return test(dataclasses.replace(ev, expected=ev.expected[i], got=ev.got[i]))
    return item_test


def first_difference(ev: Evidence) -> int | str:
    """The index (or key) of the first item of a list or dict output that differs."""
    keys = list(ev.expected) if isinstance(ev.expected, dict) else range(len(ev.expected))
    return next(k for k in keys if not same_value(ev.expected[k], ev.got[k]))


def cut(flat: torch.Tensor, shapes: list[torch.Size], padding_in_front: bool = False,
        offsets_move: bool = True) -> list[torch.Tensor]:
    """Tensors of `shapes` cut from a flat buffer, the right way (the padding at its end, each
    tensor starting where the last ended) or one of two wrong ways."""
    numels = [torch.Size(s).numel() for s in shapes]
    offset = flat.numel() - sum(numels) if padding_in_front else 0
    out = []
    for shape, numel in zip(shapes, numels):
        out.append(flat[offset:offset + numel].view(shape))
        offset += numel if offsets_move else 0
    return out


def _dtypes(value: Any) -> list[str]:
    if isinstance(value, torch.Tensor | Freed):
        return [str(value.dtype)]
    items = value.values() if isinstance(value, dict) else value
    return [d for v in items for d in _dtypes(v)] if isinstance(value, (dict, list, tuple)) \
        else []


def dtype_lost(ev: Evidence) -> bool:
    """Tensors (alone, or in lists and dicts) of another dtype than expected."""
    return _dtypes(ev.expected) != _dtypes(ev.got)


DTYPE_LOST = Mistake("the dtype lost",
                     "Keep the input's dtype: torch.empty and torch.zeros make float32 unless "
                     "you pass dtype= (or use torch.empty_like, new_zeros).", dtype_lost,
                     output="")
NON_CONTIGUOUS_VIEW = Mistake(
    ".view() of a non-contiguous tensor",
    "An input may be a non-contiguous view (a transpose, a strided slice): .view() needs "
    "contiguous memory. Use .reshape() or .flatten(), which copy when they must.",
    lambda ev: "view size is not compatible" in ev.got, output="raised")
DTYPES_MIXED = Mistake(
    "data sent and received in different dtypes",
    "A receive buffer must have the dtype of what is sent into it: torch.empty and torch.zeros "
    "make float32 unless you pass dtype= (torch.empty_like keeps the dtype).",
    output="collectives")
COLLECTIVES_REORDERED = Mistake(
    "the ranks issued their collectives in different orders",
    "Every rank must issue the same collectives in the same order. Processes started one by "
    "one (torchrun) hash strings differently, so a set of names (or anything built from one) "
    "is iterated in a different order on each rank: iterate a list or a dict, or sorted(...).",
    output="collectives")
COLLECTIVES_DIFFER = Mistake(
    "the ranks issued different collectives",
    "Every rank must issue the same collectives, of the same sizes, in the same order: a "
    "collective's size may not depend on the rank's own data (pad to a common size first).",
    output="collectives")


def memory_mistakes(what: str) -> tuple[Mistake, Mistake]:
    """The two ways an output that must be a copy of its own goes wrong (exercise.memory_of):
    a view of an input, and a view into a bigger buffer."""
    return (
        Mistake(f"{what}: a view of an input, not a copy",
                "Return memory of your own (.clone()): a view of an input (or the input "
                "itself, a shortcut at N = 1) changes when the input does, and keeps all of "
                "it alive.",
                lambda ev: ev.got == "a view of an input", output="memory"),
        Mistake(f"{what}: a view into a bigger buffer",
                "Return exactly your elements, in memory of their own (.clone() the slice): a "
                "view keeps the whole buffer it was cut from alive, which is the memory that "
                "sharding is meant to save.",
                lambda ev: ev.got.startswith("a view into"), output="memory"))


def input_changed_hint(name: str) -> str:
    """The hint for an input the function changed although the contract says it must not."""
    return (f"Your function changed `{name}`, which the contract says to leave unchanged: an "
            f"in-place operation (add_, copy_, +=, x[...] = ...) on it or on a view of it "
            f"(chunk, view, reshape, slicing all share its memory). Work on a copy.")
