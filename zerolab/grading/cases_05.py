"""Notebook 05's exercises (ex05_zero3): unshard a unit on ranks, and really free it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zerolab.grading.exercise import Args, BadReturn, Case, Exercise
from zerolab.grading.inputs import SHAPE_GROUPS, shards_of, tensors_of
from zerolab.grading.mistakes import DTYPE_LOST, Evidence, Mistake, cut, matches
from zerolab.grading.storage import held_bytes, shares_memory, storage_id, storage_sizes
from zerolab.sharding import FlatLayout, flatten


def _cases_5_1(n: int) -> list[Case]:
    def make(name: str, dtype: torch.dtype) -> Callable[[int], tuple]:
        shapes = SHAPE_GROUPS[name]
        tensors = [t.to(dtype) for t in tensors_of(("5.1", name), shapes)]
        return lambda rank: (shards_of(tensors, n)[rank], [torch.Size(s) for s in shapes])
    return [Case(name, make(name, torch.float32)) for name in SHAPE_GROUPS] + [
        Case("numels 6, 3, 1 in float64", make("numels 6, 3, 1", torch.float64)),
        Case("shapes (2, 3), (5,) in bfloat16", make("shapes (2, 3), (5,)", torch.bfloat16))]


def _outputs_5_1(result: Any, args: tuple) -> dict[str, Any]:
    if not isinstance(result, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) for t in result):
        raise BadReturn(f"expected a list of tensors, got {type(result).__name__}")
    shared = any(shares_memory(t, [args[0]]) for t in result)
    return {"result": list(result),
            "memory": "views of local_shard" if shared else "not local_shard's memory",
            "storages (bytes each)": storage_sizes(list(result))}


def _gathered(ev: Evidence, **wrong: bool) -> list[torch.Tensor]:
    """5.1's tensors cut from every rank's shard (`wrong`: see mistakes.cut)."""
    flat = torch.cat([ev.inputs(r)[0] for r in range(ev.world_size)])
    return cut(flat, ev.inputs()[1], **wrong)


def _cases_5_2() -> list[Case]:
    def make(name: str, n: int, forward: bool, dtype: torch.dtype) -> Callable[[int], tuple]:
        def args(rank: int) -> tuple:
            tensors = [t.to(dtype) for t in tensors_of(("5.2", name), SHAPE_GROUPS[name])]
            layout = FlatLayout.of(tensors, n)
            flat = flatten(tensors, layout)
            params = [nn.Parameter(flat[o:o + t.numel()].view(t.shape))
                      for o, t in zip(layout.offsets, tensors)]
            kept: dict[str, Any] = {"storage": storage_id(flat.untyped_storage())}
            if forward:  # autograd saves the views it multiplies, for backward
                saved = [p.view(-1) for p in params]
                kept.update(saved=saved, graph=sum((v * v).sum() for v in saved))
            return Args((params, flat), **kept)
        return args
    cases = [Case(f"{name}, world_size {n}{', after a forward' if forward else ''}",
                  make(name, n, forward, torch.float32))
             for name in SHAPE_GROUPS for n in (1, 3) for forward in (True, False)]
    return cases + [Case("numels 6, 3, 1 in float64, world_size 3, after a forward",
                         make("numels 6, 3, 1", 3, True, torch.float64))]


def _outputs_5_2(result: Any, args: Args) -> dict[str, Any]:
    params, flat_param = args
    same = storage_id(flat_param.untyped_storage()) == args.kept["storage"]
    return {
        "bytes still held": held_bytes([flat_param, *params, *args.kept.get("saved", [])]),
        "params' numel": [p.numel() for p in params],
        "params' dtype": [str(p.dtype) for p in params],
        "flat_param's shape and storage":
            f"shape {tuple(flat_param.shape)}, {'its' if same else 'another'} storage"}


def _flat_replaced(ev: Evidence) -> bool:
    return "another storage" in ev.got_outputs["flat_param's shape and storage"]


_SHRINK = ("Shrink the storage itself, flat_param.untyped_storage().resize_(0): every view of "
           "it then holds 0 bytes too.")

EXERCISES = [
    Exercise("5.1", "ex05_zero3", "unshard",
             "ZeRO-3's unshard: all-gather a unit and view its parameters",
             "All-gather the shards into one flat buffer with zerolab.comm.all_gather; the "
             "padding is at its end, so parameter 0 starts at element 0; cut the buffer into "
             "views as in 3.2.",
             _cases_5_1, distributed=True, comm_checked=True, outputs=_outputs_5_1,
             hints=("flat = torch.empty(world_size * shard_numel, dtype=...); "
                    "comm.all_gather(flat, local_shard, tag=..., group=group); then "
                    "flat[offset:offset + numel].view(shape) for each shape, the offset moving "
                    "on by numel.",),
             mistakes=(
                 Mistake("the padding taken to be at the front",
                         "The padding is at the end of the gathered buffer: parameter 0 "
                         "starts at element 0.",
                         matches(lambda ev: _gathered(ev, padding_in_front=True))),
                 Mistake("every parameter starting at element 0",
                         "Parameter i starts where parameter i-1 ended: move the offset on by "
                         "each parameter's numel.",
                         matches(lambda ev: _gathered(ev, offsets_move=False))),
                 DTYPE_LOST,
                 Mistake("views of local_shard itself",
                         "Gather into a new buffer, on one rank too: at N = 1 the gathered "
                         "buffer has local_shard's size, but viewing local_shard means that "
                         "reshard (5.2), which frees the gathered buffer, frees this rank's own "
                         "shard.", lambda ev: ev.got == "views of local_shard", output="memory"),
                 Mistake("copies, not views of one buffer",
                         "The tensors are copies (clone, cat, a new tensor each): return views "
                         "into the one gathered buffer (flat[a:b].view(shape)), or reshard "
                         "(5.2) frees one buffer and these copies stay alive.",
                         lambda ev: len(ev.got) > 1, output="storages (bytes each)"),
                 Mistake("views of another buffer than the gathered one",
                         "View the buffer the all-gather filled (world_size * shard_numel "
                         "elements), not a copy or a slice of it.",
                         lambda ev: len(ev.got) == 1, output="storages (bytes each)"),
                 Mistake("no all-gather",
                         "The other ranks' shards come only through a collective: "
                         "zerolab.comm.all_gather.",
                         lambda ev: "all_gather" in ev.expected and "all_gather" not in ev.got,
                         output="comm ops")),
             read_only=("local_shard",)),
    Exercise("5.2", "ex05_zero3", "reshard",
             "ZeRO-3's reshard: really free a unit's storage",
             "Both are needed: shrink flat_param's storage to 0 bytes in place "
             "(untyped_storage().resize_), and give every parameter an empty tensor of its "
             "dtype, so that none points into the freed storage.",
             _cases_5_2, outputs=_outputs_5_2,
             hints=("for p in params: p.data = torch.empty(0, dtype=p.dtype, device=p.device); "
                    "then flat_param.untyped_storage().resize_(0).",),
             mistakes=(
                 Mistake("flat_param given a new tensor; its old storage lives on",
                         "flat_param.data = ... gives flat_param a new tensor, but the old "
                         "storage stays alive in every view of it: the parameters', and those "
                         "autograd saved for backward. " + _SHRINK,
                         _flat_replaced, output="bytes still held"),
                 Mistake("nothing freed",
                         "`del flat_param` (or rebinding the name) only drops your reference: "
                         "the caller's tensor and the views still hold the storage. " + _SHRINK,
                         lambda ev: not _flat_replaced(ev), output="bytes still held"),
                 Mistake("the parameters still point into the freed storage",
                         "Give every parameter an empty tensor (p.data = torch.empty(0, "
                         "dtype=p.dtype)): one still viewing the freed storage would read "
                         "freed memory.", output="params' numel", test=lambda ev: True),
                 Mistake("the parameters' dtype changed",
                         "Keep each parameter's dtype: torch.empty(0) is float32 unless you "
                         "pass dtype=p.dtype.", output="params' dtype", test=lambda ev: True),
                 Mistake("flat_param replaced",
                         "flat_param must keep its shape and its storage, shrunk to 0 bytes: "
                         "the next unshard grows that storage back and gathers into it.",
                         output="flat_param's shape and storage", test=lambda ev: True))),
]
