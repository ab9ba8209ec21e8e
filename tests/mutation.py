"""Mutation testing of the grader: does it catch small wrong changes to each solution?

Each solution's `# BEGIN SOLUTION` ... `# END SOLUTION` block is parsed, and every small
change below makes one mutant: an arithmetic or comparison operator swapped, an integer
nudged by one, a statement dropped, "avg" and "sum" swapped, `rank` shifted by one, a slice
bound moved, a keyword argument dropped, `.clone()` dropped, min and max swapped. Each mutant
is written as a learner's file (the stub with the mutated block in place of the raise) in
its own copy of exercises/, and graded for its exercise only. The grader should call it
wrong: "killed". A mutant it passes "survived": either the grader misses a mistake (then
strengthen the cases), or the change makes no difference (an equivalent mutant: list it
in EQUIVALENT below, with why).

Run by hand (minutes; not in CI, which runs a small sample through tests/test_grading.py):

    .venv/bin/python tests/mutation.py                # every exercise, the engines too
    .venv/bin/python tests/mutation.py 2.1 7.1        # some exercises
    .venv/bin/python tests/mutation.py --list 3.1     # the mutants, without grading
    .venv/bin/python tests/mutation.py --sample 5     # 5 mutants per exercise, seeded

Mutants are graded in batches (zerolab.grading.grade_files: one run per world size for a
whole batch). A mutant's code runs in the grader's processes of its own, so one that crashes,
hangs or exits costs its batch a run started again, never the tool. Exit status 1 when the
killed share of the non-equivalent mutants is under 97%.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import random
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zerolab.grading import EXERCISES, SOLUTIONS_DIR, exercise_source, generated_exercises  # noqa: E402

# (exercise id, the mutated statement) -> why the mutant cannot be told from the solution.
EQUIVALENT: dict[tuple[str, str], str] = {
    ("5.2", "p.data = torch.empty(0, dtype=p.dtype)"):
        "the device defaults to the CPU, where the grader (and these exercises) run",
    ("9.1", "replicas = world_size / node_size"):
        "world_size is a multiple of node_size (the contract): / and // give the same number",
    ("9.2", "padded = torch.zeros(blocks * block)"):
        "torch.zeros makes float32 by default, the dtype the keyword named",
    ("9.2", "values = torch.round(rows / torch.where(scales >= 0, scales, 1.0)[:, None])"):
        "only a block of zeros has scale 0: it divides 0 by 0, and the NaN it makes becomes 0 "
        "in int8 on this CPU (torch leaves that conversion undefined): the same values",
    ("9.2", "values = torch.round(rows / torch.where(scales > -1, scales, 1.0)[:, None])"):
        "as `scales >= 0`: scales are never negative, so this divides a block of zeros by 0 "
        "too, and its NaNs become 0 in int8 on this CPU",
}


@dataclass
class Mutant:
    exercise: str  # id, "2.1"
    number: int  # within the exercise
    kind: str  # which change
    before: str  # the statement it changes, as source
    after: str  # the statement after the change
    block: str  # the whole mutated block, indented as in the file
    status: str = ""  # killed / survived / not attempted / error
    detail: str = ""  # how the grader caught it

    @property
    def equivalent(self) -> str | None:
        return EQUIVALENT.get((self.exercise, self.after))


# ---- the changes ----------------------------------------------------------------------------

_BINOPS = {ast.Add: [ast.Sub], ast.Sub: [ast.Add], ast.Mult: [ast.Div], ast.Div: [ast.Mult,
           ast.FloorDiv], ast.FloorDiv: [ast.Div, ast.Mult], ast.Mod: [ast.FloorDiv],
           ast.Pow: [ast.Mult]}
_CMPOPS = {ast.Lt: [ast.LtE], ast.LtE: [ast.Lt], ast.Gt: [ast.GtE], ast.GtE: [ast.Gt],
           ast.Eq: [ast.NotEq], ast.NotEq: [ast.Eq], ast.In: [ast.NotIn], ast.NotIn: [ast.In],
           ast.Is: [ast.IsNot], ast.IsNot: [ast.Is]}
_SWAPS = {"avg": "sum", "sum": "avg", "min": "max", "max": "min"}

Change = tuple[str, Callable[[ast.AST], ast.AST | None]]  # (kind, node copy -> replacement)


def _changes(node: ast.AST) -> Iterator[Change]:
    """The mutations of one node: (kind, what to replace a copy of it with; None: drop it)."""
    if isinstance(node, (ast.BinOp, ast.AugAssign)):
        for op in _BINOPS.get(type(node.op), []):
            yield f"operator {type(node.op).__name__} -> {op.__name__}", _set(op=op())
    if isinstance(node, ast.Compare):
        for i, cmp in enumerate(node.ops):
            for op in _CMPOPS.get(type(cmp), []):
                yield f"comparison {type(cmp).__name__} -> {op.__name__}", _set_op(i, op())
    if isinstance(node, ast.Constant) and type(node.value) is int:
        for d in (1, -1):
            yield f"integer {node.value} -> {node.value + d}", _set(value=node.value + d)
    if isinstance(node, ast.Constant) and node.value in _SWAPS:
        yield f"string {node.value!r} -> {_SWAPS[node.value]!r}", _set(value=_SWAPS[node.value])
    if isinstance(node, ast.Name) and node.id in _SWAPS and isinstance(node.ctx, ast.Load):
        yield f"{node.id} -> {_SWAPS[node.id]}", _set(id=_SWAPS[node.id])
    if isinstance(node, ast.Name) and node.id == "rank" and isinstance(node.ctx, ast.Load):
        for op, sign in ((ast.Add, "+"), (ast.Sub, "-")):
            yield f"rank -> rank {sign} 1", lambda n, op=op: ast.BinOp(n, op(), ast.Constant(1))
    if isinstance(node, ast.Slice):
        for field in ("lower", "upper"):
            if getattr(node, field) is not None:
                for op, sign in ((ast.Add, "+"), (ast.Sub, "-")):
                    yield f"slice {field} {sign} 1", _shift(field, op)
    if isinstance(node, ast.Call):
        for i, kw in enumerate(node.keywords):
            if kw.arg in ("dtype", "op", "device"):
                yield f"keyword {kw.arg}= dropped", _drop_keyword(i)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "clone":
            yield ".clone() dropped", lambda n: n.func.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        yield "unary minus dropped", lambda n: n.operand
    if isinstance(node, ast.stmt):
        yield "statement dropped", lambda n: None


def _set(**fields: object) -> Callable[[ast.AST], ast.AST]:
    def change(n: ast.AST) -> ast.AST:
        for k, v in fields.items():
            setattr(n, k, v)
        return n
    return change


def _set_op(i: int, op: ast.cmpop) -> Callable[[ast.AST], ast.AST]:
    def change(n: ast.AST) -> ast.AST:
        n.ops[i] = op
        return n
    return change


def _shift(field: str, op: type[ast.operator]) -> Callable[[ast.AST], ast.AST]:
    def change(n: ast.AST) -> ast.AST:
        setattr(n, field, ast.BinOp(getattr(n, field), op(), ast.Constant(1)))
        return n
    return change


def _drop_keyword(i: int) -> Callable[[ast.AST], ast.AST]:
    def change(n: ast.AST) -> ast.AST:
        del n.keywords[i]
        return n
    return change


# ---- making the mutants ---------------------------------------------------------------------


def _replace(tree: ast.AST, index: int, change: Callable[[ast.AST], ast.AST | None]) -> ast.AST:
    """A copy of `tree` with its index-th node (ast.walk order) changed; the changed
    statement (to show) is returned by _statement."""
    tree = copy.deepcopy(tree)
    target = list(ast.walk(tree))[index]
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, change(target))
                return tree
            if isinstance(value, list) and any(v is target for v in value):
                i = next(i for i, v in enumerate(value) if v is target)
                new = change(target)
                if new is None:  # a dropped statement: `pass` keeps the block valid
                    new = ast.Pass()
                value[i] = new
                return tree
    raise ValueError("node not found")


def _statement_at(tree: ast.AST, index: int) -> ast.AST:
    """The statement that holds the index-th node."""
    nodes = list(ast.walk(tree))
    target = nodes[index]
    best = None
    for stmt in (n for n in nodes if isinstance(n, ast.stmt)):
        if any(n is target for n in ast.walk(stmt)):
            best = stmt  # ast.walk is breadth first: the innermost comes last
    return best or target


def mutants_of(exercise_id: str) -> list[Mutant]:
    """Every mutant of one exercise's solution block, duplicates and no-ops left out."""
    ex = EXERCISES[exercise_id]
    text = (SOLUTIONS_DIR / f"{ex.module}.py").read_text()
    blocks: list[str] = []

    def keep(i: str, block: str) -> str:
        if i == exercise_id:
            blocks.append(block)
        return block
    exercise_source(text, answer=keep)
    out: list[Mutant] = []
    seen = set()
    for block in blocks:
        indent = block[:len(block) - len(block.lstrip())]
        tree = ast.parse(textwrap.dedent(block))
        original = ast.unparse(tree)
        for index, node in enumerate(ast.walk(tree)):
            if isinstance(node, ast.Module):
                continue
            for kind, change in _changes(node):
                mutated = _replace(tree, index, change)
                code = ast.unparse(mutated)
                if code == original or code in seen:
                    continue
                seen.add(code)
                before = ast.unparse(_statement_at(tree, index)).splitlines()[0]
                after_stmt = _statement_at(mutated, index)
                after = ast.unparse(after_stmt).splitlines()[0] if after_stmt else "pass"
                out.append(Mutant(exercise_id, len(out) + 1, kind, before, after,
                                  textwrap.indent(code, indent) + "\n"))
    return out


def write_mutant(mutant: Mutant, folder: Path, stubs: dict[str, str]) -> Path:
    """The mutant as a learner's file, in its own copy of exercises/; the file's path."""
    folder.mkdir(parents=True)
    for name, text in stubs.items():
        (folder / name).write_text(text)
    ex = EXERCISES[mutant.exercise]
    solution = (SOLUTIONS_DIR / f"{ex.module}.py").read_text()
    path = folder / f"{ex.module}.py"
    path.write_text(exercise_source(
        solution, answer=lambda i, block: mutant.block if i == mutant.exercise else block))
    return path


# ---- grading them ---------------------------------------------------------------------------


def run(ids: list[str], sample: int | None, timeout: float, batch_size: int) -> list[Mutant]:
    mutants = [m for i in ids for m in mutants_of(i)]
    if sample is not None:
        rng = random.Random(0)
        mutants = [m for i in ids
                   for m in sorted(rng.sample([m for m in mutants if m.exercise == i],
                                              min(sample, sum(m.exercise == i
                                                              for m in mutants))),
                                   key=lambda m: m.number)]
    from zerolab.grading import grade_files

    stubs = generated_exercises()
    workdir = Path(tempfile.mkdtemp(prefix="zerolab-mutants-"))
    try:
        paths = [write_mutant(m, workdir / f"{m.exercise}-{m.number}", stubs) for m in mutants]
        for start in range(0, len(mutants), batch_size):
            chunk = list(zip(mutants, paths))[start:start + batch_size]
            results = grade_files([(m.exercise, path) for m, path in chunk], timeout=timeout)
            for (m, _), r in zip(chunk, results):
                m.status = {"wrong": "killed", "passed": "survived"}.get(r.status, r.status)
                m.detail = r.mistake or r.output or r.message[:60]
            print(f"  graded {start + len(chunk)} of {len(mutants)}", file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return mutants


def report(mutants: list[Mutant]) -> float:
    """Print the table and the survivors; return killed / non-equivalent."""
    print(f"{'exercise':<9}{'mutants':>8}{'killed':>8}{'equivalent':>11}{'survived':>9}")
    for ex_id in dict.fromkeys(m.exercise for m in mutants):
        mine = [m for m in mutants if m.exercise == ex_id]
        killed = sum(m.status.startswith("killed") for m in mine)
        equivalent = sum(m.status == "survived" and m.equivalent is not None for m in mine)
        print(f"{ex_id:<9}{len(mine):>8}{killed:>8}{equivalent:>11}"
              f"{len(mine) - killed - equivalent:>9}")
    survivors = [m for m in mutants if m.status != "killed" and m.equivalent is None]
    equivalents = [m for m in mutants if m.status == "survived" and m.equivalent is not None]
    for title, group in (("survived (not equivalent)", survivors),
                         ("equivalent (survived, as they should)", equivalents)):
        if group:
            print(f"\n{title}:")
        for m in group:
            why = f"  [{m.equivalent}]" if m.equivalent else f"  ({m.status}: {m.detail})"
            print(f"  {m.exercise} #{m.number} {m.kind}: {m.before}  ->  {m.after}{why}")
    relevant = [m for m in mutants if not (m.status == "survived" and m.equivalent)]
    killed = sum(m.status.startswith("killed") for m in relevant)
    share = killed / len(relevant) if relevant else 1.0
    print(f"\nkilled {killed} of {len(relevant)} non-equivalent mutants ({share:.0%}); "
          f"{len(equivalents)} equivalent; {len(mutants)} in all")
    return share


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="exercise ids (default: every function one)")
    parser.add_argument("--sample", type=int, help="grade this many mutants per exercise")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    parser.add_argument("--batch", type=int, default=200, help="mutants graded together")
    parser.add_argument("--list", action="store_true", help="list the mutants, do not grade")
    parser.add_argument("--json", help="also write every mutant's outcome to this file")
    args = parser.parse_args(argv)
    ids = args.ids or list(EXERCISES)
    if args.list:
        for m in (m for i in ids for m in mutants_of(i)):
            print(f"{m.exercise} #{m.number} {m.kind}: {m.before}  ->  {m.after}")
        return 0
    mutants = run(ids, args.sample, args.timeout, args.batch)
    share = report(mutants)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(m) for m in mutants], indent=1))
    return 0 if share >= 0.97 else 1


if __name__ == "__main__":
    sys.exit(main())
