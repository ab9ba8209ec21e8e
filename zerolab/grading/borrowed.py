"""Whether a learner's answer is built on the reference: the solution in solutions/, zerolab's
own engines or torch's. Such an answer is graded "uses the reference", never passed: the grader
compares an answer with the reference, so one made of the reference would show nothing.

What the learner's code says about itself is not trusted; what the process holds is looked at:

- in the grader, before anything runs (`imports_solutions`): an `import solutions...` statement
  in the file;
- in the learner's process, by the grader's code (`in_module`), after the file is imported and
  again after its cases: the modules loaded from solutions/ meanwhile (sys.modules) or held by
  the learner's module; the functions and classes it holds whose code objects were compiled
  from a file in solutions/ (`co_filename`: a function renamed, copied into a class or run by
  runpy keeps it); the exercise's function itself compiled from solutions/ or zerolab/; an
  engine exercise's class whose bases (its MRO) come from zerolab's engines, torch's (DDP,
  FSDP, ZeroRedundancyOptimizer) or solutions/;
- in an engine case (`in_engine`, engine_run.py): the learner's engine holding one of those
  engines (built on it by composition), or a model that torch's FSDP has wrapped.

The learner's own file is never "the reference", even when it lies in solutions/ (the tests
grade the solutions as learners' files).
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

from zerolab.grading.defaults import REPO, SOLUTIONS_DIR

HINT = ("Write the answer yourself, in your own file: the grader compares it with the "
        "reference, so an answer made of the reference (solutions/, zerolab's engines, "
        "torch's) shows nothing. Read the reference after your answer passes.")

# torch's engines, by where their code lies (relative to torch's folder).
_TORCH_ENGINES = ("nn/parallel/", "distributed/fsdp/", "distributed/_composable/",
                  "distributed/optim/zero_redundancy_optimizer.py")


class Borrowed(Exception):
    """Raised by the grader's code (never the learner's) when an engine case finds the
    learner's engine built on a reference engine; worker.py turns it into the verdict."""


def _real(path: str | os.PathLike | None) -> str:
    """The path with its folder's links resolved (each folder resolved once: thousands of
    modules' files are looked at, from a few hundred folders)."""
    if not path:
        return ""
    path = os.fspath(path)
    if not os.path.isabs(path):  # relative to a working directory that may change
        return os.path.realpath(path)
    return _real_path(path)


@functools.cache
def _real_path(path: str) -> str:  # every module's file, after every task: kept
    folder, name = os.path.split(path)
    return os.path.join(_real_folder(folder), name)


@functools.cache
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def _inside(path: str, folder: str | os.PathLike) -> bool:
    return path.startswith(_real(folder) + os.sep)


def prepare() -> None:
    """Read now what looking for the reference engines needs (before the grader is hidden
    from the learner's process: tamper.hide_grader)."""
    _engine_files()


@functools.cache
def _engine_files() -> frozenset[str]:
    """The files zerolab's engines are written in: every engine zerolab.engines lists (its
    module's file, not imported), and the classes the grader's stages are built on."""
    from zerolab import engines
    from zerolab.grading.engine_model import STAGES

    files = set()
    for info in engines.ENGINES.values():
        module = info.target.partition(":")[0]
        files.add(_real(REPO / (module.replace(".", os.sep) + ".py")))
    for stage in STAGES.values():
        for cls in stage.engine.__mro__[:-1]:  # object aside
            files |= _class_files(cls)
    return frozenset(f for f in files if _inside(f, REPO / "zerolab")
                     and not _inside(f, REPO / "zerolab" / "grading"))


def _code_files(value: Any) -> set[str]:
    """The files the functions inside `value` (a function, a method, a classmethod or
    staticmethod, a property) were compiled from. type(), not isinstance(): no attribute of
    a learner's object is read, so none of its code runs here."""
    kind = type(value)
    if kind in (classmethod, staticmethod, types.MethodType):
        return _code_files(value.__func__)
    if kind is property:
        return set().union(*(_code_files(f) for f in (value.fget, value.fset) if f))
    if kind is not types.FunctionType:
        return set()
    wrapped = vars(value).get("__wrapped__")  # a decorator's wrapper (functools.wraps): the
    if wrapped is not None and wrapped is not value:  # code is the function it wraps
        return _code_files(wrapped)
    code = value.__code__
    return {_real(code.co_filename)} if type(code) is types.CodeType else set()


def _is_class(value: Any) -> bool:
    return issubclass(type(value), type)


def _mro(cls: type) -> tuple[type, ...]:
    return type.__dict__["__mro__"].__get__(cls)


def _class_files(cls: type) -> set[str]:
    """Where a class's own code lies: its methods' files; a class without methods, its
    module's file."""
    try:
        members = list(type.__dict__["__dict__"].__get__(cls).values())  # not a metaclass's
    except (KeyError, TypeError):
        members = []
    files = set().union(*(_code_files(v) for v in members))
    if not files:
        module = sys.modules.get(type.__dict__["__module__"].__get__(cls), None)
        path = getattr(module, "__file__", None) if type(module) is types.ModuleType else None
        files = {_real(path)} - {""} if isinstance(path, str) else set()
    return files


def _origin(files: Iterable[str], learner_file: str, engines: bool) -> str | None:
    """What of the reference these files are: "solutions/<file>", "zerolab's engine in
    <file>", "torch's engine in <file>"; None: none of them (the learner's own file is not)."""
    torch_dir = os.path.dirname(_real(torch.__file__))
    for path in sorted(files):
        if path == learner_file:
            continue
        if _inside(path, SOLUTIONS_DIR):
            return os.path.relpath(path, _real(REPO))
        if engines and path in _engine_files():
            return f"zerolab's engine in {os.path.relpath(path, _real(REPO))}"
        if engines and _inside(path, torch_dir):
            inner = os.path.relpath(path, torch_dir).replace(os.sep, "/")
            if inner.startswith(_TORCH_ENGINES):
                return f"torch's engine in torch/{inner}"
    return None


def _engine_class(cls: type, learner_file: str) -> str | None:
    if cls is object or getattr(cls, "_is_protocol", False):  # a Protocol holds no code
        return None
    return _origin(_class_files(cls), learner_file, engines=True)


def imports_solutions(source: str) -> str | None:
    """The first `import solutions...` or `from solutions... import` in a file's text: the
    statement, for the report; None if there is none (or the text does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        if any(n == "solutions" or n.startswith("solutions.") for n in names):
            return f"line {node.lineno}: {ast.unparse(node)}"
    return None


def in_module(module: types.ModuleType, answer: Any, learner_file: str, kind: str,
              modules_before: Iterable[str]) -> list[str]:
    """What of the reference the learner's module uses (see the module docstring), in words;
    [] when nothing. answer: the exercise's function or class; kind: the exercise's kind;
    modules_before: the names sys.modules held before the learner's file was imported."""
    mine = _real(learner_file)
    found = []
    before = set(modules_before)
    names = dict(vars(module))
    modules = [m for n, m in list(sys.modules.items()) if n not in before]
    modules += [v for v in names.values() if type(v) is types.ModuleType]
    imported = []
    for m in modules:
        path = getattr(m, "__file__", None) if type(m) is types.ModuleType else None
        where = _origin({_real(path)}, mine, engines=False) if isinstance(path, str) else None
        if where is not None:
            imported.append(where)
    if len(imported) > 1:  # solutions/__init__.py comes with any module of it: name the module
        imported = [w for w in imported if not w.endswith("__init__.py")] or imported[:1]
    found += [f"your code imports {where}" for where in imported]
    for name, value in names.items():
        files = _class_files(value) if _is_class(value) else _code_files(value)
        where = _origin(files, mine, engines=False)
        if where is not None:
            found.append(f"{name} comes from {where}")
    if kind == "engine" and _is_class(answer):
        for cls in _mro(answer):
            where = _engine_class(cls, mine)
            if where is not None:
                what = "is" if cls is answer else f"is built on {cls.__qualname__},"
                found.append(f"{answer.__qualname__} {what} {where}")
                break
    elif kind != "engine":
        where = _origin(_code_files(answer), mine, engines=False) or _zerolab(answer, mine)
        if where is not None:
            found.append(f"your answer is the function {answer.__name__} of {where}")
    return list(dict.fromkeys(found))  # once each, in order


def _zerolab(fn: Any, learner_file: str) -> str | None:
    """The function's file when it is zerolab's own (an answer renamed from the package)."""
    package = REPO / "zerolab"
    for path in _code_files(fn):
        if path != learner_file and _inside(path, package):
            return os.path.relpath(path, _real(REPO))
    return None


def forget_solutions(keep: Iterable[str]) -> None:
    """Take the modules loaded from solutions/ out of sys.modules (but the learners' files in
    `keep`): the references' (loaded by the grader before any learner code), and those a
    learner's file imported, so that the next file's import of one is seen as its own."""
    kept = {_real(path) for path in keep}
    solutions = _real(SOLUTIONS_DIR) + os.sep
    for name, m in list(sys.modules.items()):
        path = getattr(m, "__file__", None) if type(m) is types.ModuleType else None
        if isinstance(path, str) and (real := _real(path)).startswith(solutions) \
                and real not in kept:
            del sys.modules[name]


def in_engine(engine: Any, model: torch.nn.Module, learner_file: str) -> list[str]:
    """The reference engines a learner's engine holds (in its attributes, or in the lists,
    tuples and dicts they hold), and a model that torch's FSDP has wrapped, in words."""
    mine = _real(learner_file)
    found = []
    held = _engine_type(type(model), mine)
    if held is not None:
        found.append(f"the model became a {type(model).__qualname__}: {held}")
    try:
        values = list(object.__getattribute__(engine, "__dict__").items())
    except (AttributeError, TypeError):  # no __dict__ (slots): nothing to look into
        values = []
    for name, value in values:
        kind = type(value)
        inner = (list(value.values()) if kind is dict
                 else list(value) if kind in (list, tuple, set) else [value])
        held = next(filter(None, (_engine_type(type(item), mine) for item in inner)), None)
        if held is not None:
            found.append(f"your engine's {name} is a {held}")
    return found


def _engine_type(cls: type, learner_file: str) -> str | None:
    """The first class of cls's MRO that is a reference engine, and where it comes from."""
    for c in _mro(cls):
        where = _engine_class(c, learner_file)
        if where is not None:
            return f"{c.__qualname__}, {where}"
    return None
