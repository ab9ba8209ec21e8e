"""Notebook 10, bytes to seconds: the link fitted on this machine, and what it predicts.

`bytes_to_seconds` does everything notebook 10 measures, in one launch of 4 ranks: for each
N = 2, 3, 4, ranks 0..N-1 form a group, fit the link (`zerolab.cost`) and then train the same
GPT with each stage (DDP, ZeRO-1, ZeRO-2, ZeRO-3), measuring per step:

- the collectives it issued (op, S, group), and what the link predicts they cost;
- the same collectives replayed alone, one after another: its communication, measured;
- the step (forward, backward, optimizer step, and the wait for ZeRO-1/2's gather after it),
  the slowest rank's, from the step's own record (zerolab.harness.measured_step);
- the same model's forward and backward with no engine, and AdamW's step over the elements
  this rank updates: its compute, timed alone (as the bench's floor does).

At N = 2 it also sweeps the tokens per rank of one unit's forward against its gather
(lessons/n10_threshold.py: when communication hides). The engine's steps, the compute alone and
the replays run in the same rounds, so that a burst of load elsewhere hits all three alike;
every figure is the slowest rank's, summarised by medians.

`acceptance_table()` prints issue 29's check: at N = 2 and 3, the fitted link's predictions of
1-16 MiB all-reduces, reduce-scatters and all-gathers, and of each stage's communication per
step, beside measurements taken in the same rounds (sizes the fit did not see), each against
its N's band (cost.Link.band: the fit's worst miss on a point it was fitted without).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm, cost, engines, harness
from zerolab.models import GPT, GPTConfig, num_params

# 4 blocks of hidden size 192: 2.2M parameters, 8.7 MB in fp32; DDP's 1 MiB buckets make 9
# all-reduces a step, ZeRO-3 gathers each block (1.8 MB) as one unit.
MODEL = GPTConfig(vocab_size=2048, block_size=32, n_layer=4, n_head=4, n_embd=192)
GLOBAL_BATCH = 12  # sequences per step over all ranks: N = 2, 3, 4 all divide it
LR = 1e-3
STAGES = tuple(engines.label(key) for key in engines.STAGE_ENGINES)
MiB = 1 << 20
FIT_SIZES = (16 << 10, 64 << 10, 256 << 10, 768 << 10, 3 * MiB, 12 * MiB)  # what the link sees
CHECK_SIZES = (1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB)  # what it predicts, unseen
BURST_BYTES = 4 * MiB  # a burst of the sweep holds at most this much S: 3 MiB and up, one call


@dataclass
class StageTime:
    """One stage's steps on one group of N ranks (every time the slowest rank's, seconds)."""

    stage: str
    world_size: int
    collectives: list[tuple[str, int]]  # one step's (op, S bytes), in issue order
    predicted_comm: float  # the link's seconds for those collectives, one after another
    comm_alone: list[list[float]]  # the same collectives replayed alone: per replay, per op
    compute: dict[str, list[float]]  # "forward", "backward", "step" (AdamW alone), per repeat
    phases: dict[str, list[float]]  # the engine's "forward", "backward", "step", "after", "total"

    def median(self, what: str) -> float:
        """Median seconds of "comm" (alone), "compute" (all three phases), or an engine phase."""
        if what == "comm":  # each collective's median over the replays, summed
            return sum(statistics.median(op) for op in zip(*self.comm_alone))
        if what == "compute":
            return sum(statistics.median(v) for v in self.compute.values())
        return statistics.median(self.phases[what])

    @property
    def exposed(self) -> float:
        """Step minus compute alone: what communication (and contention) added to the step."""
        return self.median("total") - self.median("compute")

    def exposed_by_phase(self) -> dict[str, float]:
        """Per phase: the engine's phase minus the same compute alone ("after" has none)."""
        out = {p: self.median(p) - statistics.median(self.compute[p])
               for p in ("forward", "backward", "step")}
        return {**out, "after": self.median("after")}


@dataclass
class Run:
    """Everything notebook 10 measures on one group of N ranks."""

    world_size: int
    num_params: int
    sweep: cost.Sweep  # FIT_SIZES and CHECK_SIZES, all four ops
    link: cost.Link  # fitted on FIT_SIZES
    stages: dict[str, StageTime] = field(default_factory=dict)
    threshold: Any = None  # N = 2 only: n10_threshold.Threshold, a unit's gather and forward


def _slowest(values: list[float], group) -> list[float]:
    """Every rank's values -> the largest across the group's ranks, element by element."""
    t = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce(t, op="max", tag="lesson10/slowest", group=group)
    return t.tolist()


def fit_link(group, ops: tuple[str, ...] = cost.OPS, repeats: int = 5,
             burst: int = 4, warmup: int = 1) -> tuple[cost.Sweep, cost.Link]:
    """One sweep of FIT_SIZES and CHECK_SIZES in the same shuffled rounds; the link is fitted
    on FIT_SIZES only, so CHECK_SIZES are sizes it never saw, measured alongside."""
    sweep = cost.measure(sizes=FIT_SIZES + CHECK_SIZES, ops=ops, repeats=repeats, burst=burst,
                         group=group, burst_bytes=BURST_BYTES, warmup=warmup)
    return sweep, cost.fit(sweep.only(FIT_SIZES))


def _replay(events: list[comm.CommEvent], group) -> list[float]:
    """The collectives of `events` again, synchronously, one after another from a barrier:
    comm's recorded seconds for each, this rank's."""
    n = dist.get_world_size(group)
    calls = []
    for e in events:
        dtype = getattr(torch, e.dtype)  # "float32" -> torch.float32
        numel = e.nbytes // torch.empty(0, dtype=dtype).element_size()  # S's elements
        calls.append((e.op, torch.zeros(numel, dtype=dtype), torch.zeros(numel // n, dtype=dtype)))
    with comm.record_comm(group) as log:  # starts at a barrier
        for op, full, shard in calls:
            if op == "all_reduce":
                comm.all_reduce(full, tag="lesson10/replay", group=group)
            elif op == "reduce_scatter":
                comm.reduce_scatter(shard, full, tag="lesson10/replay", group=group)
            else:
                comm.all_gather(full, shard, tag="lesson10/replay", group=group)
    return [e.end - e.start for e in log.events]


class Floor:
    """Compute alone: the model's forward and backward with no engine (the bench's floor) and
    AdamW's step over `numel` fp32 elements (what one rank of the stage updates)."""

    def __init__(self, numel: int):
        self.model = GPT(MODEL)
        self.flat = torch.nn.Parameter(torch.zeros(numel))
        self.flat.grad = torch.full_like(self.flat, 1e-3)
        self.optimizer = torch.optim.AdamW([self.flat], lr=LR)

    def time(self, x: torch.Tensor, y: torch.Tensor, group) -> list[float]:
        """One round on every rank of `group` at once: the slowest rank's forward, backward
        and step seconds, from the spans of a comm recording."""
        with comm.record_comm(group) as log:
            with log.span("forward"):
                loss = self.model.loss(self.model(x), y)
            with log.span("backward"):
                loss.backward()
            with log.span("step"):
                self.optimizer.step()
        self.model.zero_grad(set_to_none=False)
        return _slowest([s.end - s.start for s in log.spans], group)


def stage_time(key: str, group, link: cost.Link, steps: int = 3, warmup: int = 1) -> StageTime:
    """Train stage `key` on `group`: `warmup` steps, then `steps` rounds of: one measured
    step, the same batch through the Floor (compute alone), and the step's collectives
    replayed alone. In the same rounds, so that a burst of load elsewhere hits all three."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    model = GPT(MODEL)
    engine = engines.make_engine(key, model, torch.optim.AdamW, group=group, lr=LR)
    psi = num_params(model)
    floor = Floor(psi if key == "ddp" else -(-psi // n))  # the elements this rank steps
    for seed in range(warmup):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, seed, rank, n)
        harness.train_step(engine, x, y)
        engine.wait_params()
        floor.time(x, y, group)
    phases: dict[str, list[float]] = {p: [] for p in ("forward", "backward", "step", "after",
                                                      "total")}
    compute: dict[str, list[float]] = {p: [] for p in ("forward", "backward", "step")}
    alone = []
    for seed in range(warmup, warmup + steps):
        x, y = harness.local_batch(model.make_batch, GLOBAL_BATCH, seed, rank, n)
        log = harness.measured_step(engine, x, y, memory=False).log
        span = {s.name: s for s in log.spans}
        end = max([s.end for s in log.spans] + [e.end for e in log.events if e.end])
        mine = [span[p].end - span[p].start for p in ("forward", "backward", "step")]
        mine += [end - span["step"].end, end]
        for p, s in zip(phases, _slowest(mine, group)):
            phases[p].append(s)
        for p, s in zip(compute, floor.time(x, y, group)):
            compute[p].append(s)
        events = [e for e in log.events if e.op in cost.SHARED_OPS]
        alone.append(_slowest(_replay(events, group), group))
    return StageTime(engines.label(key), n, [(e.op, e.nbytes) for e in events],
                     link.predict_events(events), alone, compute, phases)


def run_at(group, stages: tuple[str, ...] = engines.STAGE_ENGINES, steps: int = 3,
           with_threshold: bool = False, burst: int = 4) -> Run:
    """Everything for one group: the link, each stage, and (with_threshold) a unit's gather
    against its forward as the tokens grow (lessons/n10_threshold.py)."""
    from zerolab.lessons import n10_threshold  # it imports MODEL from here

    sweep, link = fit_link(group, burst=burst)
    run = Run(dist.get_world_size(group), num_params(GPT(MODEL)), sweep, link)
    for key in stages:
        run.stages[engines.label(key)] = stage_time(key, group, link, steps)
    if with_threshold:
        run.threshold = n10_threshold.sweep(group)
    return run


def bytes_to_seconds(sizes: tuple[int, ...] = (2, 3, 4), steps: int = 3,
                     stage_sizes: tuple[int, ...] | None = None) -> dict[int, Run | None]:
    """`run_at` for each N in `sizes`, in one launch of max(sizes) ranks (the first N ranks
    form a group, the others wait); the stages only at `stage_sizes` (default: every N), the
    threshold sweep at the smallest N. Returns, on each rank, {N: its Run, or None where it
    was not in the group}."""
    ctx = zerolab.init_from_env()
    out: dict[int, Run | None] = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))  # every rank of the job creates every group
        stages = engines.STAGE_ENGINES if stage_sizes is None or n in stage_sizes else ()
        out[n] = (run_at(group, stages, steps=steps, with_threshold=n == min(sizes))
                  if ctx.rank < n else None)
        dist.barrier()
    return out


# --- what the prediction exercises are scored against (zerolab.lessons.predictions) ----------


def _measure_prediction(id: str) -> float:
    """Inside 2 ranks: the measurement prediction `id` is scored against (rank 0's figure)."""
    zerolab.init_from_env()
    group = dist.new_group([0, 1])
    if id == "10.1":  # bytes rank 0 writes in one 4 MiB all-reduce
        with comm.record_comm(group) as log:
            comm.all_reduce(torch.zeros(MiB), tag="lesson10/predict", group=group)
        return float(log.events[-1].wire_bytes or 0)
    if id == "10.2":
        sweep = cost.measure(sizes=[16 * MiB], ops=["all_reduce"], group=group)
        return sweep.timings[0].median
    unfitted = cost.Link(0.0, 0.0, 2, dist.get_backend(group))  # predictions not needed here
    if id == "10.3":
        return stage_time("ddp", group, unfitted).median("comm")
    if id == "10.4":
        return stage_time("zero3", group, unfitted).median("total")
    raise ValueError(f"no measurement for prediction {id!r}")


def measured_for(id: str) -> float:
    """The measurement prediction `id` ("10.1" ... "10.4") is scored against: one launch."""
    return zerolab.launch(_measure_prediction, 2, args=(id,), timeout=600)[0]


# --- issue 29's check -------------------------------------------------------------------------


def _verdict(predicted: float, measured: float, band: float) -> str:
    miss = predicted / measured - 1
    return f"{miss:+6.0%}  {'within' if abs(miss) <= band else 'OUTSIDE'} {band:.0%}"


def format_band(link: cost.Link) -> str:
    """Where a link's band comes from, in one line."""
    fits = [link.shared] if link.model == "shared" else [link.per_op[op] for op in
                                                         cost.SHARED_OPS]
    points = sum(len(f.held_out_errors) for f in fits)
    return (f"band ±{link.band:.0%}: the largest miss of the {link.model} fit on each of its "
            f"{points} points, predicted with that point left out")


def format_check(runs: dict[int, Run], collectives: bool = True, stages: bool = True) -> str:
    """The prediction-vs-measurement table of `runs`: the collectives at CHECK_SIZES and each
    stage's communication per step, each against its N's band (cost.Link.band: the fit's
    worst held-out miss), with how many predictions fell within it."""
    lines, hits, total = [], 0, 0
    for n, run in runs.items():
        link = run.link
        if not (collectives or run.stages):
            continue  # a run with the link only: no stage to check
        lines.append(f"N = {n}: α {link.alpha * 1e6:.0f} µs, β {link.beta * 1e9:.3f} ns/B "
                     f"({link.bandwidth / 1e9:.2f} GB/s); {format_band(link)}")
        lines.append(f"  {'':16}{'S':>9}  {'measured':>10}  {'predicted':>10}  {'error':>6}")
        band = link.band
        for t in run.sweep.only(CHECK_SIZES).timings if collectives else ():
            if t.op not in cost.SHARED_OPS:
                continue
            p = link.predict(t.op, t.nbytes)
            hits, total = hits + (abs(p / t.median - 1) <= band), total + 1
            lines.append(f"  {t.op:16}{t.nbytes / MiB:>5.1f} MiB  {t.median * 1e3:>7.2f} ms  "
                         f"{p * 1e3:>7.2f} ms  {_verdict(p, t.median, band)}")
        for name, s in run.stages.items() if stages else ():
            m, p = s.median("comm"), s.predicted_comm
            hits, total = hits + (abs(p / m - 1) <= band), total + 1
            lines.append(f"  {name + ' step':16}{len(s.collectives):>5} ops  {m * 1e3:>7.2f} ms  "
                         f"{p * 1e3:>7.2f} ms  {_verdict(p, m, band)}")
    lines.append(f"{hits} of {total} predictions within their band")
    return "\n".join(lines)


def format_per_call(runs: dict[int, Run], stages: tuple[str, ...] = ("DDP", "ZeRO-1")) -> str:
    """Per N and stage: each op's replayed calls, alone, in ms per call (each call's median over
    the replays, averaged over the op's calls), beside the messages the model charges a call,
    and its mean S. Where the model's alpha is paid: per message, or per call."""
    lines = []
    for n, run in runs.items():
        for name in stages:
            s = run.stages.get(name)
            if s is None:
                continue
            medians = [statistics.median(op) for op in zip(*s.comm_alone)]  # per call
            parts = []
            for op in dict.fromkeys(op for op, _ in s.collectives):
                mine = [(t, nbytes) for t, (o, nbytes) in zip(medians, s.collectives) if o == op]
                size = sum(b for _, b in mine) / len(mine)  # S, mean over the op's calls
                per_call = sum(t for t, _ in mine) / len(mine)
                parts.append(f"{len(mine)} {op} of {size / MiB:.2f} MiB, "
                             f"{cost.messages(op, size, n).count} message(s): "
                             f"{per_call * 1e3:.2f} ms a call")
            lines.append(f"N = {n}, {name + ':':7} " + "; ".join(parts))
    return "\n".join(lines)


def quartiles(t: cost.Timing) -> tuple[float, float]:
    """First and third quartile of a timing's repeats (seconds)."""
    q1, _, q3 = statistics.quantiles(t.seconds, n=4, method="inclusive")
    return q1, q3


def breakdown(s: StageTime) -> dict[str, float]:
    """What plots.seconds.step_breakdown draws for one stage (medians, seconds)."""
    out = {p: statistics.median(s.compute[p]) for p in ("forward", "backward", "step")}
    return {**out, "measured": s.median("total"),
            "predicted": s.median("compute") + s.predicted_comm}


def format_steps(runs: dict[int, Run]) -> str:
    """Per N and stage: compute alone, communication (predicted), the step predicted
    (compute + communication, nothing hidden) and measured, exposed and hidden (ms)."""
    lines = [f"{'':12}{'compute':>8}{'comm':>7}{'step: predicted':>17}{'measured':>10}"
             f"{'error':>7}{'exposed':>9}{'hidden':>8}   (ms, medians, slowest rank)"]
    for n, run in runs.items():
        for name, s in run.stages.items():
            predicted = s.median("compute") + s.predicted_comm
            hidden = s.median("comm") - s.exposed
            lines.append(f"{name + ', N = ' + str(n):12}{s.median('compute') * 1e3:>8.1f}"
                         f"{s.predicted_comm * 1e3:>7.1f}{predicted * 1e3:>17.1f}"
                         f"{s.median('total') * 1e3:>10.1f}"
                         f"{predicted / s.median('total') - 1:>+7.0%}"
                         f"{s.exposed * 1e3:>9.1f}{hidden * 1e3:>8.1f}")
    return "\n".join(lines)


def format_phases(runs: dict[int, Run]) -> str:
    """Per N and stage: each phase of the engine's step minus the same compute alone (ms),
    beside the step's communication alone."""
    lines = [f"{'':12}{'forward':>9}{'backward':>9}{'step':>8}{'after':>8}{'comm alone':>12}"
             "   (ms: engine minus compute alone)"]
    for n, run in runs.items():
        for name, s in run.stages.items():
            by = s.exposed_by_phase()
            lines.append(f"{name + ', N = ' + str(n):12}" + "".join(
                f"{by[p] * 1e3:>{w}.1f}" for p, w in (("forward", 9), ("backward", 9),
                                                       ("step", 8), ("after", 8)))
                + f"{s.median('comm') * 1e3:>12.1f}")
    return "\n".join(lines)


def acceptance(sizes: tuple[int, ...] = (2, 3), steps: int = 3,
               burst: int = 4) -> dict[int, Run | None]:
    """Inside ranks: the link and the stages' communication at each N (no threshold sweep)."""
    ctx = zerolab.init_from_env()
    out: dict[int, Run | None] = {}
    for n in sizes:
        group = dist.new_group(list(range(n)))
        out[n] = run_at(group, steps=steps, burst=burst) if ctx.rank < n else None
        dist.barrier()
    return out


def acceptance_table(sizes: tuple[int, ...] = (2, 3), steps: int = 3, burst: int = 4) -> str:
    """Issue 29's done-when check, launched from here: prints nothing, returns the table.
    burst: back-to-back calls per timed repeat in the sweep (cost.measure; 1: each alone)."""
    runs = zerolab.launch(acceptance, max(sizes), args=(sizes, steps, burst), timeout=1800)[0]
    return format_check(runs)
