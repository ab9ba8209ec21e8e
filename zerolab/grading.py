"""The exercises' grader, and the generator of exercises/ from solutions/.

In a notebook cell:

    from zerolab.grading import grade
    grade("ex03")                     # your exercises/ex03_zero1.py, checked against the solution
    grade("ex03", path="my_copy")     # a copy of exercises/ of your own

From a shell: `python -m zerolab.grade [NAME ...] [--path FOLDER]` (exit status 1 if any
exercise is wrong). NAME is a file (ex03, ex03_zero1), an exercise id (3.1) or a function name;
`--list` lists the exercises.

How an exercise is graded: the learner's function and the solution run on the same inputs
(several cases: uneven sizes, sizes smaller than the world size, the seeds' examples) and
their outputs are compared. A distributed exercise runs on ranks spawned by zerolab.launch, on
1, 2 and 3 ranks, one launch per world size for all the distributed exercises being graded;
each rank compares its own outputs, and also which zerolab.comm collectives were called and
the bytes they sent. Each exercise gets a fresh process group, and a rank that raises stops
its exercise on every rank (they agree through a file store), so one exercise cannot spoil
the next. A case that runs longer than `timeout` (a rank waiting for a message that never
comes) is stopped by a watchdog in the rank, and the launch's own timeout is the backstop.
Plain exercises run in this process.

Verdicts: passed / not attempted (the stub's NotImplementedError) / wrong, with where (world
size, rank, case), what (which output: expected against got, shape and max error), the
learner's own traceback lines when it raised, and a hint.

The generator: `python -m zerolab.grade --make-exercises` rewrites exercises/ from solutions/,
replacing each `# BEGIN SOLUTION` ... `# END SOLUTION` block with
`raise NotImplementedError("Exercise N.M: <task>")`, the task being the first line of the
function's docstring. `--check-exercises` exits 1 when exercises/ and solutions/ differ.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import importlib.util
import json
import math
import numbers
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.launch import LaunchError, LaunchTimeout, launch
from zerolab.sharding import FlatLayout, flatten, shard

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS_DIR = REPO / "solutions"
EXERCISES_DIR = REPO / "exercises"

DEFAULT_TIMEOUT = 30.0  # seconds one case may run on the ranks before it counts as hung
DEFAULT_WORLD_SIZES = (1, 2, 3)
GRACE = 2.0  # seconds a rank that raised waits for the others before ending the launch
STARTUP_ALLOWANCE = 120.0  # the launch's backstop timeout: this + timeout per exercise

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


# ---- the exercises ------------------------------------------------------------------------------


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


def _gen(*key: Any) -> torch.Generator:
    """A generator seeded from `key`, the same in every process (unlike hash())."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _ints(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Small integers as floats: sums are exact in any order, so rings and trees agree."""
    return torch.randint(-9, 10, shape, generator=gen).float()


def _fixed(*args: Any) -> Callable[[int], tuple]:
    return lambda rank: args


def _tuple_outputs(*names: str) -> Callable[[Any, tuple], dict[str, Any]]:
    def outputs(result: Any, args: tuple) -> dict[str, Any]:
        if not isinstance(result, (tuple, list)) or len(result) != len(names):
            raise BadReturn(f"expected a tuple ({', '.join(names)}), got {_describe(result)}")
        return dict(zip(names, result))
    return outputs


# Groups of tensor shapes: uneven (numel 10: padded on 3 and 4 ranks; 11: on 2, 3 and 4) and
# tiny (numel 1: fewer elements than ranks, so some shards are all padding).
SHAPE_GROUPS = {
    "numels 6, 3, 1": [(6,), (3,), (1,)],
    "shapes (2, 3), (5,)": [(2, 3), (5,)],
    "one element": [(1,)],
}


def _cases_1_1() -> list[Case]:
    cases = []
    for num_params in (7e9, 1001):
        for p, g, k in ((4, 4, 8), (2, 2, 12)):
            for n in (1, 8, 64):
                for stage in STAGES:
                    cases.append(Case(f"Ψ={num_params:g}, N={n}, {stage}, bytes per parameter "
                                      f"(param, grad, optimizer)=({p}, {g}, {k})",
                                      _fixed(num_params, n, stage, p, g, k)))
    return cases


def _cases_1_2() -> list[Case]:
    def views(rank: int) -> tuple:
        flat = torch.zeros(12)
        return ([flat, *flat.view(3, 4)],)

    def tied(rank: int) -> tuple:
        weight, bias = torch.zeros(5, 4), torch.zeros(4)
        return ([weight, bias, weight],)

    def small_slice(rank: int) -> tuple:
        return ([torch.zeros(100)[10:12]],)

    def freed(rank: int) -> tuple:
        t = torch.zeros(8)
        t.untyped_storage().resize_(0)
        return ([t, torch.zeros(3, dtype=torch.float64)],)

    def zero1_like(rank: int) -> tuple:
        flat = torch.zeros(10)
        params = [flat[:6].view(2, 3), flat[6:9], flat[9:]]
        grads = [torch.zeros(2, 3), torch.zeros(3), torch.zeros(1)]
        return ([*params, *grads, params[0]],)

    def dtypes(rank: int) -> tuple:
        return ([torch.zeros(4, dtype=torch.float16), torch.zeros(4, dtype=torch.int64),
                 torch.zeros(2, 2)],)

    return [Case("a (12,) buffer and three row views of it", views),
            Case("a tied weight listed twice", tied),
            Case("a (2,) slice of a (100,) tensor", small_slice),
            Case("a freed storage and a float64 tensor", freed),
            Case("parameters as views of one flat buffer, gradients apart", zero1_like),
            Case("float16, int64 and float32 tensors", dtypes)]


def _cases_2_1(n: int) -> list[Case]:
    def seeds(rank: int) -> tuple:
        base = torch.tensor([1.0, 2.0]) * (rank + 1)
        return (torch.cat([base ** (j + 1) for j in range(n)]),)

    cases = [Case("the seeds' example: chunk j of rank r is [(r+1)*1, (r+1)*2] ** (j+1)", seeds)]
    for k in (1, 3):
        cases.append(Case(f"random integers, {n} chunks of {k}",
                          lambda rank, k=k: (_ints(_gen("2.1", k, rank), n * k),)))
    return cases


def _cases_2_2(n: int) -> list[Case]:
    return [Case(f"shards of {k}",
                 lambda rank, k=k: (torch.randn(k, generator=_gen("2.2", k, rank)),))
            for k in (1, 2, 5)]


def _cases_2_3(n: int) -> list[Case]:
    return [Case(f"shape {shape}", lambda rank, s=shape: (_ints(_gen("2.3", s, rank), *s),))
            for shape in ((1,), (5, 3), (2 * n,), (2, 3, 4))]


def _tensors(key: Any, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    gen = _gen(*key)
    return [torch.randn(s, generator=gen) for s in shapes]


def _cases_3_1() -> list[Case]:
    return [Case(f"{name}, world_size {n}, rank {r}",
                 lambda rank, name=name, s=shapes, r=r, n=n: (_tensors(("3.1", name), s), r, n))
            for name, shapes in SHAPE_GROUPS.items() for n in (1, 2, 3, 4) for r in range(n)]


def _shards(tensors: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    layout = FlatLayout.of(tensors, n)
    flat = flatten(tensors, layout)
    return [shard(flat, layout, r).clone() for r in range(n)]


def _cases_3_2() -> list[Case]:
    def make(name: str, n: int) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]
        return lambda rank: (_shards(_tensors(("3.2", name), shapes), n),
                             [torch.Size(s) for s in shapes])
    return [Case(f"{name}, world_size {n}", make(name, n))
            for name in SHAPE_GROUPS for n in (1, 2, 3, 4)]


def _cases_3_3(n: int) -> list[Case]:
    def make(name: str) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]

        def args(rank: int) -> tuple:
            params = _tensors(("3.3", name), shapes)  # the same on every rank
            grads = [_ints(_gen("3.3", name, rank, i), *s) for i, s in enumerate(shapes)]
            momentum = _ints(_gen("3.3", name, rank), FlatLayout.of(params, n).shard_numel)
            return params, grads, momentum, 0.1, 0.9
        return args
    return [Case(name, make(name)) for name in SHAPE_GROUPS]


def _cases_4_1(n: int) -> list[Case]:
    def make(name: str) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]

        def args(rank: int) -> tuple:
            params = [nn.Parameter(t) for t in _tensors(("4.1", name), shapes)]
            for i, p in enumerate(params):
                p.grad = _ints(_gen("4.1", name, rank, i), *p.shape)
            grad_shard = _ints(_gen("4.1", name, rank), FlatLayout.of(params, n).shard_numel)
            return params, grad_shard
        return args
    return [Case(f"{name}, grad_shard already holding a micro-batch", make(name))
            for name in SHAPE_GROUPS]


def _outputs_4_1(result: Any, args: tuple) -> dict[str, Any]:
    params, grad_shard = args
    return {"grad_shard": grad_shard, "freed .grad": [p.grad is None for p in params]}


def _cases_5_1(n: int) -> list[Case]:
    def make(name: str) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]
        return lambda rank: (_shards(_tensors(("5.1", name), shapes), n)[rank],
                             [torch.Size(s) for s in shapes])
    return [Case(name, make(name)) for name in SHAPE_GROUPS]


def _cases_5_2() -> list[Case]:
    def make(name: str, n: int) -> Callable[[int], tuple]:
        def args(rank: int) -> tuple:
            tensors = _tensors(("5.2", name), SHAPE_GROUPS[name])
            layout = FlatLayout.of(tensors, n)
            flat = flatten(tensors, layout)
            views = [flat[o:o + t.numel()].view(t.shape) for o, t in zip(layout.offsets, tensors)]
            return [nn.Parameter(v) for v in views], flat
        return args
    return [Case(f"{name}, world_size {n}", make(name, n)) for name in SHAPE_GROUPS for n in (1, 3)]


def _outputs_5_2(result: Any, args: tuple) -> dict[str, Any]:
    params, flat_param = args
    return {"flat_param's storage bytes": flat_param.untyped_storage().nbytes(),
            "params' numel": [p.numel() for p in params],
            "params' dtype": [str(p.dtype) for p in params]}


def _dim0_rows(rows: int, rank: int, n: int) -> tuple[int, int]:
    per_rank = -(-rows // n)
    start = min(rank * per_rank, rows)
    return start, min(start + per_rank, rows)


def _cases_6_1() -> list[Case]:
    shapes = ((10, 3), (2, 4), (7,), (1,), (6, 2))
    return [Case(f"shape {s}, world_size {n}, rank {r}",
                 lambda rank, s=s, r=r, n=n: (torch.randn(s, generator=_gen("6.1", s)), r, n))
            for s in shapes for n in (1, 2, 3, 4) for r in range(n)]


def _cases_6_2(n: int) -> list[Case]:
    models = {
        "a small model": {"embed.weight": (10, 3), "norm.weight": (7,), "head.bias": (2,),
                          "gain": (1,)},
        "one (5, 2, 2) parameter": {"conv.weight": (5, 2, 2)},
    }

    def make(name: str) -> Callable[[int], tuple]:
        def args(rank: int) -> tuple:
            full = {k: torch.randn(s, generator=_gen("6.2", name, k))
                    for k, s in models[name].items()}
            shards = {k: t[slice(*_dim0_rows(len(t), rank, n))].clone() for k, t in full.items()}
            return shards, {k: len(t) for k, t in full.items()}
        return args
    return [Case(name, make(name)) for name in models]


def _cases_7_1() -> list[Case]:
    return [Case(f"{memory:g} bytes, N={n}, {stage}, {precision}",
                 _fixed(memory, n, stage, precision))
            for memory in (80e9, 24e9) for n in (1, 8, 64) for stage in STAGES
            for precision in ("fp32", "mixed")]


def _cases_7_2() -> list[Case]:
    return [Case(f"S={s:g} bytes, N={n}, {op}, latency {latency:g} s",
                 _fixed(s, n, op, 100e9, latency))
            for s in (28e9, 1000) for n in (1, 2, 8)
            for op in ("all_reduce", "reduce_scatter", "all_gather") for latency in (0.0, 5e-6)]


EXERCISES: dict[str, Exercise] = {ex.id: ex for ex in [
    Exercise("1.1", "ex01_memory", "model_state_bytes",
             "model-state bytes per rank for DDP and ZeRO-1/2/3, from the formulas",
             "ZeRO-1 shards only the optimizer state, ZeRO-2 the optimizer state and the "
             "gradients, ZeRO-3 all three; what is not sharded is whole on every rank.",
             _cases_1_1),
    Exercise("1.2", "ex01_memory", "distinct_storage_bytes",
             "measuring memory: count each storage once (views, tied weights, freed storage)",
             "Key on t.untyped_storage().data_ptr() and add t.untyped_storage().nbytes(), "
             "not numel * element_size: a view shares (and keeps alive) its whole storage.",
             _cases_1_2),
    Exercise("2.1", "ex02_collectives", "ring_reduce_scatter",
             "reduce-scatter as a ring of send/recv: N-1 steps, (N-1)/N of the bytes",
             "At step s rank r sends chunk (r-s-1) % N and adds what it receives into chunk "
             "(r-s-2) % N; after N-1 steps chunk r is complete. Send only through "
             "ring_exchange (zerolab.comm.send/recv), one chunk per step.",
             _cases_2_1, distributed=True, comm_checked=True),
    Exercise("2.2", "ex02_collectives", "ring_all_gather",
             "all-gather as a ring of send/recv",
             "Copy your own shard into chunk `rank` first; at step s send chunk (r-s) % N and "
             "receive into chunk (r-s-1) % N. Try it on paper for 3 ranks.",
             _cases_2_2, distributed=True, comm_checked=True),
    Exercise("2.3", "ex02_collectives", "all_reduce_mean",
             "all-reduce = reduce-scatter + all-gather, with padding for any size",
             "Use op='avg' in the reduce-scatter; pad the flat tensor to world_size * "
             "ceil(numel / world_size), and keep only the first numel elements at the end.",
             _cases_2_3, distributed=True, comm_checked=True),
    Exercise("3.1", "ex03_zero1", "flat_shard",
             "the flat, padded shard every ZeRO stage uses",
             "shard_numel is ceil(numel / world_size), the zeros go at the end of the flat "
             "buffer, and rank r's shard starts at r * shard_numel.",
             _cases_3_1),
    Exercise("3.2", "ex03_zero1", "unflatten_shards",
             "the inverse: tensors back from the gathered shards, padding dropped",
             "Concatenate the shards in rank order; tensor i starts where tensor i-1 ended, "
             "and the padding is at the very end.",
             _cases_3_2),
    Exercise("3.3", "ex03_zero1", "zero1_sgd_step",
             "the ZeRO-1 step: reduce-scatter gradients, update own shard, all-gather params",
             "Average (op='avg'), do not sum; reduce-scatter, not all-reduce (the paper's "
             "ZeRO-1 sends 2Ψ, not 3Ψ); update only your shard, then all-gather it.",
             _cases_3_3, distributed=True, comm_checked=True,
             outputs=_tuple_outputs("params", "momentum")),
    Exercise("4.1", "ex04_zero2", "reduce_scatter_bucket",
             "the ZeRO-2 gradient hook: reduce-scatter a bucket, keep the shard, free the rest",
             "Add the received shard into grad_shard in place (+=: it may already hold earlier "
             "micro-batches), average with op='avg', and set every p.grad = None.",
             _cases_4_1, distributed=True, comm_checked=True, outputs=_outputs_4_1),
    Exercise("5.1", "ex05_zero3", "unshard",
             "ZeRO-3's unshard: all-gather a unit and view its parameters",
             "All-gather the shards with zerolab.comm.all_gather; the padding is at the end of "
             "the gathered buffer, so parameter 0 starts at element 0.",
             _cases_5_1, distributed=True, comm_checked=True),
    Exercise("5.2", "ex05_zero3", "reshard",
             "ZeRO-3's reshard: really free a unit's storage",
             "Both are needed: flat_param.untyped_storage().resize_(0) frees the memory, and "
             "p.data = torch.empty(0, dtype=p.dtype) leaves no parameter pointing into it.",
             _cases_5_2, outputs=_outputs_5_2),
    Exercise("6.1", "ex06_fsdp", "dim0_shard",
             "FSDP2's per-parameter dim-0 shard, against zerolab's flat shard",
             "Every rank but the last ones gets ceil(rows / world_size) rows (torch.chunk's "
             "rule); do not pad the last shards.",
             _cases_6_1),
    Exercise("6.2", "ex06_fsdp", "full_state_dict",
             "consolidating a full state dict from dim-0 shards (uneven all-gather)",
             "Pad each shard with zero rows at its end to ceil(rows / world_size) rows, gather, "
             "then keep the first `rows` rows.",
             _cases_6_2, distributed=True),
    Exercise("7.1", "ex07_scaling", "largest_model",
             "the largest model that fits per stage, given memory, N and precision",
             "Mixed precision keeps fp32 master weights: K = 12, not 8. ZeRO-3 divides params, "
             "grads and optimizer state by N.",
             _cases_7_1),
    Exercise("7.2", "ex07_scaling", "ring_time",
             "the time of a ring collective by the latency-bandwidth model",
             "A step sends S/N bytes, not S; an all-reduce takes 2(N-1) steps, reduce-scatter "
             "and all-gather N-1.",
             _cases_7_2),
]}


# ---- comparing outputs --------------------------------------------------------------------------


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)} ({x.dtype})"
    if isinstance(x, (list, tuple, dict)):
        return f"a {type(x).__name__} of {len(x)}"
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) < 40 else text[:37] + '...'}"


def _fmt_values(t: torch.Tensor) -> str:
    def fmt(v: Any) -> str:
        return "[" + ", ".join(fmt(u) for u in v) + "]" if isinstance(v, list) else f"{v:.4g}"
    return fmt(t.detach().double().tolist())


def _compare(expected: Any, got: Any) -> str | None:
    """Why `got` differs from `expected` (named from the top), or None when it matches."""
    if isinstance(expected, torch.Tensor):
        return _compare_tensors(expected, got)
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"expected a dict, got {_describe(got)}"
        if set(got) != set(expected):
            return f"expected keys {sorted(expected)}, got {sorted(got)}"
        for key in expected:
            if (why := _compare(expected[key], got[key])) is not None:
                return f"[{key!r}]: {why}"
        return None
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"expected a list of {len(expected)}, got {_describe(got)}"
        if all(isinstance(v, (str, bool, int, float)) for v in [*expected, *got]):
            # Short lists of plain values (comm ops, freed flags): show them whole.
            same = len(got) == len(expected) and all(
                _compare(e, g) is None for e, g in zip(expected, got))
            return None if same else f"expected {list(expected)}, got {list(got)}"
        if len(got) != len(expected):
            return f"expected {len(expected)} items, got {len(got)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            if (why := _compare(e, g)) is not None:
                return f"[{i}]: {why}"
        return None
    if isinstance(expected, numbers.Real) and not isinstance(expected, bool):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if not isinstance(got, numbers.Real) or isinstance(got, bool):
            return f"expected a number, {expected:.6g}, got {_describe(got)}"
        if not math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-12):
            return f"expected {expected:.6g}, got {got:.6g}"
        return None
    return None if got == expected else f"expected {expected!r}, got {got!r}"


def _compare_tensors(expected: torch.Tensor, got: Any) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"expected {_describe(expected)}, got {_describe(got)}"
    if got.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, got shape {tuple(got.shape)}"
    if got.dtype != expected.dtype:
        return f"expected dtype {expected.dtype}, got {got.dtype}"
    e, g = expected.detach().double(), got.detach().double()
    if torch.allclose(g, e, rtol=1e-5, atol=1e-6, equal_nan=True):
        return None
    error = (g - e).abs().nan_to_num(nan=math.inf)
    if e.numel() <= 12:
        values = f"expected {_fmt_values(e)}, got {_fmt_values(g)}"
    else:
        worst = int(error.argmax())
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), e.shape))
        values = (f"at index {where}: expected {e.reshape(-1)[worst]:.4g}, "
                  f"got {g.reshape(-1)[worst]:.4g}")
    return f"shape {tuple(e.shape)} as expected, max error {error.max():.3g}; {values}"


# ---- running one case ---------------------------------------------------------------------------


def _load_module(path: Path) -> ModuleType:
    """Import a file by path, under a name of its own (a learner's copy never clashes)."""
    name = f"_zerolab_graded_{zlib.crc32(str(path).encode()):08x}_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up here
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _is_stub(e: BaseException) -> bool:
    return isinstance(e, NotImplementedError) and str(e).startswith("Exercise ")


def _learner_traceback(e: BaseException, learner_file: str) -> str:
    """The traceback lines in the learner's own file, then the exception: not our internals."""
    mine = os.path.realpath(learner_file)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if os.path.realpath(f.filename) == mine]
    return "".join(traceback.format_list(frames) + traceback.format_exception_only(type(e), e))


def _run(ex: Exercise, fn: Callable, case: Case, rank: int, world_size: int,
         group: dist.ProcessGroup | None) -> dict[str, Any]:
    """Call `fn` on the case's fresh arguments; return its named outputs."""
    args = case.make(rank)
    if not ex.distributed:
        return ex.outputs(fn(*args), args)
    with comm.record_comm(group=group, align=False) as log:
        result = fn(*args, rank, world_size, group)
    outputs = ex.outputs(result, args)
    if ex.comm_checked:
        outputs["comm ops"] = sorted({e.op for e in log.events})
        outputs["bytes sent"] = log.total_bytes()
    return outputs


def _check_case(ex: Exercise, learner: tuple[str, Callable], solution: Callable, case: Case,
                rank: int = 0, world_size: int = 1,
                group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Run the solution, then the learner, on the same inputs. A record: status and details."""
    learner_file, learner_fn = learner
    try:
        expected = _run(ex, solution, case, rank, world_size, group)
    except Exception:
        return {"status": "error", "message": "the solution raised (a bug in the grader)",
                "traceback": traceback.format_exc()}
    try:
        got = _run(ex, learner_fn, case, rank, world_size, group)
    except BadReturn as e:
        return {"status": "wrong", "output": "return value", "message": str(e)}
    except Exception as e:
        if _is_stub(e):
            return {"status": "stub"}
        return {"status": "raised", "message": f"{type(e).__name__}: {e}",
                "traceback": _learner_traceback(e, learner_file)}
    for name, value in expected.items():
        why = _compare(value, got[name])
        if why is not None:
            if name in ("comm ops", "bytes sent"):
                why += " (the grader sees what goes through zerolab.comm)"
            return {"status": "wrong", "output": name, "message": why}
    return {"status": "passed"}


# ---- plain exercises: in this process -----------------------------------------------------------


class _Timeout(BaseException):
    """Not an Exception, so that a learner's `except Exception` does not swallow it."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Interrupt the block after `seconds` (SIGALRM: main thread on Unix only, else no limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise _Timeout()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _grade_plain(ex: Exercise, learner: tuple[str, Callable], solution: Callable,
                 timeout: float) -> Result:
    for case in ex.cases():
        try:
            with _time_limit(timeout):
                record = _check_case(ex, learner, solution, case)
        except _Timeout:
            record = {"status": "timeout"}
        if record["status"] != "passed":
            return _result_from(ex, {**record, "label": case.label}, timeout=timeout)
    return Result(ex, "passed")


# ---- distributed exercises: on spawned ranks ----------------------------------------------------


@contextlib.contextmanager
def _watchdog(seconds: float, on_expire: Callable[[], None]) -> Iterator[None]:
    """Call on_expire (which ends the process) if the block is still running after `seconds`."""
    timer = threading.Timer(seconds, on_expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _agree(store: dist.Store, key: str, status: str, rank: int, world_size: int,
           wait: float) -> list[str] | None:
    """Post this rank's status for a case and read everyone's; None if some rank never posts."""
    store.set(f"{key}/{rank}", status)
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=wait))
    except Exception:  # a rank is still stuck in the learner's code
        return None
    return [store.get(k).decode() for k in keys]


def _worker(tasks: list[tuple[str, str, str]], workdir: str, timeout: float,
            grace: float) -> None:
    """One rank: grade each (exercise id, learner file, solution file) in turn.

    Every case's outcome is appended to records-<rank>.jsonl as it happens, so that the
    caller learns what finished even if the launch dies (a rank raised alone, or hung).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    store = dist.FileStore(os.path.join(workdir, "store"), world_size)
    records = os.path.join(workdir, f"records-{rank}.jsonl")
    modules: dict[str, ModuleType] = {}

    def record(**fields: Any) -> None:
        with open(records, "a") as f:
            f.write(json.dumps({"rank": rank, "time": time.time(), **fields}) + "\n")

    def function(path: str, name: str) -> Callable:
        if path not in modules:
            modules[path] = _load_module(Path(path))
        return getattr(modules[path], name)

    for ex_id, learner_file, solution_file in tasks:
        ex = EXERCISES[ex_id]
        group = dist.new_group()  # a fresh group: stray messages of one exercise stay there
        record(id=ex_id, start=True)
        for index, case in enumerate(ex.cases(world_size)):
            def expire(ex_id: str = ex_id, index: int = index, label: str = case.label) -> None:
                record(id=ex_id, case=index, label=label, status="timeout")
                os._exit(3)

            with _watchdog(timeout, expire):
                try:
                    learner_fn = function(learner_file, ex.function)
                except Exception as e:
                    outcome = {"status": "raised", "message": f"{type(e).__name__}: {e}",
                               "traceback": _learner_traceback(e, learner_file)}
                else:
                    outcome = _check_case(ex, (learner_file, learner_fn),
                                          function(solution_file, ex.function), case, rank,
                                          world_size, group)
                record(id=ex_id, case=index, label=case.label, **outcome)
                # A rank that raised may have left the others waiting for its messages: it
                # gives them `grace` seconds, then ends the launch.
                failed = outcome["status"] in ("raised", "stub", "error")
                statuses = _agree(store, f"{ex_id}/{index}", outcome["status"], rank,
                                  world_size, grace if failed else timeout + grace)
            if statuses is None:
                os._exit(1)
            if any(s != "passed" for s in statuses):
                break  # every rank saw the same statuses: all stop this exercise
        record(id=ex_id, final=True)


def _launch_batch(exercises: list[Exercise], files: dict[str, tuple[str, str]],
                  world_size: int, timeout: float) -> tuple[dict[str, list[dict]], str | None]:
    """One launch grading `exercises` at `world_size`: (records by exercise id, failure)."""
    workdir = tempfile.mkdtemp(prefix="zerolab-grade-")
    tasks = [(ex.id, *files[ex.id]) for ex in exercises]
    failure = None
    try:
        launch(_worker, world_size, args=(tasks, workdir, timeout, GRACE), backend="gloo",
               timeout=STARTUP_ALLOWANCE + timeout * len(tasks))
    except LaunchTimeout as e:
        failure = f"timeout: {e}"
    except LaunchError as e:
        failure = str(e).splitlines()[0]
    records: dict[str, list[dict]] = {}
    for rank in range(world_size):
        path = os.path.join(workdir, f"records-{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        r = json.loads(line)
                        records.setdefault(r["id"], []).append(r)
    shutil.rmtree(workdir, ignore_errors=True)
    return records, failure


def _grade_distributed(exercises: list[Exercise], files: dict[str, tuple[str, str]],
                       world_sizes: Sequence[int], timeout: float) -> dict[str, Result]:
    """Grade on each world size in turn; an exercise found wrong is not run again."""
    results: dict[str, Result] = {}
    for n in world_sizes:
        todo = [ex for ex in exercises if ex.id not in results]
        retries = 0
        while todo:
            records, failure = _launch_batch(todo, files, n, timeout)
            finished = [ex for ex in todo
                        if sum(1 for r in records.get(ex.id, []) if r.get("final")) == n]
            # If the launch died, the first unfinished exercise is the one that killed it ...
            stopped = next((ex for ex in todo if ex not in finished), None)
            if stopped is not None and failure is not None and not records.get(stopped.id):
                # ... unless no rank even started it: the launch itself failed (a machine
                # short of memory or processes). Not the learner's fault: run it again.
                retries += 1
                if retries > 2:
                    raise RuntimeError(f"the grader could not run {n} ranks: {failure}")
                stopped = None
            elif stopped is not None and failure is None:
                failure = "the ranks ended before this exercise finished (a bug in the grader?)"
            resolved = finished + ([stopped] if stopped is not None else [])
            for ex in resolved:
                verdict = _verdict(ex, n, records.get(ex.id, []),
                                   failure if ex is stopped else None, timeout)
                if verdict is not None:
                    results[ex.id] = verdict
            todo = [ex for ex in todo if ex not in resolved]  # not reached: run them again
    return results


def _verdict(ex: Exercise, world_size: int, records: list[dict], failure: str | None,
             timeout: float) -> Result | None:
    """The exercise's result at one world size from its ranks' records (None: passed)."""
    failing = [r for r in records if "status" in r and r["status"] != "passed"]
    if not failing:
        if failure is None:
            return None
        if failure.startswith("timeout"):
            return _result_from(ex, {"status": "timeout", "world_size": world_size},
                                timeout=timeout)
        return Result(ex, "wrong", world_size=world_size,
                      message=f"the ranks stopped before finishing: {failure}", hint=ex.hint)
    case = min(r["case"] for r in failing)
    at_case = sorted((r for r in failing if r["case"] == case), key=lambda r: r["rank"])
    record = at_case[0]
    for status in ("error", "raised", "timeout", "stub", "wrong"):
        chosen = [r for r in at_case if r["status"] == status]
        if chosen:
            # The first rank to raise is the cause: when it leaves, a rank that was waiting
            # for it may raise too (connection closed) before the launch kills it.
            record = min(chosen, key=lambda r: r["time"]) if status == "raised" else chosen[0]
            break
    if record["status"] == "timeout":
        done = {r["rank"] for r in records
                if r.get("case") == case and r.get("status") != "timeout"}
        record = {**record, "stuck": sorted(set(range(world_size)) - done)}
    return _result_from(ex, {**record, "world_size": world_size}, timeout=timeout)


# ---- results ------------------------------------------------------------------------------------


@dataclass
class Result:
    """One exercise's verdict."""

    exercise: Exercise
    status: str  # "passed", "not attempted", "wrong", or "error" (the grader's own fault)
    world_size: int | None = None  # distributed: on how many ranks it went wrong
    rank: int | None = None  # which rank
    case: str | None = None  # which input
    output: str | None = None  # which output differed ("result", "grad_shard", "comm ops", ...)
    message: str = ""  # what differed: expected against got; or the exception
    traceback: str = ""  # the learner's own lines of the traceback, when it raised
    hint: str = ""
    timed_out: bool = False

    @property
    def id(self) -> str:
        return self.exercise.id

    def lines(self) -> list[str]:
        ex = self.exercise
        status = self.status.upper() if self.status in ("wrong", "error") else self.status
        head = f"  {ex.id:<4} {ex.module + '.' + ex.function:<38} {status}"
        if self.status == "not attempted" and self.message:
            head += f" ({self.message})"
        if self.status not in ("wrong", "error"):
            return [head]
        where = []
        if self.world_size is not None:
            where.append(f"on {self.world_size} rank{'s' if self.world_size > 1 else ''}")
        if self.rank is not None and self.world_size is not None:
            where.append(f"rank {self.rank}")
        if self.case:
            where.append(f"case '{self.case}'")
        out = [head]
        if where:
            out.append("       " + ", ".join(where))
        if self.output:
            out.append(f"       output '{self.output}': {self.message}")
        elif self.message:
            out.append(f"       {self.message}")
        out += ["         " + line for line in self.traceback.rstrip().splitlines()]
        if self.hint:
            out.append(f"       hint: {self.hint}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _result_from(ex: Exercise, record: dict, timeout: float) -> Result:
    status = record["status"]
    common = {"world_size": record.get("world_size"), "case": record.get("label")}
    if record.get("world_size") is not None and "rank" in record:
        common["rank"] = record["rank"]
    if status == "stub":
        return Result(ex, "not attempted")
    if status == "timeout":
        if not ex.distributed:
            why = "an endless loop?"
        else:
            stuck = record.get("stuck")
            why = (f"rank(s) {stuck} never finished: " if stuck else "") + \
                "a rank waiting for a message no other rank sends (or an endless loop)?"
        return Result(ex, "wrong", **{**common, "rank": None}, timed_out=True, hint=ex.hint,
                      message=f"timed out after {timeout:g} s: {why}")
    if status == "raised":
        return Result(ex, "wrong", **common, message=f"raised {record['message']}",
                      traceback=record.get("traceback", ""), hint=ex.hint)
    if status == "error":
        return Result(ex, "error", **common, message=record["message"],
                      traceback=record.get("traceback", ""))
    return Result(ex, "wrong", **common, output=record.get("output"),
                  message=record.get("message", ""), hint=ex.hint)


@dataclass
class Report:
    """What `grade` returns: one Result per exercise; prints (and displays) as a table."""

    results: list[Result]
    path: Path
    world_sizes: tuple[int, ...] = DEFAULT_WORLD_SIZES
    counts: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.counts = {s: sum(r.status == s for r in self.results)
                       for s in ("passed", "wrong", "not attempted", "error")}

    @property
    def ok(self) -> bool:
        """No exercise wrong (not attempted ones are fine)."""
        return self.counts["wrong"] == 0 and self.counts["error"] == 0

    def __getitem__(self, exercise_id: str) -> Result:
        return next(r for r in self.results if r.id == exercise_id)

    def __str__(self) -> str:
        sizes = ", ".join(map(str, self.world_sizes))
        lines = [f"Grading {_shown(self.path)}/ (distributed exercises on {sizes} ranks)"]
        for r in self.results:
            lines += r.lines()
        summary = ", ".join(f"{v} {k}" for k, v in self.counts.items() if v or k != "error")
        lines.append(f"{len(self.results)} exercises: {summary}")
        return "\n".join(lines)

    __repr__ = __str__


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


# ---- the entry points ---------------------------------------------------------------------------


def select(names: Sequence[str] | str | None = None) -> list[Exercise]:
    """Exercises by file (ex03, ex03_zero1, 03, 3), id (3.1) or function name; None: all."""
    if names is None or names == [] or names == ():
        return list(EXERCISES.values())
    if isinstance(names, str):
        names = [names]
    chosen: list[Exercise] = []
    for name in names:
        key = name.removesuffix(".py")
        found = [ex for ex in EXERCISES.values()
                 if key in (ex.id, ex.function, ex.module, ex.module[:4], ex.notebook,
                            ex.notebook.lstrip("0"))]
        if not found:
            files = sorted({ex.module for ex in EXERCISES.values()})
            raise ValueError(f"no exercise called {name!r}: name a file ({', '.join(files)}), "
                             f"an exercise id (1.1 to 7.2) or a function")
        chosen += [ex for ex in found if ex not in chosen]
    return chosen


def load(name: str, path: str | os.PathLike | None = None) -> Callable:
    """The learner's function for one exercise (id or function name), freshly imported."""
    found = select(name)
    if len(found) != 1:
        raise ValueError(f"{name!r} names several exercises; give an id such as 3.1")
    ex = found[0]
    folder = Path(path) if path is not None else EXERCISES_DIR
    return getattr(_load_module(folder / f"{ex.module}.py"), ex.function)


def grade(names: Sequence[str] | str | None = None, path: str | os.PathLike | None = None,
          timeout: float = DEFAULT_TIMEOUT,
          world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES) -> Report:
    """Grade exercises (all by default) in `path` (default: exercises/) against solutions/.

    names: files (ex03), ids (3.1) or function names. timeout: seconds one case may run.
    world_sizes: the numbers of ranks distributed exercises run on.
    """
    exercises = select(names)
    if not SOLUTIONS_DIR.is_dir():
        raise ValueError(f"no {SOLUTIONS_DIR}: the grader needs the course's repository "
                         f"(solutions/ next to zerolab/; install it with `pip install -e .`)")
    folder = Path(path) if path is not None else EXERCISES_DIR
    if not folder.is_dir():
        raise ValueError(f"no folder {folder}")
    results: dict[str, Result] = {}
    files: dict[str, tuple[str, str]] = {}
    plain: list[tuple[Exercise, tuple[str, Callable], Callable]] = []
    solutions = {m: _load_module(SOLUTIONS_DIR / f"{m}.py") for m in {e.module for e in exercises}}
    learners: dict[str, ModuleType | Result] = {}
    for ex in exercises:
        learner_file = folder / f"{ex.module}.py"
        if ex.module not in learners:
            learners[ex.module] = _import_learner(ex, learner_file)
        module = learners[ex.module]
        if isinstance(module, Result):  # missing, or fails to import
            results[ex.id] = Result(ex, module.status, message=module.message,
                                    traceback=module.traceback, hint=module.hint)
        elif not hasattr(module, ex.function):
            results[ex.id] = Result(ex, "not attempted",
                                    message=f"no function {ex.function} in {learner_file.name}")
        elif ex.distributed:
            files[ex.id] = (str(learner_file.resolve()),
                            str((SOLUTIONS_DIR / f"{ex.module}.py").resolve()))
        else:
            plain.append((ex, (str(learner_file), getattr(module, ex.function)),
                          getattr(solutions[ex.module], ex.function)))
    for ex, learner, solution in plain:
        results[ex.id] = _grade_plain(ex, learner, solution, timeout)
    distributed = [ex for ex in exercises if ex.id in files]
    results.update(_grade_distributed(distributed, files, world_sizes, timeout))
    return Report([results.get(ex.id, Result(ex, "passed")) for ex in exercises], folder,
                  tuple(world_sizes))


def _import_learner(ex: Exercise, learner_file: Path) -> ModuleType | Result:
    if not learner_file.exists():
        return Result(ex, "not attempted", message=f"no file {_shown(learner_file)}")
    try:
        return _load_module(learner_file)
    except Exception as e:
        return Result(ex, "wrong", message=f"{learner_file.name} does not import: "
                                           f"{type(e).__name__}",
                      traceback=_learner_traceback(e, str(learner_file)),
                      hint="Fix the file so that `python " + learner_file.name + "` runs.")


# ---- generating exercises/ from solutions/ ------------------------------------------------------

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_EXERCISE_ID = re.compile(r"Exercise (\d+\.\d+): (.+)")
_GENERATED_NOTE = """
# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401
"""
_EXERCISES_INIT = '''"""The course's exercises: stubs to complete, one file per notebook (01-07).

Each function's docstring states the task, the shapes and a hint. Check your work with
`from zerolab.grading import grade; grade("ex03")` in a notebook, or
`python -m zerolab.grade ex03` in a shell. To work on a copy instead (several learners side
by side): `cp -r exercises my_copy`, then `grade("ex03", path="my_copy")` or
`python -m zerolab.grade ex03 --path my_copy`.

Generated from solutions/ by `python -m zerolab.grade --make-exercises` (which overwrites the
files here: keep your work in a copy, or commit it first).
"""
'''


def exercise_source(solution: str, filename: str = "<solution>") -> str:
    """A solution file's text with each marked block replaced by the exercise's stub."""
    tree = ast.parse(solution, filename)
    functions = [n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    lines = solution.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.strip() == END:
            raise ValueError(f"{filename}:{i + 1}: {END} without {BEGIN}")
        if line.strip() != BEGIN:
            out.append(line)
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip() in (BEGIN, END)), None)
        if end is None or lines[end].strip() != END:
            raise ValueError(f"{filename}:{i + 1}: {BEGIN} without its {END}")
        around = [f for f in functions if f.lineno <= i + 1 <= (f.end_lineno or 0)]
        if not around:
            raise ValueError(f"{filename}:{i + 1}: {BEGIN} outside a function")
        docstring = ast.get_docstring(max(around, key=lambda f: f.lineno)) or ""
        match = _EXERCISE_ID.match(docstring.splitlines()[0] if docstring else "")
        if match is None:
            raise ValueError(f"{filename}:{i + 1}: the function's docstring must start with "
                             f"'Exercise N.M: <task>'")
        indent = line[:len(line) - len(line.lstrip())]
        message = '"Exercise ' + match[1] + ": " + match[2].replace('"', "'") + '"'
        stub = f"{indent}raise NotImplementedError({message})"
        if len(stub) > 100:  # the project's line length: the message on a line of its own
            stub = f"{indent}raise NotImplementedError(\n{indent}    {message})"
        out.append(stub + "\n")
        i = end + 1
    text = "".join(out)
    docstring_end = tree.body[0].end_lineno if tree.body and _is_docstring(tree.body[0]) else 0
    head = text.splitlines(keepends=True)
    return "".join(head[:docstring_end]) + _GENERATED_NOTE + "".join(head[docstring_end:])


def _is_docstring(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str))


def generated_exercises(solutions_dir: Path = SOLUTIONS_DIR) -> dict[str, str]:
    """File name -> text of every file exercises/ should hold."""
    files = {"__init__.py": _EXERCISES_INIT}
    for path in sorted(Path(solutions_dir).glob("ex[0-9][0-9]_*.py")):
        files[path.name] = exercise_source(path.read_text(), str(path))
    return files


def make_exercises(solutions_dir: Path = SOLUTIONS_DIR,
                   exercises_dir: Path = EXERCISES_DIR) -> list[Path]:
    """Write exercises/ from solutions/; return the files written."""
    exercises_dir = Path(exercises_dir)
    exercises_dir.mkdir(exist_ok=True)
    written = []
    for name, text in generated_exercises(solutions_dir).items():
        (exercises_dir / name).write_text(text)
        written.append(exercises_dir / name)
    return written


def check_exercises(solutions_dir: Path = SOLUTIONS_DIR,
                    exercises_dir: Path = EXERCISES_DIR) -> list[str]:
    """Where exercises/ differs from what solutions/ generates (empty: in sync)."""
    expected = generated_exercises(solutions_dir)
    problems = []
    for name, text in expected.items():
        path = Path(exercises_dir) / name
        if not path.exists():
            problems.append(f"{path} is missing")
        elif path.read_text() != text:
            problems.append(f"{path} differs from what {Path(solutions_dir) / name} generates")
    for path in sorted(Path(exercises_dir).glob("ex[0-9][0-9]_*.py")):
        if path.name not in expected:
            problems.append(f"{path} has no solution in {solutions_dir}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zerolab.grade",
        description="Grade the course's exercises against the solutions. Exit status 1 if "
                    "any is wrong.")
    parser.add_argument("names", nargs="*", help="files (ex03), exercise ids (3.1) or "
                                                 "function names; default: all")
    parser.add_argument("--path", help="folder with your exNN_*.py files (default: exercises/)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds one case may run (default {DEFAULT_TIMEOUT:g})")
    parser.add_argument("--world-sizes", default=",".join(map(str, DEFAULT_WORLD_SIZES)),
                        help="ranks to run distributed exercises on (default 1,2,3)")
    parser.add_argument("--list", action="store_true", help="list the exercises and exit")
    parser.add_argument("--make-exercises", action="store_true",
                        help="write exercises/ from solutions/ (overwrites exercises/)")
    parser.add_argument("--check-exercises", action="store_true",
                        help="exit 1 if exercises/ is not what solutions/ generates")
    args = parser.parse_args(argv)
    if args.list:
        for ex in EXERCISES.values():
            where = "ranks" if ex.distributed else "plain"
            print(f"{ex.id:<4} {ex.module + '.' + ex.function:<38} {where:<6} {ex.teaches}")
        return 0
    if args.make_exercises:
        for path in make_exercises():
            print(f"wrote {_shown(path)}")
        return 0
    if args.check_exercises:
        problems = check_exercises()
        print("\n".join(problems) if problems else "exercises/ matches solutions/")
        return 1 if problems else 0
    try:
        world_sizes = tuple(int(n) for n in args.world_sizes.split(","))
        report = grade(args.names, path=args.path, timeout=args.timeout, world_sizes=world_sizes)
    except (ValueError, RuntimeError) as e:  # a bad name or folder; ranks that cannot start
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report)
    return 0 if report.ok else 1
