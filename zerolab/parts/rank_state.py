"""engine.rank_state_dict() / engine.load_state_dict(): one rank's part of an engine's state,
as plain data (torch.save and torch.load(weights_only=True) take it), and back at the same world
size. The pieces are state_dicts.py's Chunks: rectangles of the full tensors this rank holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from zerolab.parts.state_dicts import (
    MODEL,
    OPTIMIZER,
    Chunks,
    engine_state_dict,
    fill,
    finish_load,
    targets,
)

if TYPE_CHECKING:  # the engine contract: the shell (a cycle at run time)
    from zerolab.shell import EngineShell


def rank_state_dict(engine: EngineShell) -> dict:
    """This rank's part of `engine`'s state, copied, in plain types (torch.save and
    torch.load(weights_only=True) take it): engine_state_dict's, each Chunks as {"shape": the
    full tensor's, "dtype": its name, "pieces": [(offsets, a copy of the piece)]}. No
    collective."""
    engine.wait_params()

    def plain(x: Any) -> Any:
        if isinstance(x, Chunks):
            dtype = x.pieces[0][1].dtype if x.pieces else None  # none: this rank holds none
            return {"shape": tuple(x.shape), "dtype": str(dtype).removeprefix("torch."),
                    "pieces": [(tuple(o), t.detach().clone()) for o, t in x.pieces]}
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, list):
            return [plain(v) for v in x]
        return x.detach().clone() if torch.is_tensor(x) else x

    return {**plain(engine_state_dict(engine)), WHOSE: _whose(engine)}


WHOSE = "zerolab_part"  # which engine, world size and rank a part belongs to


def _whose(engine: EngineShell) -> dict[str, Any]:
    # The job's ranks (HSDP's engine.rank is its rank in its shard group)
    if not dist.is_initialized():  # one process, no process group
        return {"engine": type(engine).__name__, "rank": 0, "world_size": 1}
    return {"engine": type(engine).__name__, "rank": dist.get_rank(engine.job_group),
            "world_size": dist.get_world_size(engine.job_group)}


def _is_pieces(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == {"shape", "dtype", "pieces"}


def load_rank_state_dict(engine: EngineShell, sd: dict) -> None:
    """Load what `rank_state_dict` gave on this rank (the same engine, world size and rank):
    each piece back into its place, the optimizer's state into its tiles, then the full
    parameters gathered from the shards where the stage keeps them whole (ZeRO-1/2)."""
    if sd.get(WHOSE) != _whose(engine):
        raise ValueError(
            f"this is the part of {sd.get(WHOSE)}; this engine is {_whose(engine)}. A rank's "
            "part loads into the same engine, rank and world size only: to change them, save "
            "with zerolab.checkpoint.save(engine, folder) and load with zerolab.checkpoint."
            "load(engine, folder), or load a full state dict ({'model': model.state_dict()}).")
    optimizer = sd.get(OPTIMIZER, {})
    kinds = {name: {k: ((torch.Size(v["shape"]), getattr(torch, v["dtype"], torch.float32))
                        if _is_pieces(v)
                        else (v.shape, v.dtype) if torch.is_tensor(v) else None)
                    for k, v in state.items()}
             for name, state in optimizer.get("state", {}).items()}
    loading = targets(engine, kinds, [list(g["params"]) for g in optimizer.get("param_groups", [])])
    engine.wait_params()
    fill(loading.sd, {MODEL: sd[MODEL], OPTIMIZER: optimizer}, _from_pieces)
    finish_load(engine, loading)
    engine.resync_params()  # ZeRO-1/2: every rank's shard into the full parameters
    engine.wait_params()


def _copy_overlap(t: torch.Tensor, at: tuple, piece: torch.Tensor, piece_at: tuple) -> None:
    """Where two rectangles of one full tensor overlap (t at offsets `at`, piece at
    `piece_at`), copy piece's values into t."""
    lo = [max(a, b) for a, b in zip(at, piece_at)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(at, t.shape, piece_at, piece.shape)]
    if all(x < y for x, y in zip(lo, hi)):
        t[tuple(slice(x - a, y - a) for x, y, a in zip(lo, hi, at))].copy_(
            piece[tuple(slice(x - b, y - b) for x, y, b in zip(lo, hi, piece_at))])


def _from_pieces(key: Any, chunks: Chunks, given: Any) -> None:
    """A Chunks leaf from this rank's saved pieces, where they overlap (a ZeRO-1/2 parameter
    is held whole: this rank's pieces fill their part of it; _after_step gathers the rest)."""
    if not _is_pieces(given):
        raise ValueError(f"{key}: expected this rank's pieces (engine.rank_state_dict()), "
                         f"got {type(given).__name__}")
    for offsets, t in chunks.pieces:
        for given_offsets, piece in given["pieces"]:
            _copy_overlap(t, offsets, piece, given_offsets)
