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

    Inputs: param: (rows, *rest). rank, world_size.
    Returns: this rank's rows as FSDP2 cuts dim 0 (torch.chunk's rule): every rank gets
    ceil(rows / world_size) rows, except the last ranks, which get what is left: fewer
    rows, or none (shape (0, *rest)). A new tensor of its own holding just those rows (not a
    view of param), without padding: what the local tensor of FSDP2's sharded parameter
    holds.
    Must: leave param unchanged.
    Example: 10 rows on 4 ranks: 3, 3, 3 and 1 rows. 2 rows on 3 ranks: 1, 1 and 0 rows.
    Graded on: shapes (10, 3), (2, 4), (7,), (1,), (6, 2) on every rank of 1 to 4, and (10, 3)
    in float64, in bfloat16 and as a non-contiguous view on 3 ranks: the rows (values and
    dtype), the memory behind them, param afterwards.

    Hint: where does rank r's first row sit, and what if that is past the last row?
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

    Inputs: shards: name -> this rank's rows of that parameter, (rows_r, *rest), cut as in
    6.1 (the last ranks may hold fewer rows, or none). rows: name -> the full parameter's
    number of rows.
    Returns: name -> the full parameter, (rows, *rest) of the shard's dtype, the same on
    every rank, in memory of its own (on one rank too: not the shard): what saving a
    checkpoint needs (FSDP2: get_model_state_dict with full_state_dict=True).
    Must: leave the shards unchanged; talk to the other ranks through zerolab.comm (tags,
    `group`), sending what the rows need: (N-1)/N of each padded full tensor's bytes; every
    rank must issue the same collectives, with the same sizes, in the same order (the ranks
    are processes started one by one: they hash strings differently).
    Graded on: a small model (the last ranks hold fewer rows, or none) and a (5, 2, 2)
    float64 parameter, on 1, 2 and 3 ranks: every full tensor and whether it is a shard's
    memory, the shards afterwards, the ops called and bytes sent, and whether every rank
    issued the same collectives.

    Hint: a collective needs the same size on every rank. What can the ranks holding fewer
    rows do about it?
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
        # A copy of the rows: a view would keep the padding rows' storage alive with it.
        full[name] = gathered.view(world_size * rows_per_rank, *rest)[:rows[name]].clone()
    return full
    # END SOLUTION
