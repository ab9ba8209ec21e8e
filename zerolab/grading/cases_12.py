"""Notebook 12's exercise (ex12_meshes): one block's MLP split over the ranks as Megatron-LM
splits it, fc column-parallel then fc_out row-parallel, one all-reduce in forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import rng
from zerolab.grading.mistakes import DTYPE_LOST, Evidence, Mistake, matches, used_instead

# (b, s, h): 4h divides by 1, 2 and 3 ranks, and so does h (for the row-then-column mistake)
_SHAPES = ((2, 3, 6), (1, 4, 12), (3, 2, 24))


def _mlp_inputs(shape: tuple[int, int, int], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x and the MLP's weights, the same on every rank (seeded by the case, not the rank)."""
    b, s, h = shape
    gen = rng("12.1", shape, str(dtype))

    def draw(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, generator=gen) * scale).to(dtype)
    return (draw(b, s, h, scale=1.0), draw(4 * h, h, scale=h ** -0.5), draw(4 * h, scale=0.1),
            draw(h, 4 * h, scale=(4 * h) ** -0.5), draw(h, scale=0.1))


def _cases_12_1(world_size: int) -> list[Case]:
    return [Case(f"b, s, h = {shape}, {str(dtype).removeprefix('torch.')}",
                 lambda rank, shape=shape, dtype=dtype: _mlp_inputs(shape, dtype))
            for shape in _SHAPES for dtype in (torch.float32, torch.float64)]


# ---- what the grader can tell apart ------------------------------------------------------------


def _on_every_rank(ev: Evidence, part: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The sum over the ranks of `part(x, weights..., rank, n)`: what an all-reduce of each
    rank's part gives."""
    n = ev.world_size
    return sum(part(*ev.inputs(r), r, n) for r in range(n))


def _columns(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
             r: int, n: int) -> torch.Tensor:
    """Rank r's (b, s, h) terms with fc column-parallel and fc_out row-parallel."""
    per = w1.shape[0] // n
    mine = slice(r * per, (r + 1) * per)
    return F.gelu(x @ w1[mine].T + b1[mine]) @ w2[:, mine].T


def _bias_before_sum(ev: Evidence) -> torch.Tensor:
    """The right split, with fc_out's bias added on every rank before the all-reduce."""
    return _on_every_rank(ev, lambda x, w1, b1, w2, b2, r, n: _columns(x, w1, b1, w2, r, n)
                          + b2)


def _no_sum(ev: Evidence) -> torch.Tensor:
    """The right split without the all-reduce: this rank's terms, plus the bias."""
    x, w1, b1, w2, b2 = ev.inputs()
    return _columns(x, w1, b1, w2, ev.rank, ev.world_size) + b2


def _row_then_column(ev: Evidence) -> torch.Tensor:
    """fc row-parallel (a partial sum over the input features), GELU of that partial sum,
    fc_out column-parallel into this rank's columns, assembled by an all-reduce."""
    h = ev.inputs()[0].shape[-1]

    def part(x, w1, b1, w2, b2, r, n):
        per = h // n
        cols = slice(r * per, (r + 1) * per)
        hidden = F.gelu(x[..., cols] @ w1[:, cols].T + b1 / n)
        out = torch.zeros_like(x)
        out[..., cols] = hidden @ w2[cols].T + b2[cols]
        return out
    return _on_every_rank(ev, part)


def _sum_before_gelu(ev: Evidence) -> torch.Tensor:
    """fc column-parallel, its (b, s, 4h / N) outputs all-reduced (features of different
    ranks added together), then GELU and fc_out's rows of this rank, no sum after."""
    x, w1, b1, w2, b2 = ev.inputs()
    n, r = ev.world_size, ev.rank
    per = w1.shape[0] // n
    mine = slice(r * per, (r + 1) * per)
    summed = sum(x @ w1[slice(q * per, (q + 1) * per)].T + b1[slice(q * per, (q + 1) * per)]
                 for q in range(n))
    return F.gelu(summed) @ w2[:, mine].T + b2


_HINT = ("fc_weight rows r*4h/N to (r+1)*4h/N and their biases: GELU on that slice alone; "
         "out_weight's matching columns: a (b, s, h) partial sum; all-reduce it; add out_bias.")

EXERCISES = [
    Exercise("12.1", "ex12_meshes", "tp_mlp",
             "tensor parallelism: an MLP split column-then-row, one all-reduce in forward",
             "Column-parallel fc: each rank keeps whole hidden features (its rows of fc_weight), "
             "so GELU needs nothing from the others. Row-parallel fc_out: each rank multiplies "
             "its hidden features by the matching columns of out_weight, a partial sum of the "
             "output; one all-reduce (sum) of that (b, s, h) tensor completes it; the bias is "
             "added once, after.",
             _cases_12_1, distributed=True, comm_checked=True, hints=(_HINT,),
             mistakes=(
                 Mistake("no all-reduce: one rank's partial sum",
                         "Each rank's product with its columns of out_weight is a partial sum "
                         "over the hidden features: all-reduce it (sum) before adding the bias.",
                         lambda ev: "all_reduce" in ev.expected and not ev.got,
                         output="comm ops"),
                 Mistake("no all-reduce: one rank's partial sum",
                         "Each rank's product with its columns of out_weight is a partial sum "
                         "over the hidden features: all-reduce it (sum) before adding the bias.",
                         matches(_no_sum)),
                 Mistake("an all-gather where an all-reduce belongs",
                         "Right values, wrong traffic: gathering the (b, s, 4h / N) hidden "
                         "slices sends 4(N-1)/N of b·s·h values per rank, then every rank "
                         "repeats all of fc_out. Row-parallel fc_out sends a (b, s, h) partial "
                         "sum instead: one all-reduce, 2(N-1)/N of b·s·h.",
                         used_instead("all_gather", "all_reduce"), output="comm ops"),
                 Mistake("row-parallel first: GELU of a partial sum",
                         "Split fc by its input features and each rank holds a partial sum of "
                         "every hidden feature; GELU of a partial sum is not a part of GELU of "
                         "the sum. Split fc by its output features (column-parallel) first.",
                         matches(_row_then_column)),
                 Mistake("the all-reduce before GELU, on fc's outputs",
                         "fc's outputs on different ranks are different features: adding them "
                         "mixes features. Nothing is summed until fc_out's partial products.",
                         matches(_sum_before_gelu)),
                 Mistake("out_bias added on every rank before the sum",
                         "The all-reduce adds what every rank holds: a bias added before it "
                         "counts N times. Add out_bias after the all-reduce.",
                         matches(_bias_before_sum)),
                 DTYPE_LOST),
             read_only=("x", "fc_weight", "fc_bias", "out_weight", "out_bias")),
]
