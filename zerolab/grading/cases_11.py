"""Notebook 11's exercise (ex11_muon): Muon's orthogonalised update from flat gradient shards,
on ranks: the shard each rank gets back, and the bytes each rank sent, are checked."""

from __future__ import annotations

import torch

from zerolab.grading.exercise import Case, Exercise, result_data
from zerolab.grading.inputs import rng
from zerolab.grading.mistakes import DTYPE_LOST, Evidence, Mistake, bytes_times, matches
from zerolab.lessons.n11_optimizers import orthogonalize

# (rows, cols): tall, wide, and one whose shards end inside a row and need padding
_SHAPES = ((6, 4), (4, 6), (5, 7))


def _padded(g: torch.Tensor, n: int) -> torch.Tensor:
    """G flattened row-major and padded with zeros to n * ceil(numel / n): ZeRO's layout."""
    k = -(-g.numel() // n)
    flat = torch.zeros(n * k)
    flat[:g.numel()] = g.reshape(-1)
    return flat


def _cases_11_1(n: int) -> list[Case]:
    def make(rank: int, shape: tuple[int, int]) -> tuple:
        g = torch.randn(shape, generator=rng("11.1", shape))  # the same G on every rank
        return (_padded(g, n).chunk(n)[rank].clone(), shape)

    def example(rank: int) -> tuple:
        g = torch.tensor([[3.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
        return (_padded(g, n).chunk(n)[rank].clone(), (3, 2))

    return [Case("the stub's example, G (3, 2)", example),
            *(Case(f"G of shape {shape}", lambda rank, s=shape: make(rank, s))
              for shape in _SHAPES)]


# ---- what the grader can tell apart ------------------------------------------------------------


def _whole(ev: Evidence) -> tuple[torch.Tensor, tuple[int, int]]:
    """The padded flat gradient, from every rank's shard, and G's shape."""
    shards = [ev.inputs(r)[0] for r in range(ev.world_size)]
    return torch.cat(shards), ev.inputs()[1]


def _answer(ev: Evidence, update: torch.Tensor) -> torch.Tensor:
    """This rank's flat shard of `update`, padded as the gradient is."""
    return _padded(update, ev.world_size).chunk(ev.world_size)[ev.rank]


def _shard_alone(ev: Evidence) -> torch.Tensor:
    """Each rank orthogonalises its own shard as a (1, k) matrix: no gather."""
    return orthogonalize(ev.inputs()[0].view(1, -1)).reshape(-1)


def _transposed(ev: Evidence) -> torch.Tensor:
    """The gradient read as (cols, rows), orthogonalised, and laid out flat again."""
    flat, (rows, cols) = _whole(ev)
    return _answer(ev, orthogonalize(flat[:rows * cols].view(cols, rows)))


def _transposed_back(ev: Evidence) -> torch.Tensor:
    """The right matrix, orthogonalised, then flattened column-major (transposed)."""
    flat, (rows, cols) = _whole(ev)
    return _answer(ev, orthogonalize(flat[:rows * cols].view(rows, cols)).T)


EXERCISES = [
    Exercise("11.1", "ex11_muon", "sharded_muon_update",
             "Muon on ZeRO's flat shards: gather to one owner, orthogonalise once, send back",
             "Every rank but 0 sends its whole shard to rank 0 with comm.send; rank 0 "
             "receives each into its place (rank r's at r*k), views the first rows*cols "
             "elements as (rows, cols), orthogonalises, pads the flattened update back to "
             "world_size*k, and sends rank r its elements r*k to (r+1)*k.",
             _cases_11_1, distributed=True, comm_checked=True, outputs=result_data,
             hints=("flat = torch.empty(world_size * k); flat[:k] = grad_shard; for r in "
                    "1..N-1: comm.recv(flat[r*k:(r+1)*k], r, tag=..., group=group). The other "
                    "ranks: comm.send(grad_shard, 0, ...), then comm.recv(mine, 0, ...).",),
             mistakes=(
                 Mistake("each shard orthogonalised alone, never gathered",
                         "A flat shard is a run of elements, often from several rows: no "
                         "matrix, and Newton-Schulz mixes every element with every other. "
                         "Gather the shards to rank 0 and orthogonalise the whole (rows, cols) "
                         "gradient there.", matches(_shard_alone), output="result"),
                 Mistake("the gradient read as (cols, rows): a transpose",
                         "The flat gradient is G flattened row-major: view its first rows*cols "
                         "elements as (rows, cols), not (cols, rows), and flatten the update "
                         "the same way (.reshape(-1), no .T).",
                         lambda ev: matches(_transposed)(ev) or matches(_transposed_back)(ev),
                         output="result"),
                 Mistake("every rank gathers the whole gradient",
                         "The result is right, but each rank sent its shard to every other "
                         "rank ((N-1) k elements each, N (N-1) k in all): only rank 0 needs "
                         "the gradient. Send your shard to rank 0 alone; rank 0 sends each "
                         "rank its part of the update: 2 (N-1) k elements in all.",
                         bytes_times(lambda ev: ev.world_size - 1), output="bytes sent"),
                 Mistake("the whole update sent back to every rank",
                         "Each rank needs only its k elements of the update: send rank r the "
                         "elements r*k to (r+1)*k, not the whole padded update (N times the "
                         "bytes).", bytes_times(lambda ev: ev.world_size), output="bytes sent"),
                 DTYPE_LOST),
             read_only=("grad_shard",)),
]
