"""When communication hides: the tokens per rank at which a unit's gather (ZeRO-3) or a bucket's
reduction (DDP) takes no longer than the compute it can hide behind (notebook 10).

Two rates decide it. C, the FLOP/s a rank sustains on the model's matmuls, and the link's alpha
and beta (zerolab.cost; W = 1/beta bytes per second). A linear layer of P weights costs 2·P
FLOPs per token in forward and 4·P in backward (the gradient of its input and of its weights),
so a unit or bucket of P parameters and T tokens on each rank takes:

    ZeRO-3, forward:  compute 2·P·T / C   against the unit's all-gather of b·P bytes
                      alpha·(N-1) + beta·(N-1)/N·b·P
    DDP, backward:    compute 4·P·T / C   against the bucket's all-reduce of g·P bytes
                      alpha·2(N-1) + beta·2(N-1)/N·g·P

(b, g: bytes per parameter gathered and reduced: 4 in the course's fp32, 2 for bf16 weights.)
Each is hidden, if the hardware lets the two run at once, from the tokens per rank

    T* = C · t_comm / (flops per parameter per token · P)
       = C·alpha·(N-1) / (2P)  +  C·beta·b·(N-1) / (2N)         (both, with b = g)

on (less C·t0 / (2P) for a per-call overhead of t0 seconds: time the rank is busy whatever T,
which hides a gather as well as FLOPs do). For a large unit the first term vanishes and
T* -> (b/2)·(C/W)·(N-1)/N: with bf16 on many GPUs, C/W, the JAX scaling book's "compute-bound
when B/X > C/W". `Machine` and `format_machines` set a learner's measured C and beta beside
published H100 figures.

C is measured as the unit's own forward: its seconds at several T, fitted by least squares to
t = t0 + 2·P·T / C (`fit_rate`); t0 is the per-call cost (Python, dispatch) that does not grow
with T.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from zerolab import cost

STAGES = ("ZeRO-3", "DDP")
FLOPS_PER_TOKEN = {"ZeRO-3": 2, "DDP": 4}  # per parameter: forward (ZeRO-3), backward (DDP)
OPS = {"ZeRO-3": "all_gather", "DDP": "all_reduce"}  # what must hide behind that compute


@dataclass(frozen=True)
class Rate:
    """C fitted on a unit's forward: t = overhead + flops / C."""

    flops_per_s: float  # C
    overhead: float  # t0, seconds per call whatever T
    rms_error: float  # relative RMS error of the fit over the measured points


def fit_rate(params: int, tokens: Sequence[int], seconds: Sequence[float]) -> Rate:
    """C from a unit's forward seconds at each of `tokens` (per rank): least squares of
    t = t0 + 2·P·T / C. Raises where the times do not grow with T (no rate to fit)."""
    if len(tokens) != len(seconds) or len(tokens) < 2:
        raise ValueError(f"need two or more (tokens, seconds) pairs, got {len(tokens)} tokens "
                         f"and {len(seconds)} times")
    flops = [2 * params * t for t in tokens]
    slope, t0 = statistics.linear_regression(flops, seconds)
    if slope <= 0:
        raise ValueError("the forward's time does not grow with the tokens: no rate to fit "
                         f"(times {[f'{s:.2e}' for s in seconds]})")
    errors = [(t0 + slope * f) / s - 1 for f, s in zip(flops, seconds)]
    return Rate(1 / slope, t0, (sum(e * e for e in errors) / len(errors)) ** 0.5)


def comm_seconds(stage: str, link: cost.Link, params: int, world_size: int,
                 bytes_per_param: int = 4) -> float:
    """The link's seconds for one unit's gather (ZeRO-3) or one bucket's all-reduce (DDP)."""
    _check(stage)
    return link.predict(OPS[stage], bytes_per_param * params, world_size)


def compute_seconds(stage: str, flops_per_s: float, params: int, tokens: float,
                    overhead: float = 0.0) -> float:
    """The compute that can hide it: the unit's forward (ZeRO-3), the bucket's backward (DDP),
    plus `overhead` seconds a call whatever T (Rate.overhead; 0 for a GPU's figures)."""
    _check(stage)
    return overhead + FLOPS_PER_TOKEN[stage] * params * tokens / flops_per_s


def tokens_to_hide(stage: str, flops_per_s: float, link: cost.Link, params: int,
                   world_size: int, bytes_per_param: int = 4, overhead: float = 0.0) -> float:
    """T*: the tokens per rank from which the compute (with its per-call overhead) takes as
    long as the communication: C · (t_comm - overhead) / (flops per parameter · P), 0 if the
    overhead alone is as long."""
    t = comm_seconds(stage, link, params, world_size, bytes_per_param)
    return max(0.0, (t - overhead) * flops_per_s / (FLOPS_PER_TOKEN[stage] * params))


def hidden_share(compute: float, comm: float) -> float:
    """With perfect overlap, the share of the communication that hides: min(1, compute/comm)."""
    return min(1.0, compute / comm)


def measured_share(comm: float, compute: float, together: float) -> float:
    """The share of the communication a run hid: (comm + compute - together) / comm. 1: all of
    it; 0: none (one after the other); below 0: running both slowed them down."""
    return (comm + compute - together) / comm


def crossing(tokens: Sequence[int], compute: Sequence[float], comm: float) -> float | None:
    """Measured T*: where the measured compute (rising with T) reaches `comm`, interpolated
    linearly between the two tokens that bracket it; None if no measured T brackets it."""
    pairs = sorted(zip(tokens, compute))
    for (t1, c1), (t2, c2) in zip(pairs, pairs[1:]):
        if c1 <= comm <= c2 and c2 > c1:
            return t1 + (comm - c1) * (t2 - t1) / (c2 - c1)
    return None


def _check(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")


# --- the learner's machine beside published GPUs --------------------------------------------


# H100 SXM: 989 TFLOP/s dense bf16 (NVIDIA's H100 datasheet); NVLink 4: 900 GB/s both ways
# together, 450 each way (the same page); across nodes torchtitan's 400 Gb/s per GPU, with a
# ring per NIC a GPU's share of 8 NICs: 400 GB/s (zerolab.lessons.n10_cluster).
H100_FLOPS = 989e12
H100_SOURCE = "https://www.nvidia.com/en-us/data-center/h100/"
SCALING_BOOK = "https://jax-ml.github.io/scaling-book/gpus/"


@dataclass(frozen=True)
class Machine:
    """One row of the comparison: C, the link, the bytes each parameter travels in."""

    name: str
    flops_per_s: float
    link: cost.Link
    world_size: int
    bytes_per_param: int  # 4: fp32 (the course), 2: bf16 weights and gradients
    overhead: float = 0.0  # seconds a call whatever T (measured here; 0 for published figures)

    def threshold(self, stage: str, params: int) -> float:
        return tokens_to_hide(stage, self.flops_per_s, self.link, params, self.world_size,
                              self.bytes_per_param, self.overhead)

    @property
    def limit(self) -> float:
        """T* for an unbounded unit: (b/2)·C·beta·(N-1)/N, the alpha term gone."""
        n = self.world_size
        return self.bytes_per_param / 2 * self.flops_per_s * self.link.beta * (n - 1) / n


def format_machines(machines: Sequence[Machine], params: dict[str, int]) -> str:
    """T* per machine: for each named unit size (params: name -> P) and in the limit."""
    head = (f"{'':34}{'C TFLOP/s':>10}{'W GB/s':>8}{'N':>5}{'B/param':>8}"
            + "".join(f"{'T* ' + name:>14}" for name in params) + f"{'T* large':>10}")
    lines = [head]
    for m in machines:
        cells = "".join(f"{m.threshold('ZeRO-3', p):>14,.0f}" for p in params.values())
        lines.append(f"{m.name:34}{m.flops_per_s / 1e12:>10.3g}{m.link.bandwidth / 1e9:>8.3g}"
                     f"{m.world_size:>5}{m.bytes_per_param:>8}{cells}{m.limit:>10,.0f}")
    return "\n".join(lines)
