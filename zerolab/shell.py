"""The shell: the engine a torch user meets, whatever the stage inside it.

    model = zerolab.ZeRO2(model, torch.optim.AdamW, lr=3e-4)   # where torch writes DDP(model)
    optimizer = model.optimizer                                 # step() is the engine's step
    raw_model = model.module
    model.train(); logits = model(x); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

torch's DDP and FSDP2 are modules; so is every zerolab engine. What this file owns is torch's
contract, written once for every stage (ddp.py -> zero1.py -> zero2.py -> zero3.py hold only
their stage's hooks; zerolab/DESIGN.md has the hook table):

- forward, train()/eval(), `module`, `require_backward_grad_sync` (nanoGPT's way of saying
  no_sync()), and `state_dict()` / `load_state_dict()` with torch DDP's keys ("module.wte.
  weight"): full tensors, a collective under ZeRO-3, as FSDP2's full state dict;
- `parameters()` / `named_parameters()`: what this rank steps. DDP: every parameter, whole,
  whose `.grad` holds the average over ranks when backward returns (torch's DDP). ZeRO-1/2/3:
  this rank's shard of each flat bucket, as a DTensor (FSDP2 shows its shards the same way),
  whose `.grad` is the averaged gradient shard: torch's `clip_grad_norm_` takes the global norm
  of such gradients (the DTensor adds up the ranks' parts), and a user's own optimizer built
  over them steps this rank's shard (the next forward gathers the parameters again);
- the optimizer the engine built (`model.optimizer`, cache-sized tiles on a CPU): its step() is
  the engine's step (parts/habits.py routes it, and zero_grad()), with GradScaler's protocol;
- `clip_grad_norm_(max_norm)`, `no_sync()`, `full_state_dict()`, `model_state_bytes()`,
  `rank_state_dict()` (this rank's part, for torch.save per rank), `wait_params()`;
- refusals at the first wrong call, each naming the right one: a dtype or device change after
  wrapping, an optimizer that needs a closure or whole tensors, a torch optimizer stepping the
  wrapped model's own parameters where the engine shards them (parts/habits.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from zerolab import comm
from zerolab.parts.arguments import check_engine_arguments, check_optimizer, elementwise
from zerolab.parts.buffers import BufferSync, broadcast_coalesced
from zerolab.parts.clipping import clip_grad_norm_
from zerolab.parts.habits import (
    DSD_REFUSED,
    guard_user_optimizers,
    hook_dsd,
    hook_module_state,
    init_state_for_dsd,
    refuse_module_conversions,
    route_optimizer,
)
from zerolab.parts.materialize import broadcast_from_rank0, where
from zerolab.parts.mixed_precision import MixedPrecisionPolicy
from zerolab.parts.param_groups import ParamGroups
from zerolab.parts.rank_state import WHOSE, load_rank_state_dict, rank_state_dict
from zerolab.parts.shard_params import ShardParams
from zerolab.parts.state_dicts import load_engine_state_dict
from zerolab.parts.storages import model_state_bytes
from zerolab.parts.tiles import OptimizerTiles, default_tile_numel
from zerolab.parts.whole_params import WholeParams, refuse_group_optimizers
from zerolab.sharding import Bucket, Slot
from zerolab.units import Unit


class EngineShell(nn.Module):
    """torch's contract on every engine; the stage (ddp.py and its subclasses) fills in the
    hooks of DESIGN.md's table, called here in this order while the engine is built:
    _materialize, _make_buckets, _shard_model, _slots, then _hook_modules."""

    shards_params = False  # ZeRO-1/2/3: parameters() gives this rank's shards (DTensors)
    units: Sequence[Unit] = ()  # ZeRO-3's units (units.py); none in the other stages
    grads_in_buckets = True  # every .grad is a view into its bucket's flat_grad (not ZeRO-2/3)
    params_whole_at_rest = True  # every rank holds every parameter between steps (not ZeRO-3)
    steps_whole_params = True  # ZeRO-1/2/3: a matrix optimizer steps parameters whole (below)
    Options: type = object  # the stage's own options, a frozen dataclass (ddp.DDPOptions)

    def __init__(self, model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], *,
                 group: dist.ProcessGroup | None = None,
                 param_dtype: torch.dtype | None = None,
                 optimizer_tile_numel: int | None | Literal["auto"] = "auto",
                 param_groups: Sequence[dict[str, Any]] | None = None,
                 broadcast_buffers: bool = True, **kwargs: Any):
        super().__init__()  # nn.Module's: the engine is a module, as torch's DDP and FSDP2
        stage = {f.name for f in dataclasses.fields(self.Options)}
        self.options = self.Options(**{k: kwargs.pop(k) for k in list(kwargs) if k in stage})
        optimizer_kwargs = kwargs  # the rest: lr=..., betas=..., for the optimizer
        check_engine_arguments(model, optimizer_cls, optimizer_kwargs)
        check_optimizer(optimizer_cls, type(self).__name__,
                        self.shards_params and not self.steps_whole_params)
        # The context every hook reads: what to train, over which ranks, where.
        self.groups = ParamGroups.of(model, param_groups)  # which parameters share a bucket
        self.module = model  # registered: engine.train()/eval() reach it
        self.group = group
        self.job_group = group  # every rank of this training job (HSDP's spans several groups)
        self.rank, self.world_size, self.device = where(group)
        # Where a step stands.
        self._pending: list[tuple[comm.Handle, Callable[[], None] | None]] = []  # (in flight, then)
        self._backward_seen = False  # a gradient was accumulated since the last step
        self._grads_synced = False  # this step's gradients are reduced (step or clipping did it)
        self._sync = True  # False inside no_sync(): gradients accumulate locally, unreduced
        self._accumulated = 0  # trainable parameters whose gradient this backward accumulated
        self.stepping = False  # inside step(): the optimizer's own step() runs
        self.shard_params: ShardParams | None = None  # engine.parameters() under ZeRO
        # What each rank holds: the stage's hooks.
        self._materialize()  # a model built on the meta device gets its values here
        broadcast_from_rank0(model, group, tag=f"{self.name}/init")
        self.precision = MixedPrecisionPolicy(param_dtype)
        fp32_values = self.precision.cast_module(model)  # {} in fp32
        self.buckets = self._make_buckets()
        self._shard_model()
        self.slots = self._slots()  # what this rank holds and steps, by parameter run
        self.masters = self.precision.masters(self.slots, fp32_values, self.rank)
        # The optimizer steps the masters in cache-sized tiles on a CPU (tiles.py): same result,
        # for an elementwise optimizer; any other steps whole tensors (parts/arguments.py), and
        # on the sharded stages each parameter whole on one rank (parts/whole_params.py).
        if optimizer_tile_numel == "auto":
            optimizer_tile_numel = default_tile_numel(self.device)
        if not elementwise(optimizer_cls):
            optimizer_tile_numel = None
        self.tiles = OptimizerTiles(self.masters, optimizer_tile_numel)
        self.whole: WholeParams | None = None
        if self.shards_params and not elementwise(optimizer_cls):
            self.whole = WholeParams(self, optimizer_cls, optimizer_kwargs)
            self.optimizer = self.whole.optimizer
        else:
            refuse_group_optimizers(self.groups, type(self).__name__)
            self.optimizer = optimizer_cls(self.groups.optimizer_params(self.slots, self.tiles),
                                           **optimizer_kwargs)
        self.tiles.attach(self.optimizer, keep_grads=param_dtype is None)
        if self.shards_params:  # GradScaler hands its found_inf to step(): _scaler_allows_step
            self.optimizer._step_supports_amp_scaling = True
        # The hooks: gradients, forward, state dicts, the torch objects a user reaches.
        self._hook_gradients()
        self.buffer_sync = BufferSync.attach(self, broadcast_buffers)  # before each forward
        # First of all before a forward, ahead of the buffers' broadcast (and ZeRO-3's gathers):
        # what the last backward left to reduce (a branch this rank skipped; the Note below).
        self.module.register_forward_pre_hook(lambda m, a: self._end_last_backward(), prepend=True)
        self._hook_modules()
        self._hook_module_state()  # model.state_dict() and load_state_dict() (parts/habits.py)
        route_optimizer(self)  # optimizer.step(), .zero_grad(), model.zero_grad(): the engine's
        guard_user_optimizers(self)
        refuse_module_conversions(self)
        hook_dsd(self)  # get_state_dict(engine.module, engine.optimizer)
        # Final parameter objects (a meta model's were replaced), listed once for the tracker
        self._params = list(model.parameters())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.precision.forward(self.module, args, kwargs)

    # ---- backward: the gradient hooks, and its end ----------------------------------------------

    def _hook_gradients(self) -> None:
        """Each parameter's gradient hooks (the stage's), and one that sees a backward start
        (its end: the Note below)."""
        params = [p for b in self.buckets for p in b.params]
        for bucket in self.buckets:
            for p in bucket.params:
                if self.grads_in_buckets:  # before autograd adds into .grad (a tensor hook)
                    p.register_hook(functools.partial(self._grad_arriving, bucket, p))
                p.register_post_accumulate_grad_hook(
                    functools.partial(self._on_grad_accumulated, bucket))
        torch.autograd.graph.register_multi_grad_hook(params, self._backward_starts, mode="any")
        self._trainable = len(params)

    # Note: the end of backward. torch's DDP leaves every .grad averaged when backward returns,
    # so that anything reading them next (clip_grad_norm_, GradScaler.unscale_, a user's own
    # optimizer) reads what the ranks agree on. Each bucket is reduced by its last gradient's
    # hook; once every trainable parameter's gradient of this backward is accumulated (counted
    # from the backward's first gradient, a multi-grad hook), backward is over for them, and
    # the engine waits for the reductions backward started. (A multi-grad hook in mode "all"
    # would say which parameters a backward reaches, but it holds every gradient until the
    # last, and ZeRO-2 frees them as it goes.) A backward that leaves a parameter unused, or
    # one inside no_sync(), ends unsynced: whoever reads the gradients next (parameters(), an
    # optimizer's step, clip_grad_norm_, step()) reduces what is left first; so does the next
    # forward or backward, which communicate too (buffers, ZeRO-3's gathers, reductions).

    def _backward_starts(self, grad: torch.Tensor) -> None:
        """The first parameter gradient of a backward (multi-grad hook, mode "any")."""
        self._end_last_backward()
        self._count_afresh()  # the stage's
        if self.shard_params is None:
            return
        # A user's optimizer.zero_grad() over the shard parameters set their .grad to None:
        # that zeroes the engine's gradients, as it would torch's.
        zeroed = self.shard_params.user_zeroed()
        if zeroed is None:
            raise RuntimeError(f"{type(self).__name__}: some of engine.parameters() have their "
                               ".grad set to None and others not; zero them all "
                               "(optimizer.zero_grad()) or none.")
        if zeroed:
            self.zero_grad()

    def _end_last_backward(self) -> None:
        """Before this rank communicates again: a forward (buffers, gathers), a backward."""
        if self._accumulated:  # the last backward did not reach every parameter
            self._reduce_rest()  # what it left in the reduction order (ddp.py's Note)
            self._accumulated = 0

    def _on_grad_accumulated(self, bucket: Bucket, param: nn.Parameter) -> None:
        # Fires once per backward, after autograd summed every use of param (tied, reused).
        self._backward_seen = True
        self._grads_synced = False
        self._grad_accumulated(bucket, param)  # the stage's
        self._accumulated += 1
        self._maybe_backward_done()

    def _maybe_backward_done(self) -> None:
        if self._accumulated == self._trainable:
            self._accumulated = 0
            # Finish what backward started: reduce what is left, wait (.grad averaged on
            # return). The after-backward variants (ddp.py's DDPAfterBackward, ...) start no
            # reduction in backward: theirs all run in step(), as those lessons time them.
            if self._sync and self._pending:
                self._sync_grads()

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> None:
        """Finish gradient synchronisation, step the optimizer, then re-sync what needs it
        (the stage's _after_step). engine.optimizer.step() is this too (parts/habits.py)."""
        self._sync_grads()
        if self._scaler_allows_step():
            pairs = [(master, slot.tensor) for master, slot in zip(self.masters, self.slots)]
            # GradScaler's found_inf and grad_scale were for the engine (_scaler_allows_step):
            # torch's optimizers would read them as meant for their own fused kernels.
            scaler = {k: self.optimizer.__dict__.pop(k) for k in ("grad_scale", "found_inf")
                      if k in self.optimizer.__dict__}
            self.stepping = True
            try:
                (self.whole or self.precision).step(self.optimizer, pairs)
            finally:
                self.stepping = False
                self.optimizer.__dict__.update(scaler)
            self._after_step()
        self._backward_seen = self._grads_synced = False

    # ---- gradient synchronisation -------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside the block communicate nothing; the
        first backward after it reduces the sum of every micro-batch (scale each loss by
        1/micro_batches for the mean, as with torch's DDP.no_sync()). Meanwhile gradients add
        up locally: ZeRO-2 and ZeRO-3 keep full ones, trading memory for traffic. Without it,
        each backward reduces its own gradients and step() takes their sum, as torch's DDP."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's flag (nanoGPT sets it per micro-step): False is no_sync()."""
        return self._sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._sync = bool(value)

    def _sync_grads(self) -> None:
        """Every gradient reduced and in place: the optimizer's and the user's views of it."""
        if not self._grads_synced:
            self._finish_backward()
            self._accumulated = 0  # nothing is left for the next backward to reduce
        self._grads_synced = True
        self.tiles.bind_grads()  # GradScaler.unscale_(optimizer) reads the optimizer's .grad
        if self.shard_params is not None:
            self.shard_params.bind_grads()

    def _scaler_allows_step(self) -> bool:
        """torch's GradScaler under ZeRO. Each rank holds a shard of the gradients, so an inf
        found on one rank is not found on the others, and a scaler that skipped the step there
        alone would leave the ranks apart. So the sharded engines take GradScaler's protocol
        for optimizers that handle scaling themselves (`_step_supports_amp_scaling`: the scaler
        calls step() on every rank, handing over `grad_scale` and `found_inf`): the engine
        unscales if the user did not, and the ranks agree before stepping. DDP's gradients are
        the same on every rank: GradScaler's usual path is right there."""
        found_inf = getattr(self.optimizer, "found_inf", None)
        if found_inf is None:  # no GradScaler (or DDP's, which decided already)
            return True
        scale = getattr(self.optimizer, "grad_scale", None)
        if scale is not None:  # not unscaled yet (no scaler.unscale_(optimizer) before step)
            inv = scale.double().reciprocal().float()
            for g in self._owned_grads():
                g.mul_(inv)
        found = torch.tensor([float(found_inf) > 0, 1.0])  # (found on this rank, one rank)
        if self.world_size > 1:
            comm.all_reduce(found, tag=f"{self.name}/step/found_inf", group=self.group)
        if 0 < found[0] < found[1]:
            raise RuntimeError(
                f"{type(self).__name__} with GradScaler: {int(found[0])} of {int(found[1])} ranks "
                f"found inf or NaN in their gradient shards. Every rank skips this step, but "
                f"GradScaler.update() lowers the scale only where it found them, and the ranks' "
                f"scales would part. Train in bfloat16 (param_dtype=torch.bfloat16 or autocast "
                f"to bfloat16, which needs no scaler), or use zerolab.DDP with GradScaler.")
        return found[0] == 0

    def shards_stepped_outside(self) -> None:
        """A user's optimizer stepped engine.parameters() (this rank's shards): the step is
        done, so re-sync the parameters as step() would (ZeRO-1/2 all-gather them)."""
        self.resync_params()
        self._backward_seen = self._grads_synced = False

    def resync_params(self) -> None:
        """The shards changed outside step() (a user's optimizer, a load): every rank's
        parameters from them again (the stage's _after_step: ZeRO-1/2 all-gather)."""
        self._after_step()

    @property
    def backward_seen(self) -> bool:
        """A backward accumulated gradients since the last step."""
        return self._backward_seen

    def sync_if_backward(self) -> None:
        """Reduce a finished backward's gradients now, unless inside no_sync()."""
        if self._backward_seen and self._sync and not self._grads_synced:
            self._sync_grads()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so that their global L2 norm is at most max_norm; return the
        norm before clipping (as torch.nn.utils.clip_grad_norm_). Between backward and step.
        torch.nn.utils.clip_grad_norm_(engine.parameters(), max_norm) does the same."""
        self._sync_grads()
        return clip_grad_norm_(self._owned_grads(), max_norm, self._sum_over_ranks)

    def _owned_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer reads. DDP: all of them, identical on all ranks."""
        return [b.flat_grad for b in self.buckets]

    def _sum_over_ranks(self, local: torch.Tensor) -> torch.Tensor:
        """DDP: every rank holds the whole gradient: its sum is already the global one."""
        return local

    # ---- what a torch user reaches: parameters, conversions ------------------------------------

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """DDP: the model's parameters ("module.<name>", torch DDP's names). ZeRO-1/2/3: the
        shards this rank steps, one DTensor per flat bucket ("module.<bucket>": parts/
        shard_params.py), as FSDP2 gives each rank's shards."""
        self.sync_if_backward()  # whoever reads .grad next reads the reduced gradients
        if not self.shards_params:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)
            return
        if not recurse:  # the engine's own: none (its shards stand for the module's)
            return
        if self.shard_params is None:
            self.shard_params = ShardParams.of(self)
            self.shard_params.bind_grads()
        for name, p in self.shard_params.named():
            yield (f"{prefix}.{name}" if prefix else name), p

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict (get_state_dict, set_state_dict) asks every
        module for this first: a sharded engine refuses there, DDP makes its optimizer's state
        (parts/habits.py, the Note on DSD)."""
        if self.shards_params:
            raise RuntimeError(DSD_REFUSED.format(type(self).__name__))
        init_state_for_dsd(self)
        return {}

    def _apply(self, fn, recurse: bool = True):
        refuse_conversion(self, fn)
        return super()._apply(fn, recurse)

    def frozen_slots(self) -> list[Slot]:
        """Parameters that are never trained: held whole on every rank."""
        return [Slot(p, (p,), None) for p in self.module.parameters() if not p.requires_grad]

    def _hook_module_state(self) -> None:
        """model.state_dict() and model.load_state_dict() under the engine (parts/habits.py)."""
        hook_module_state(self)

    def model_state_bytes(self) -> dict[str, int]:
        """This rank's bytes held now for params, grads and optimizer state (distinct storages)."""
        return model_state_bytes(self.state_tensors())

    def wait_params(self) -> None:
        """Return once every parameter holds its latest value (DDP: always; ZeRO-1/2 with
        prefetch=True gather them asynchronously after step()). Checkpoints call it first."""

    # ---- state dicts -----------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters and buffers, on every rank: a collective in the sharded stages, and
        where buffers are broadcast (rank 0's buffers, as the next forward would make them)."""
        state = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if self.buffer_sync.enabled:
            broadcast_coalesced([state[n] for n, _ in self.module.named_buffers() if n in state],
                                self.job_group, f"{self.name}/state_dict/buffers")
        return state

    # Note: three forms of state. engine.state_dict() is torch DDP's: the model's full tensors
    # under "module." (a collective under ZeRO-3, as FSDP2's full state dict), and
    # engine.module.state_dict() the same without the prefix (parts/habits.py). engine.
    # rank_state_dict() is this rank's part of the model and the optimizer, for torch.save per
    # rank and a load at the same world size; zerolab.checkpoint.save(engine, folder) writes
    # torch.distributed.checkpoint's form, which loads at any world size.

    def rank_state_dict(self) -> dict:
        """This rank's part of the model and the optimizer, copied: {"model": {key: a tensor,
        or {"shape", "dtype", "pieces": [(offsets, tensor)]}}, "optimizer": {"state": ..,
        "param_groups": ..}}, keyed like the plain model (parts/state_dicts.py). No collective.
        torch.save(engine.rank_state_dict(), f"rank{rank}.pt") on every rank, then
        engine.load_state_dict(torch.load(...)) at the same world size."""
        return rank_state_dict(self)

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """torch DDP's form ("module."-prefixed: what engine.state_dict() gave), this rank's
        part (rank_state_dict()), or a full state dict ({"model": a plain model's
        state_dict(), "optimizer": optional, torch's keys}, e.g. zerolab.checkpoint.consolidate's):
        every rank takes its own part of it."""
        if WHOSE in state_dict:  # a rank's part says whose it is
            return load_rank_state_dict(self, state_dict)
        if "model" in state_dict and isinstance(state_dict["model"], dict):
            return load_engine_state_dict(self, state_dict)
        return super().load_state_dict(state_dict, strict, assign)


def refuse_conversion(engine: EngineShell, fn) -> None:
    """model.double(), .to(dtype), .half(), .cuda() after wrapping: the engine laid out its
    buffers, views and optimizer for the dtype and device it was built with. A conversion that
    changes nothing (.float() of an fp32 model, .to("cpu") on a CPU) passes."""
    probe = next((t for t in engine.module.parameters() if t.is_floating_point()), None)
    if probe is None:
        return
    after = fn(probe.detach())
    if after.dtype != probe.dtype or after.device != probe.device:
        raise TypeError(
            f"{type(engine).__name__}: the model was converted to {after.dtype} on {after.device} "
            f"after wrapping, but the engine built its buffers, shards and optimizer for "
            f"{probe.dtype} on {probe.device}. Convert the model before wrapping it "
            f"(model.to(...), then {type(engine).__name__}(model, ...)), or train in 16 bits "
            f"with param_dtype=torch.bfloat16.")
