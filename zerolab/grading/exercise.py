"""What an exercise is: its Case inputs, its Exercise entry, and how its outputs are named.

Each notebook's exercises are listed in their own module (cases_01 ... cases_07), built from
these; registry gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerolab.grading.compare import describe_value
from zerolab.grading.mistakes import Mistake
from zerolab.grading.storage import shares_memory

KINDS = ("plain", "ranks", "engine")  # in this process; on spawned ranks; a whole engine


class BadReturn(Exception):
    """The learner's function returned something of the wrong kind (not a tuple, ...)."""


class Args(tuple):
    """A case's arguments (a tuple), and what the grader keeps aside to measure after the call
    (`kept`: e.g. the views autograd saved, which the function never sees)."""

    kept: dict[str, Any]

    def __new__(cls, args: tuple, **kept: Any) -> Args:
        self = super().__new__(cls, args)
        self.kept = kept
        return self


@dataclass(frozen=True)
class Case:
    """One input of an exercise: `make(rank)` builds fresh arguments (before rank, world_size,
    group for a distributed exercise); it is called once for the solution, once for the
    learner, so that neither sees what the other changed in place. It must build the same
    arguments for the same rank every time: the grader rebuilds other ranks' inputs from it
    to tell mistakes apart."""

    label: str
    make: Callable[[int], tuple]


def result_data(result: Any, args: tuple) -> dict[str, Any]:
    return {"result": result}


@dataclass(frozen=True)
class Exercise:
    """One exercise: which function, its cases, what is compared, and what to say when wrong.

    Hints come in levels (zerolab.grading.hint): the stub's own "Hint:" paragraph, then
    `hint` (also what the grader says when it cannot tell the kind of mistake), then `hints`.
    `mistakes` are the kinds of mistakes the grader recognises, each with its own hint.
    `read_only` names the arguments the contract says to leave unchanged: the grader
    compares them before and after every call.
    """

    id: str  # "2.1": notebook 02, first exercise
    module: str  # file name without .py, in solutions/ and exercises/
    function: str
    teaches: str  # one line
    hint: str  # shown when the answer is wrong and no known mistake explains it
    cases: Callable[..., list[Case]]  # distributed: cases(world_size); plain: cases()
    distributed: bool = False
    outputs: Callable[[Any, tuple], dict[str, Any]] = result_data  # (result, args) -> named outputs
    comm_checked: bool = False  # also compare the zerolab.comm ops called and bytes sent
    stage: str = ""  # an engine exercise: the stage it builds ("ddp", "zero2", "zero3")
    hints: tuple[str, ...] = ()  # further hint levels, after `hint`
    mistakes: tuple[Mistake, ...] = ()
    read_only: tuple[str, ...] = ()  # argument names checked unchanged after every call
    kind: str = ""  # one of KINDS; default: "ranks" if distributed else "plain"

    def __post_init__(self) -> None:
        if not self.kind:
            object.__setattr__(self, "kind", "ranks" if self.distributed else "plain")
        if self.kind not in KINDS:
            raise ValueError(f"exercise {self.id}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def notebook(self) -> str:
        return self.module[2:4]  # "ex03_zero1" -> "03"


def tuple_outputs(*names: str) -> Callable[[Any, tuple], dict[str, Any]]:
    def outputs(result: Any, args: tuple) -> dict[str, Any]:
        if not isinstance(result, (tuple, list)) or len(result) != len(names):
            raise BadReturn(f"expected a tuple ({', '.join(names)}), got {describe_value(result)}")
        return dict(zip(names, result))
    return outputs


def memory_of(result: Any, inputs: list[Any]) -> str:
    """Where a returned tensor's memory lives, as the grader sees it: "a view of an input",
    "a view into a buffer of B bytes (its elements: E)", or "its own, E bytes"."""
    if not isinstance(result, torch.Tensor):
        return "not a tensor"
    if shares_memory(result, inputs):
        return "a view of an input"
    storage, mine = result.untyped_storage().nbytes(), result.numel() * result.element_size()
    if storage > mine:
        return f"a view into a buffer of {storage} bytes (its elements: {mine})"
    return f"its own, {mine} bytes"


def own_memory_outputs(result: Any, args: tuple) -> dict[str, Any]:
    """The result, and the memory behind it (memory_of): a copy of exactly its elements."""
    return {"result": result, "memory": memory_of(result, [args[0]])}


def new_memory_outputs(result: Any, args: tuple) -> dict[str, Any]:
    """The result, and whether it lives in the input's memory (a view, or the input itself:
    at N = 1 a shortcut can return it), or in memory of its own (a bigger buffer is fine)."""
    memory = memory_of(result, [args[0]])
    return {"result": result, "memory": memory if memory == "a view of an input"
            else "not the input's memory"}
