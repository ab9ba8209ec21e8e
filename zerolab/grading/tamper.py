"""Whether a learner's code replaced a function the grader measures with.

In the learner's process the grader measures with torch, zerolab and its own code: what a
function returned, the collectives it issued (zerolab.comm), the memory it held
(zerolab.memory). The comparison itself happens in another process, out of reach; but a line
such as `zerolab.comm.record_comm = ...` or `torch.Tensor.clone = ...` would change what is
measured. So before the learner's file is imported, `snapshot()` notes every function, class
and module that the loaded modules hold (and the methods of the classes torch and zerolab
define), and `replaced(snapshot)` lists those that are no longer the same object. Values that
are not code (counters, caches) change as programs run, and are not compared; nor are names
added to a module since (a module imported later adds its own). A name added to one of those
classes is a change: it hides what the class inherited (torch.Tensor.__eq__ = ...).
"""

from __future__ import annotations

import sys
import types
import warnings

Snapshot = dict[tuple[str, ...], object]

# What counts as code: replacing one of these changes what later calls do.
_CODE = (types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
         types.MethodDescriptorType, types.WrapperDescriptorType, types.MethodType,
         classmethod, staticmethod, property)
_OWN_CLASSES = ("torch", "zerolab")  # whose classes' methods are snapshot too
_CACHES = {"__slotnames__"}  # names Python itself adds to a class (copyreg, on first pickle)


def _is_code(value: object) -> bool:
    kind = type(value)  # type(), not isinstance(): no attribute of the value is read
    return kind in _CODE or issubclass(kind, type)


def _module_dict(module: object) -> dict:
    try:
        return dict(vars(module))
    except TypeError:  # an object posing as a module in sys.modules
        return {}


def snapshot() -> Snapshot:
    """Every (module, name) bound to code now, every method of torch's and zerolab's classes,
    and which object each module of sys.modules is. The objects themselves are kept (an id
    could be reused once its object is freed)."""
    found: Snapshot = {}
    with warnings.catch_warnings():  # deprecated aliases warn when they are read
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if module is None:
                continue
            found[("sys.modules", name)] = module
            own = name.split(".")[0] in _OWN_CLASSES
            for key, value in _module_dict(module).items():
                if not _is_code(value):
                    continue
                found[(name, key)] = value
                if own and issubclass(type(value), type) and value.__module__ == name:
                    found[(name, key, "")] = frozenset(vars(value))  # its names, to see added ones
                    for attr, member in vars(value).items():
                        if _is_code(member):
                            found[(name, key, attr)] = member
    return found


def replaced(before: Snapshot) -> list[str]:
    """What of `before` is now another object, or gone: dotted names, sorted."""
    now = snapshot()
    changed = []
    for key, value in before.items():
        if key[-1] == "":  # a class's names: any new one
            added = sorted(now.get(key, value) - value - _CACHES)
            changed += [".".join((*key[:-1], name)) for name in added]
        elif now.get(key) is not value:
            changed.append(f"sys.modules[{key[1]!r}]" if key[0] == "sys.modules"
                           else ".".join(key))
    return sorted(changed)
