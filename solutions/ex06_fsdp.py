"""Exercises for notebook 06: FSDP2's per-parameter shards, next to zerolab's flat shards.

zerolab (like FSDP1 and DeepSpeed) lays a unit's parameters end to end and splits the flat
buffer: a shard can hold the end of one parameter and the start of the next. FSDP2's
fully_shard splits every parameter on its own, along dim 0 (a DTensor with Shard(0)): each
rank holds some rows of every parameter.

6.1 is a plain function. 6.2 runs on every rank at once (the grader spawns world_size
processes and calls it on each, with the same `group`): talk to the other ranks only through
zerolab.comm, which records every call with a tag.

Check your answers with `grade("ex06")` in the notebook, or `python -m zerolab.grade ex06`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm


def dim0_shard(param: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Exercise 6.1: FSDP2's shard of one parameter: some of its rows (dim 0).

    param: (rows, *rest). FSDP2 cuts dim 0 the way torch.chunk does: every rank gets
    ceil(rows / world_size) rows, except the last ranks, which get what is left: fewer rows,
    or none. Return this rank's rows, (rows_r, *rest), as a new tensor without padding
    (what the local tensor of FSDP2's sharded parameter holds).

    Example: 10 rows on 4 ranks: 3, 3, 3 and 1 rows. 2 rows on 3 ranks: 1, 1 and 0 rows
    (rank 2's shard has shape (0, *rest)).

    Hint: rows_per_rank = ceil(rows / world_size); rank r's rows start at
    r * rows_per_rank; clamp the start and the end to rows.
    """
    # BEGIN SOLUTION
    rows = param.shape[0]
    rows_per_rank = -(-rows // world_size)  # ceil
    start = min(rank * rows_per_rank, rows)
    end = min(start + rows_per_rank, rows)
    return param[start:end].clone()
    # END SOLUTION


def full_state_dict(shards: dict[str, torch.Tensor], rows: dict[str, int], rank: int,
                    world_size: int, group: dist.ProcessGroup | None = None
                    ) -> dict[str, torch.Tensor]:
    """Exercise 6.2: A full state dict from FSDP2-style dim-0 shards, on every rank.

    shards: name -> this rank's rows of that parameter, (rows_r, *rest) as in 6.1 (the last
    ranks may hold fewer rows, or none). rows: name -> the full parameter's number of rows.
    Return name -> the full parameter, (rows, *rest), the same on every rank: what saving a
    checkpoint needs (FSDP2: get_model_state_dict with full_state_dict=True).

    All-gather needs the same size on every rank: pad each shard with zero rows to
    rows_per_rank = ceil(rows / world_size), gather, then drop the padding rows. Every rank
    must issue the same collectives in the same order (loop over the names in order).

    Hint: padded = torch.zeros(rows_per_rank, *rest); padded[:len(shard)] = shard;
    comm.all_gather(out, padded.reshape(-1), tag=..., group=group) with
    out = torch.empty(world_size * padded.numel()); then
    out.view(world_size * rows_per_rank, *rest)[:rows].
    """
    # BEGIN SOLUTION
    full = {}
    for name, local in shards.items():
        rest = local.shape[1:]
        rows_per_rank = -(-rows[name] // world_size)  # ceil
        padded = torch.zeros(rows_per_rank, *rest, dtype=local.dtype)
        padded[:local.shape[0]] = local
        gathered = torch.empty(world_size * padded.numel(), dtype=local.dtype)
        comm.all_gather(gathered, padded.reshape(-1), tag=f"ex6.2/{name}", group=group)
        full[name] = gathered.view(world_size * rows_per_rank, *rest)[:rows[name]]
    return full
    # END SOLUTION
