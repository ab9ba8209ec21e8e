"""Exercises for notebook 12: meshes, tensor parallelism beside FSDP.

Check your answers with `grade("ex12")` in the notebook, or `python -m zerolab.grade ex12`.

The function runs on each rank of a launch (the grader starts the processes and calls it on
each, with the same `group`): talk to the other ranks only through zerolab.comm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerolab import comm


def tp_mlp(x: torch.Tensor, fc_weight: torch.Tensor, fc_bias: torch.Tensor,
           out_weight: torch.Tensor, out_bias: torch.Tensor, rank: int, world_size: int,
           group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Exercise 12.1: One block's MLP, fc_out(gelu(fc(x))), split over the ranks of `group`:
    fc column-parallel, then fc_out row-parallel.

    Inputs: x: (b, s, h), the same on every rank. The MLP's whole weights, the same on every
    rank, in nn.Linear's layout (y = x @ weight.T + bias): fc_weight (4h, h), fc_bias (4h,),
    out_weight (h, 4h), out_bias (h,). world_size divides 4h.
    Returns: (b, s, h): the whole MLP's output, on every rank.
    Contract: rank r computes with its own N-th of each weight only. fc column-parallel: the
    r-th N-th of fc's 4h output features (rows of fc_weight, and their biases). fc_out
    row-parallel: the matching N-th of its 4h input features (columns of out_weight). The
    ranks exchange exactly one collective, an all-reduce (sum) of a (b, s, h) tensor, through
    zerolab.comm (tag it "ex12.1/..."): 2(N-1)/N of its bytes per rank in the ring model.
    Graded on: h = 6, 12 and 24, batches of 1 to 3 sequences of 2 to 4 tokens, float32 and
    float64, on 1, 2 and 3 ranks; the result to within 1e-5 (relative), the collectives
    called and their bytes exactly.

    Hint: GELU acts on each hidden feature alone; a sum over the hidden features needs every
    rank's part.
    """
    # BEGIN SOLUTION
    per_rank = fc_weight.shape[0] // world_size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)  # this rank's hidden features
    hidden = F.gelu(x @ fc_weight[mine].T + fc_bias[mine])  # (b, s, 4h / N): whole features
    partial = hidden @ out_weight[:, mine].T  # (b, s, h): this rank's terms of the sum over 4h
    comm.all_reduce(partial, op="sum", tag="ex12.1/fc_out", group=group)
    return partial + out_bias  # the bias once, after the sum
    # END SOLUTION
