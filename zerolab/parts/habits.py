"""What torch users do to a model and its optimizer, made to reach the engine that wraps them.

A torch user's loop zeroes gradients through the model or the optimizer, and reads or loads
the model's state dict; torch's DDP and FSDP2 accept all of it. Under an engine the model's
parameters, their gradients and the optimizer's tensors are laid out by the engine, so each of
these habits is routed to it here:

- `route_optimizer`: `model.zero_grad()` and `engine.optimizer.zero_grad()` become
  `engine.zero_grad()` (the Note below), `engine.optimizer.step()` becomes `engine.step()`;
- `guard_user_optimizers`: a torch optimizer of the user's over the engine's shards works, one
  over the sharded model's own parameters is refused (the second Note);
- `refuse_module_conversions`: `model.double()` after wrapping is refused;
- `hook_module_state`: `model.state_dict()` waits for parameters still being gathered (ZeRO-1/2
  with prefetch=True), and so does `model.load_state_dict(...)`, after which the fp32 masters
  of a mixed-precision engine take the loaded values;
- `hook_gathered_state` (ZeRO-3): `model.state_dict()` gathers full tensors, and
  `model.load_state_dict(full)` loads them into this rank's shards (the third Note).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from zerolab.parts.arguments import elementwise
from zerolab.sharding import shard

if TYPE_CHECKING:  # the engine contract: the shell (a cycle at run time)
    from zerolab.shell import EngineShell

# Note: zeroing gradients, three spellings. torch users zero through the model
# (`model.zero_grad()`, which sets every `.grad` to None), through the optimizer
# (`optimizer.zero_grad()`, the same on the optimizer's tensors) or through the engine. The
# engine's gradients are none of those tensors: DDP and ZeRO-1 keep them in flat buckets
# (`.grad` are views into them), ZeRO-2 and ZeRO-3 in per-bucket shards that no `.grad` of the
# model shows, the optimizer steps tiles of fp32 masters. Setting a `.grad` to None zeroes
# nothing there, and the next backward adds onto the last step's gradients. So the engine
# installs its own zero_grad as the model's and the optimizer's (as torch's LR schedulers wrap
# `optimizer.step`): all three spellings zero the same buffers, in place, and keep them (their
# bytes stay counted; `set_to_none` is accepted and means the same). A copy of the model
# (copy.deepcopy) gets torch's own zero_grad back. What no method call reaches: `p.grad = None`
# by hand. DDP and ZeRO-1 notice it, as torch's DDP does, when that parameter's next gradient
# arrives (its `.grad` is no longer the view into the bucket: ddp.py, `_grad_arriving`).
# ZeRO-2/3 hold no full `.grad` between steps, so there is nothing to set to None: the next
# backward adds to the last step's gradients, as torch's would had nothing zeroed them, and the
# engine warns that it does, naming the calls that zero (zero2.py, NOT_ZEROED).


def route(engine: EngineShell, obj: Any, name: str, method: Callable[..., Any]) -> None:
    """Make obj.name(...) call method(engine, obj, ...) while obj is the engine's own (its
    module or optimizer); a deep copy of obj, or obj after the engine is gone, gets torch's
    method back. Bound to obj itself, so that copy.deepcopy binds the copy's to the copy; the
    engine held weakly, so that the model does not keep it alive."""
    ref = weakref.ref(engine)
    torch_method = getattr(type(obj), name)

    def routed(self: Any, *args: Any, **kwargs: Any) -> Any:
        e = ref()
        if e is None or self not in (e.module, e.optimizer):
            return torch_method(self, *args, **kwargs)
        return method(e, self, *args, **kwargs)

    setattr(obj, name, types.MethodType(routed, obj))


def route_optimizer(engine: EngineShell) -> None:
    """Make engine.module.zero_grad(), engine.optimizer.zero_grad() and engine.optimizer.step()
    the engine's; engine.optimizer.state_dict() refuses where one rank's cannot resume."""

    def zero_grad(e: EngineShell, obj: Any, set_to_none: bool = True) -> None:
        e.zero_grad(set_to_none)

    def step(e: EngineShell, optimizer: torch.optim.Optimizer, closure=None, **kwargs) -> Any:
        if e.stepping:  # the engine's own call, from inside engine.step()
            return type(optimizer).step(optimizer, closure, **kwargs)
        if closure is not None:
            raise TypeError(f"{type(e).__name__}.optimizer.step(closure): the engine reduces "
                            "gradients in backward and steps once; an optimizer that calls a "
                            "closure to re-evaluate the loss (LBFGS) is not supported. Call "
                            "loss.backward(), then optimizer.step() with no argument.")
        e.step()

    def state_dict(e: EngineShell, optimizer: torch.optim.Optimizer) -> dict:
        if e.shards_params and e.world_size > 1:
            raise RuntimeError(ONE_RANKS_STATE.format(type(e).__name__))
        return type(optimizer).state_dict(optimizer)

    route(engine, engine.module, "zero_grad", zero_grad)
    route(engine, engine.optimizer, "zero_grad", zero_grad)
    route(engine, engine.optimizer, "step", step)
    route(engine, engine.optimizer, "state_dict", state_dict)


RESUME = (
    "Save every rank's part with zerolab.checkpoint.save(engine, folder) (any world size on "
    "load), or torch.save(engine.rank_state_dict(), f'rank{{rank}}.pt') on every rank (the same "
    "world size); model.module.state_dict() (a collective under ZeRO-3) holds the full weights.")
ONE_RANKS_STATE = (
    "{0}.optimizer.state_dict(): this rank's optimizer holds the state of its own shards only, "
    "which cannot resume the other ranks (torch's ZeroRedundancyOptimizer refuses it too, and "
    "torch.distributed.checkpoint.state_dict.get_state_dict calls it). " + RESUME)
# Note: torch's get_state_dict(model, optimizer) keys the optimizer's state by the parameters
# it steps, named by model.named_parameters(): FSDP2's optimizer steps the model's own DTensor
# parameters. A ZeRO engine's optimizer steps flat shards that run through several parameters,
# which no name of the model's stands for: torch's code would fail on them (KeyError: 0), so
# the engine refuses first. (DDP's optimizer steps the parameters themselves: it works.)
# DSD gives a fresh optimizer its state (one step at lr 0 on zero gradients) where no parameter
# has a .grad, so that a load has tensors to fill; DDP's parameters always have one (views of
# its buckets, zero before any backward), so DSD would skip it and a resumed engine would start
# without Adam's moments, silently. The engine does what DSD would, when DSD asks for
# `_fqn_modifiers` (its first question to every module): of the engine, or of engine.module.


def init_state_for_dsd(engine: EngineShell) -> None:
    optimizer = engine.optimizer
    if optimizer.state or engine.backward_seen:  # a step made it, or gradients are not zero
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    type(optimizer).step(optimizer)  # torch's step: engine.step() would want a backward first
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr


def hook_dsd(engine: EngineShell) -> None:
    """engine.module._fqn_modifiers: DSD's first question, answered by the engine's."""
    ref = weakref.ref(engine)

    def fqn_modifiers(self: nn.Module) -> dict[str, str]:
        e = ref()
        return e._fqn_modifiers() if e is not None and self is e.module else {}  # not a copy

    # an instance attribute (no state dict sees it), bound as route() binds its methods
    engine.module._fqn_modifiers = types.MethodType(fqn_modifiers, engine.module)


DSD_REFUSED = (
    "torch.distributed.checkpoint.state_dict's get_state_dict/set_state_dict({0}, ...): {0}'s "
    "optimizer steps flat shards that cut parameters apart, which torch's code cannot key by "
    "the model's parameter names. " + RESUME)


# Note: a torch optimizer the user builds. torch's DDP averages every .grad before backward
# returns, so any optimizer over the model's parameters takes the right step; FSDP2 shards
# the parameters themselves, so an optimizer over model.parameters() steps this rank's shards.
# Under zerolab's ZeRO-1/2/3 the model's own parameters are not what the ranks agree on: their
# .grad is stale (ZeRO-1), None (ZeRO-2) or their values 0-element (ZeRO-3). An optimizer over
# them would step silently wrong, so any optimizer's step over them is refused, naming the
# calls that work: engine.optimizer, or an optimizer over engine.parameters() (the shards,
# shard_params.py), after whose step the next forward gathers the parameters again. torch runs
# hooks registered with register_optimizer_step_pre_hook/post_hook around every optimizer's
# step; the engine's own optimizer is let through at once.


def guard_user_optimizers(engine: EngineShell) -> None:
    """Refuse torch optimizers stepping what the engine shards; note those stepping its shards."""
    ref = weakref.ref(engine)
    module_params = {id(p) for p in engine.module.parameters()}

    def reached(e: EngineShell, optimizer: torch.optim.Optimizer) -> tuple[bool, bool]:
        """(it steps the model's own parameters, it steps the engine's shard parameters)"""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        shards = e.shard_params is not None and not ids.isdisjoint(e.shard_params.ids)
        return not ids.isdisjoint(module_params), shards

    def before(optimizer, args, kwargs) -> None:
        e = ref()
        if e is None or optimizer is e.optimizer:
            return
        model, shards = reached(e, optimizer)
        if model or shards:
            e.sync_if_backward()  # gradients reduced before anyone steps on them
        if model and e.shards_params:
            raise RuntimeError(WRONG_PARAMS.format(type(e).__name__))
        if shards and not elementwise(type(optimizer)):
            raise TypeError(OWN_MATRIX_OPTIMIZER.format(type(e).__name__,
                                                        type(optimizer).__name__))
        if shards and e.precision.param_dtype is not None:
            raise RuntimeError(f"{type(e).__name__}(param_dtype=...): the engine's optimizer "
                               "steps fp32 masters of the 16-bit shards; step it "
                               "(engine.optimizer.step()), not an optimizer of yours.")
        if shards:
            e.wait_params()

    def after(optimizer, args, kwargs) -> None:
        e = ref()
        if e is not None and optimizer is not e.optimizer and reached(e, optimizer)[1]:
            e.shards_stepped_outside()

    handles = [register_optimizer_step_pre_hook(before),
               register_optimizer_step_post_hook(after)]
    weakref.finalize(engine, lambda: [h.remove() for h in handles])


WRONG_PARAMS = (
    "a torch optimizer is stepping the parameters of a model wrapped by {0}, which shards "
    "them: their .grad is not the average over ranks (or is None), and a step would train "
    "each rank differently. Step the engine's optimizer (engine.optimizer.step(), or "
    "scaler.step(engine.optimizer)), or build yours over the engine's parameters, this rank's "
    "shards: torch.optim.AdamW(engine.parameters(), ...), as with FSDP2.")


OWN_MATRIX_OPTIMIZER = (
    "{1} over {0}'s engine.parameters() steps this rank's flat 1-D shards, which cut the "
    "matrices apart: a matrix optimizer's moments or orthogonalised update would differ from "
    "one process's without a word. Let the engine build it, stepping each parameter whole on "
    "one rank: zerolab.{0}(model, torch.optim.{1}, lr=...) (parts/whole_params.py). (torch's "
    "Muon refuses 1-D shards itself, when it is built.)")


def refuse_module_conversions(engine: EngineShell) -> None:
    """model.double(), model.to(dtype) on the wrapped model itself: refused as on the engine."""
    from zerolab.shell import refuse_conversion

    def apply(e: EngineShell, module: nn.Module, fn, recurse: bool = True) -> nn.Module:
        refuse_conversion(e, fn)
        return nn.Module._apply(module, fn, recurse)

    route(engine, engine.module, "_apply", apply)


def hook_module_state(engine: EngineShell) -> None:
    """model.state_dict() and model.load_state_dict() on the whole model, under any engine:
    wait for parameter gathers in flight first; after a load, the masters follow."""
    model = engine.module

    def wait(module: nn.Module, *args) -> None:
        if module is model:  # not a copy of it (copy.deepcopy copies hooks too)
            engine.wait_params()

    def reload(module: nn.Module, incompatible_keys) -> None:
        if module is model:
            engine.precision.reload([(m, s.tensor) for m, s in zip(engine.masters, engine.slots)])

    model.register_state_dict_pre_hook(wait)
    model.register_load_state_dict_pre_hook(wait)
    model.register_load_state_dict_post_hook(reload)


# Note: model.state_dict() under ZeRO-3. At rest a rank holds only shards: every parameter of
# the module is a 0-element tensor, and torch.save(model.state_dict()) would write nothing
# useful without a word. So each module's state_dict gathers the units it needs first (an
# all-gather: a collective, so every rank calls it, as with FSDP2's get_model_state_dict), and
# its entries are copied out before the unit is freed again: full tensors, every rank the same,
# which torch.save and torch.load round-trip and a plain model loads. One unit is gathered at a
# time (the root first, then each block as the recursion reaches it). model.load_state_dict(
# full) does the reverse: gather (so that keys left out keep their values), let torch copy the
# full tensors in, keep this rank's shard of each, free the rest. A module handles the units
# its parameters belong to, except units whose modules lie strictly inside it (their own hooks
# handle those): the model itself handles the root unit, a block its own unit, and a
# submodule of a block its block's unit when called alone.


def hook_gathered_state(engine: EngineShell) -> None:
    """ZeRO-3: full tensors from model.state_dict() (and any submodule's); full tensors loaded
    into the shards by model.load_state_dict(). Both are collectives (the Note above)."""
    units_of = _units_handled(engine)
    opened: dict[int, list] = {}  # id(module) -> the units its pre-hook gathered

    def open_units(module: nn.Module, phase: str) -> None:
        units = [u for u in units_of.get(module, []) if not u.unsharded]  # [] for a copy
        for u in units:
            engine.unshard(u, phase)
        opened[id(module)] = units

    def copy_out(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
        units = opened.pop(id(module), [])
        storages = {b.flat_param.untyped_storage().data_ptr() for u in units for b in u.buckets}
        copies: dict[tuple, torch.Tensor] = {}  # a tied weight under two names: one copy
        for name, value in state_dict.items():
            if name.startswith(prefix) and torch.is_tensor(value) and \
                    value.untyped_storage().data_ptr() in storages:
                key = (value.data_ptr(), value.shape)
                state_dict[name] = copies.setdefault(key, value.detach().clone())
        for u in units:
            engine.reshard(u)

    def keep_shards(module: nn.Module, incompatible_keys) -> None:
        for u in opened.pop(id(module), []):
            for b in u.buckets:  # this rank's part of what torch copied into the full buffer
                b.local_shard.data.copy_(shard(b.flat_param, b.layout, engine.rank))
            engine.reshard(u)

    for module in units_of:
        module.register_state_dict_pre_hook(
            lambda m, prefix, keep_vars: open_units(m, "state_dict"))
        module.register_state_dict_post_hook(copy_out)
        module.register_load_state_dict_pre_hook(lambda m, *args: open_units(m, "load"))
        module.register_load_state_dict_post_hook(keep_shards)


def _units_handled(engine: EngineShell) -> dict[nn.Module, list]:
    """{module: the units its state-dict hooks gather} for every module that has some."""
    unit_of = {p: i for i, u in enumerate(engine.units) for p in u.params}  # -> unit index
    out = {}
    for m in engine.module.modules():
        inside = {id(d) for d in m.modules() if d is not m}  # the modules strictly inside m
        owned = dict.fromkeys(unit_of[p] for p in m.parameters() if p in unit_of)
        units = [engine.units[i] for i in owned
                 if not all(id(um) in inside for um in engine.units[i].modules)]
        if units:
            out[m] = units
    return out


def keep_last(module: nn.Module, hook: Callable[..., Any]) -> None:
    """Register `hook` as a forward hook of `module` that stays its last one: a forward hook a
    user registers on the module later runs before it. torch runs forward hooks in the order
    they were registered, so ZeRO-3's post_forward (which frees the unit's full weights) would
    otherwise run before a hook added after wrapping, which would see 0-element weights; FSDP2's
    user sees what the forward computed with, and so does this one. Forward pre-hooks need
    nothing: the engine's (unshard) was registered first and runs first."""
    torch_register = type(module).register_forward_hook
    handle = [torch_register(module, hook)]

    def register(self: nn.Module, user_hook: Callable[..., Any], *args: Any, **kwargs: Any):
        added = torch_register(self, user_hook, *args, **kwargs)
        if self is module:  # not a copy of it (copy.deepcopy rebinds this method to the copy)
            handle[0].remove()
            handle[0] = torch_register(self, hook)  # registered again: last
        return added

    module.register_forward_hook = types.MethodType(register, module)
