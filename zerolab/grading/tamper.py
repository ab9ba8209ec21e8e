"""Whether a learner's code replaced a function the grader measures with.

In the learner's process the grader measures with torch, zerolab and its own code: what a
function returned, the collectives it issued (zerolab.comm), the memory it held
(zerolab.memory). The comparison itself happens in another process, out of reach; but a line
such as `zerolab.comm.record_comm = ...` or `torch.Tensor.clone = ...` would change what is
measured. So before the learner's file is imported, `snapshot()` notes every function, class
and module that the loaded modules hold (and the methods of the classes torch and zerolab
define, and each function's code object and defaults: `kinds.run.__code__ = ...` keeps the
function the same object), and `replaced(snapshot)` lists those that are no longer the same
object. Values that are not code (counters, caches) change as programs run, and are not
compared; nor are names added to a module since (a module imported later adds its own). A name
added to one of those classes is a change: it hides what the class inherited
(torch.Tensor.__eq__ = ...).

The check itself runs in the learner's process, after the learner's code: `sealed()` gives the
worker a copy of it made before, which names rebound since (of this module, of builtins) and
code objects swapped since do not reach.
"""

from __future__ import annotations

import builtins
import sys
import types
import warnings
from collections.abc import Callable
from itertools import chain, repeat
from operator import attrgetter, is_not

# module name -> (the module, its names bound to code, its functions' parts, its own classes:
# name -> (the class's names, its members that are code, their functions' parts))
Parts = tuple[object, object, object]  # a function's __code__, __defaults__, __kwdefaults__
Snapshot = dict[str, tuple[object, dict[str, object], dict[str, Parts],
                           dict[str, tuple[frozenset, dict[str, object], dict[str, Parts]]]]]

# What counts as code: replacing one of these changes what later calls do.
_CODE = frozenset((types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
                   types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodType,
                   classmethod, staticmethod, property))
_FUNCTION = types.FunctionType
_OWN_CLASSES = ("torch", "zerolab")  # whose classes' methods are snapshot too
_CACHES = {"__slotnames__"}  # names Python itself adds to a class (copyreg, on first pickle)
_PARTS = ("__code__", "__defaults__", "__kwdefaults__")  # what a function runs with
_parts_of = attrgetter(*_PARTS)
_MODULES = sys.modules  # the dict itself: a name rebound in sys does not hide it
_GONE = object()  # what a name that is gone holds
_catch_warnings, _simplefilter = warnings.catch_warnings, warnings.simplefilter


def _names(thing: object) -> dict:
    try:
        return vars(thing)
    except TypeError:  # an object posing as a module in sys.modules
        return {}


def _code(names: dict) -> tuple[dict[str, object], dict[str, Parts]]:
    """The names bound to code (type(), not isinstance(): no attribute of a value is read),
    and each function's parts: `fn.__code__ = ...` changes what a function runs and keeps it
    the same object."""
    code, parts = {}, {}
    for key, value in list(names.items()):
        kind = type(value)
        if kind in _CODE or issubclass(kind, type):
            code[key] = value
            if kind is _FUNCTION:
                parts[key] = (value.__code__, value.__defaults__, value.__kwdefaults__)
    return code, parts


def snapshot() -> Snapshot:
    """Every (module, name) bound to code now (and each function's code object and defaults),
    every method of torch's and zerolab's classes, and which object each module of sys.modules
    is. The objects themselves are kept (an id could be reused once its object is freed)."""
    found: Snapshot = {}
    with _catch_warnings():  # deprecated aliases warn when they are read
        _simplefilter("ignore")
        for name, module in list(_MODULES.items()):
            if module is None:
                continue
            code, parts = _code(_names(module))
            classes = {}
            if name.split(".")[0] in _OWN_CLASSES:
                for key, value in code.items():
                    if issubclass(type(value), type) and value.__module__ == name:
                        members = vars(value)
                        classes[key] = (frozenset(members), *_code(members))
            found[name] = (module, code, parts, classes)
    flat = _Snapshot(found)
    flat.flat = _flatten(found)
    return flat


class _Snapshot(dict):
    """A Snapshot, and the same objects in flat lists (`_flatten`)."""

    flat: tuple | None = None


def _flatten(found: Snapshot) -> tuple | None:
    """The snapshot's objects in flat lists, for `_unchanged`: every module and where it
    should be, every namespace (a module's dict, a class's mappingproxy), name and object
    bound to code there, every function and its parts, every class's names. None where a
    namespace is of another kind (the full walk then)."""
    names, modules, fns, parts, cls_names, cls_spaces = [], [], [], [], [], []
    bound: dict[type, tuple[list, list, list]] = {dict: ([], [], []),
                                                  types.MappingProxyType: ([], [], [])}

    def add(space: object, code: dict, code_parts: dict) -> bool:
        if type(space) not in bound:
            return False
        spaces, keys, values = bound[type(space)]
        spaces += [space] * len(code)
        keys += code
        values += code.values()
        fns.extend(map(code.__getitem__, code_parts))
        parts.extend(chain.from_iterable(code_parts.values()))
        return True

    for name, (module, code, code_parts, classes) in found.items():
        names.append(name)
        modules.append(module)
        if code and not add(_names(module), code, code_parts):
            return None
        for key, (members_names, members, member_parts) in classes.items():
            space = vars(code[key])
            cls_names.append(members_names)
            cls_spaces.append(space)
            if not add(space, members, member_parts):
                return None
    return names, modules, *bound[dict], *bound[types.MappingProxyType], fns, parts, \
        cls_names, cls_spaces


def _unchanged(flat: tuple) -> bool:
    """Whether nothing of a snapshot changed, compared by identity at C speed (the check runs
    after every task, over ~2,000 modules, and finds nothing almost always)."""
    names, modules, d_spaces, d_keys, d_values, p_spaces, p_keys, p_values, fns, parts, \
        cls_names, cls_spaces = flat
    return not (any(map(is_not, map(_MODULES.get, names), modules))
                or any(map(is_not, map(dict.get, d_spaces, d_keys, repeat(_GONE)), d_values))
                or any(map(is_not, map(types.MappingProxyType.get, p_spaces, p_keys,
                                       repeat(_GONE)), p_values))
                or any(map(is_not, chain.from_iterable(map(_parts_of, fns)), parts))
                or not all(map(frozenset.issuperset, cls_names, cls_spaces)))


def _parts_changed(where: str, fns: dict[str, object], parts: dict[str, Parts]) -> list[str]:
    # Each part compared by identity in C first, and named only if one differs: the check
    # runs after every task, over ~2,000 modules whose functions are almost all unchanged.
    if not any(map(is_not, chain.from_iterable(map(_parts_of, map(fns.__getitem__, parts))),
                   chain.from_iterable(parts.values()))):
        return []
    changed = []
    for key, old in parts.items():
        fn = fns[key]
        new = (fn.__code__, fn.__defaults__, fn.__kwdefaults__)
        changed += [f"{where}.{key}.{part}" for part, a, b in zip(_PARTS, old, new) if a is not b]
    return changed


def replaced(before: Snapshot) -> list[str]:
    """What of `before` is now another object, or gone: dotted names, sorted (a function whose
    code object or defaults were replaced: its name and the part, `...run.__code__`)."""
    flat = getattr(before, "flat", None)
    if flat is not None and _unchanged(flat):
        return []
    changed = []
    for name, (module, code, parts, classes) in before.items():
        if _MODULES.get(name) is not module:
            changed.append(f"sys.modules[{name!r}]")
        now = _names(module)
        if any(map(is_not, map(now.get, code, repeat(_GONE)), code.values())):  # (as above)
            changed += [f"{name}.{key}" for key, value in code.items()
                        if now.get(key, _GONE) is not value]
        changed += _parts_changed(name, code, parts)
        for key, (names, members, member_parts) in classes.items():
            cls_now = vars(code[key])
            where = f"{name}.{key}"
            changed += [f"{where}.{attr}" for attr in sorted(frozenset(cls_now) - names - _CACHES)]
            if any(map(is_not, map(cls_now.get, members, repeat(_GONE)), members.values())):
                changed += [f"{where}.{attr}" for attr, member in members.items()
                            if cls_now.get(attr, _GONE) is not member]
            changed += _parts_changed(where, members, member_parts)
    return sorted(changed)


def sealed() -> Callable[[Snapshot], list[str]]:
    """`replaced`, made now from its code objects with globals and builtins of its own: a
    learner's code that rebinds a name of this module or of builtins (sorted, type, ...), or
    swaps one of these functions' code, does not change what the sealed copy runs. Taken
    before any learner code runs, and kept by the caller."""
    private = dict(globals())
    private["__builtins__"] = dict(vars(builtins))
    for name in ("_names", "_code", "snapshot", "_flatten", "_unchanged", "_parts_changed",
                 "replaced"):
        fn = globals()[name]
        private[name] = types.FunctionType(fn.__code__, private, fn.__name__, fn.__defaults__,
                                           fn.__closure__)
    return private["replaced"]


# Note: the grader hidden. A learner's code that looks for the grader (`"zerolab.grading" in
# sys.modules`) could behave only while graded. So once the references ran, `hide_grader()`
# takes zerolab.grading's modules out of sys.modules and the package off `zerolab`: the worker
# keeps its own references to what it runs, and nothing of the grader is found by name. A
# learner's `import zerolab.grading.kinds` then loads fresh copies, which no measurement uses;
# `reimported(hidden)` still names what the learner's code changed in them (a function
# rebound, or its code swapped: compared by value with the grader's own copy), as an intent to
# change the grader's tools.


def hide_grader() -> dict[str, types.ModuleType]:
    """Take zerolab.grading's modules out of sys.modules (see the Note); they are returned."""
    hidden = {name: module for name, module in list(_MODULES.items())
              if name == "zerolab.grading" or name.startswith("zerolab.grading.")}
    for name in hidden:
        del _MODULES[name]
    parent = _MODULES.get("zerolab")
    if parent is not None and "grading" in _names(parent):
        delattr(parent, "grading")
    return hidden


def reimported(hidden: dict[str, types.ModuleType]) -> list[str]:
    """The functions of the grader's modules that a learner's code imported afresh and then
    rebound ("zerolab.grading.kinds.run") or changed (".__code__"), against the hidden copies."""
    found = []
    for name, fresh in list(_MODULES.items()):
        own = hidden.get(name)
        if own is None or fresh is own:
            continue
        names = _names(fresh)
        for key, value in list(_names(own).items()):
            if type(value) is not _FUNCTION:
                continue
            new = names.get(key, _GONE)
            if type(new) is not _FUNCTION or new.__qualname__ != value.__qualname__:
                found.append(f"{name}.{key}")
                continue
            found += [f"{name}.{key}.{part}" for part in _PARTS
                      if _plain(getattr(new, part)) != _plain(getattr(value, part))]
    return found


def _plain(value: object) -> object:
    """A function's part, comparable across two imports of a module: a function in it (a
    default such as measure_fn=measure) by its qualified name, since each import makes its own."""
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return ("function", value.__qualname__) if type(value) is _FUNCTION else value
