"""Notebook 10, when communication hides: one ZeRO-3 unit's gather against its forward, measured
as the tokens per rank grow, beside the threshold zerolab.threshold predicts from C and beta.

`sweep` runs on every rank of a group (notebook 10 calls it at N = 2, inside its one launch).
The unit is one block of n10_time.MODEL, its parameters flattened and padded as ZeRO-3 does.
For each T of TOKENS, in shuffled rounds, the slowest rank's seconds of:

- the unit's all-gather alone (zerolab.comm, as ZeRO-3 issues it);
- the block's forward on T tokens alone (grad mode on, as in training): C is fitted on these;
- the two at once, as ZeRO-3's prefetch runs them: the gather issued asynchronously, the
  forward computed, then the wait ("busy");
- the same with a sleep as long as the forward in place of the forward ("idle"): the cores
  free, as when a GPU computes and a link moves the bytes. (On a GPU, NCCL's copies run on
  the GPU's SMs too; the sleep is the upper bound, perfect overlap.)

`Threshold` holds the medians; its methods give the fitted C, the predicted T* and the share of
the gather each way hid (zerolab.threshold.measured_share).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm, cost, threshold
from zerolab.lessons.n10_time import MODEL
from zerolab.models import Block
from zerolab.sharding import FlatLayout

# tokens per rank: sequences of MODEL.block_size (32) tokens, or one shorter sequence
TOKENS = (8, 16, 32, 64, 128, 256)


@dataclass
class Threshold:
    """A unit's gather and forward at each T of `tokens` (medians, seconds, slowest rank)."""

    world_size: int
    params: int  # P: the unit's parameters (its padded flat numel)
    tokens: tuple[int, ...]
    gather: float  # the gather alone (median over every round)
    forward: list[float]  # per T: the forward alone
    busy: list[float]  # per T: gather issued, forward computed, gather waited for
    idle: list[float]  # per T: gather issued, a sleep as long as the forward, the wait
    shares: dict[str, list[float]]  # "busy", "idle": per T, the median over rounds of the
    #                                 share hidden, each round's four times paired
    threads: int  # torch threads per rank
    cores: int  # cores this process may run on

    @property
    def rate(self) -> threshold.Rate:
        return threshold.fit_rate(self.params, self.tokens, self.forward)

    def predicted(self, link: cost.Link) -> float:
        """T* from the fitted C and overhead t0 and the link: the unit's gather against
        t0 + 2·P·T / C."""
        rate = self.rate
        return threshold.tokens_to_hide("ZeRO-3", rate.flops_per_s, link, self.params,
                                        self.world_size, overhead=rate.overhead)

    def measured(self) -> float | None:
        """Measured T*: where the forward alone reaches the gather alone."""
        return threshold.crossing(self.tokens, self.forward, self.gather)

    def hidden(self, how: str) -> list[float]:
        """Per T, the share of the gather that running both hid ("busy" or "idle"): in each
        round (gather + forward - together) / gather of that round's times, then the median
        (a load that comes and goes hits the four times of a round alike)."""
        return self.shares[how]

    def hidden_predicted(self, link: cost.Link, tokens: list[float]) -> list[float]:
        """Per T, perfect overlap's share: min(1, (t0 + 2·P·T / C) over the link's gather)."""
        rate = self.rate
        g = threshold.comm_seconds("ZeRO-3", link, self.params, self.world_size)
        return [threshold.hidden_share(threshold.compute_seconds(
            "ZeRO-3", rate.flops_per_s, self.params, t, rate.overhead), g) for t in tokens]


def _inputs(tokens: int) -> torch.Tensor:
    """(batch, seq, n_embd): T tokens as sequences of up to MODEL.block_size."""
    seq = min(tokens, MODEL.block_size)
    return torch.randn(tokens // seq, seq, MODEL.n_embd, generator=torch.Generator().manual_seed(0))


def sweep(group, tokens: tuple[int, ...] = TOKENS, repeats: int = 7,
          warmup: int = 1) -> Threshold:
    """Every rank of `group`: the measurements of the module's docstring (a second or two)."""
    n = dist.get_world_size(group)
    block = Block(MODEL)
    params = list(block.parameters())
    padded = FlatLayout.of(params, n).padded_numel
    shard, full = torch.zeros(padded // n), torch.empty(padded)  # (P/N,), (P,)
    xs = {t: _inputs(t) for t in tokens}

    def gather(async_op: bool) -> comm.Handle:
        return comm.all_gather(full, shard, tag="lesson10/threshold", group=group,
                               async_op=async_op)

    def timed(x: torch.Tensor | None, sleep: float | None = None, overlap: bool = False) -> float:
        """From a barrier, this rank's seconds of: the gather (x None, no sleep), the forward
        on x, or either with the gather issued first and waited for after (overlap)."""
        comm.barrier(tag="lesson10/threshold/start", group=group)
        start = time.perf_counter()
        handle = gather(True) if overlap else None
        if x is not None:
            block(x)
        elif sleep is not None:
            time.sleep(sleep)
        else:
            gather(False)
        if handle is not None:
            handle.wait()
        return time.perf_counter() - start

    got: dict[str, dict[int, list[float]]] = {k: {t: [] for t in tokens}
                                              for k in ("gather", "forward", "busy", "idle")}
    for r in range(warmup + repeats):
        order = list(tokens)
        random.Random(r).shuffle(order)  # the same order on every rank
        for t in order:
            mine = [timed(None), timed(xs[t])]
            mine += [timed(xs[t], overlap=True), timed(None, sleep=mine[1], overlap=True)]
            slowest = torch.tensor(mine, dtype=torch.float64)
            comm.all_reduce(slowest, op="max", tag="lesson10/slowest", group=group)
            if r >= warmup:
                for key, s in zip(got, slowest.tolist()):
                    got[key][t].append(s)
    med = {k: [statistics.median(v[t]) for t in tokens] for k, v in got.items()}
    shares = {how: [statistics.median(threshold.measured_share(g, f, b) for g, f, b in zip(
        got["gather"][t], got["forward"][t], got[how][t])) for t in tokens]
        for how in ("busy", "idle")}
    return Threshold(n, padded, tuple(tokens), statistics.median(
        s for t in tokens for s in got["gather"][t]), med["forward"], med["busy"], med["idle"],
        shares, torch.get_num_threads(), len(os.sched_getaffinity(0)))


def figure(th: Threshold, link: cost.Link):
    """plots.seconds.threshold for `th`: measured forward and gather, the fit, T*, shares."""
    from zerolab.plots import seconds

    rate = th.rate
    grid = [2 ** (k / 4) for k in range(8, 37)]  # 4 to 512 tokens per rank
    line = [(t, threshold.compute_seconds("ZeRO-3", rate.flops_per_s, th.params, t,
                                          rate.overhead)) for t in grid]
    return seconds.threshold(
        th.tokens, th.forward, th.gather,
        {"forward": line, "hidden": list(zip(grid, th.hidden_predicted(link, grid)))},
        threshold.comm_seconds("ZeRO-3", link, th.params, th.world_size),
        {"forward on the cores (busy)": th.hidden("busy"),
         "a sleep, the cores free (idle)": th.hidden("idle")},
        th.predicted(link), th.measured(),
        title=f"N = {th.world_size}, one block: its forward and its gather")


def format_threshold(th: Threshold, link: cost.Link) -> str:
    """The threshold table: C, beta, predicted and measured T*, and the share hidden per T."""
    rate = th.rate
    lines = [f"N = {th.world_size}, one block: P = {th.params:,} parameters, gathered in fp32 "
             f"({4 * th.params / 2**20:.2f} MiB); {th.threads} torch thread(s) per rank, "
             f"{th.cores} core(s) for this process",
             f"forward: t0 = {rate.overhead * 1e3:.2f} ms a call + 2PT / C, "
             f"C = {rate.flops_per_s / 1e9:.1f} GFLOP/s (fit, {rate.rms_error:.0%} RMS)",
             f"α = {link.alpha * 1e6:.0f} µs, β = {link.beta * 1e9:.3f} ns/B; gather predicted "
             f"{threshold.comm_seconds('ZeRO-3', link, th.params, th.world_size) * 1e3:.2f} ms, "
             f"measured {th.gather * 1e3:.2f} ms",
             f"T* predicted {th.predicted(link):,.0f} tokens per rank; measured "
             + (f"{m:,.0f}" if (m := th.measured()) is not None else "outside the sweep"),
             f"{'T':>6}{'forward':>10}{'busy':>9}{'idle':>9}{'hid: busy':>11}{'idle':>7}"
             f"{'perfect':>9}   (ms; hid: share of the gather hidden)"]
    perfect = th.hidden_predicted(link, list(th.tokens))
    for i, t in enumerate(th.tokens):
        lines.append(f"{t:>6}{th.forward[i] * 1e3:>10.2f}{th.busy[i] * 1e3:>9.2f}"
                     f"{th.idle[i] * 1e3:>9.2f}{th.hidden('busy')[i]:>11.0%}"
                     f"{th.hidden('idle')[i]:>7.0%}{perfect[i]:>9.0%}")
    return "\n".join(lines)


# --- what prediction 10.5 is scored against (zerolab.lessons.predictions) ---------------------


def _measure_prediction() -> float:
    """Inside 2 ranks: the measured T* (the sweep's crossing), or the nearest end of the sweep
    where the forward is already longer (or still shorter) than the gather at every T."""
    zerolab.init_from_env()
    th = sweep(None)
    found = th.measured()
    if found is not None:
        return found
    return float(th.tokens[0] if th.forward[0] >= th.gather else th.tokens[-1])


def measured_for(id: str) -> float:
    """Prediction 10.5's measurement: one launch of 2 ranks (a few seconds)."""
    if id != "10.5":
        raise ValueError(f"no measurement for prediction {id!r} here (10.5 only)")
    return zerolab.launch(_measure_prediction, 2, timeout=300)[0]
