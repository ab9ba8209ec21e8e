"""What an exercise is: its Case inputs, its Exercise entry, and how its outputs are named.

Each notebook's exercises are listed in their own module (cases_01 ... cases_07), built from
these; registry gathers them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zerolab.grading.compare import _describe


class BadReturn(Exception):
    """The learner's function returned something of the wrong kind (not a tuple, ...)."""


@dataclass(frozen=True)
class Case:
    """One input of an exercise: `make(rank)` builds fresh arguments (before rank, world_size,
    group for a distributed exercise); it is called once for the solution, once for the
    learner, so that neither sees what the other changed in place."""

    label: str
    make: Callable[[int], tuple]


def _result(result: Any, args: tuple) -> dict[str, Any]:
    return {"result": result}


@dataclass(frozen=True)
class Exercise:
    id: str  # "2.1": notebook 02, first exercise
    module: str  # file name without .py, in solutions/ and exercises/
    function: str
    teaches: str  # one line
    hint: str  # shown when the answer is wrong
    cases: Callable[..., list[Case]]  # distributed: cases(world_size); plain: cases()
    distributed: bool = False
    outputs: Callable[[Any, tuple], dict[str, Any]] = _result  # (result, args) -> named outputs
    comm_checked: bool = False  # also compare the zerolab.comm ops called and bytes sent

    @property
    def notebook(self) -> str:
        return self.module[2:4]  # "ex03_zero1" -> "03"


def _tuple_outputs(*names: str) -> Callable[[Any, tuple], dict[str, Any]]:
    def outputs(result: Any, args: tuple) -> dict[str, Any]:
        if not isinstance(result, (tuple, list)) or len(result) != len(names):
            raise BadReturn(f"expected a tuple ({', '.join(names)}), got {_describe(result)}")
        return dict(zip(names, result))
    return outputs
