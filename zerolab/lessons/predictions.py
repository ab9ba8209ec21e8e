"""Graded predictions: the learner writes a number before a measuring cell; the run scores it.

A *prediction exercise* asks for one quantity the next cell measures: peak bytes by category,
the bytes one rank sends in a collective, a step's or a collective's seconds. It is scored
against the measurement, by kind:

    kind       right when                                     e.g.
    "bytes"    |predicted - measured| <= rounding / 2          rounding 1024: to the KiB
    "count"    predicted == measured (exact)                   collectives in a step
    "seconds"  |predicted / measured - 1| <= band              band 0.35: within 35%
    "tokens"   the same, for a count of tokens that times decide  a threshold's tokens per rank

and the verdict says which way and by how much it missed: "too high: 1.62x the measurement
(+62%), outside the ±35% band". Bytes are exact facts of the run (a formula predicts them to
the byte, or to the stated rounding where headers or padding blur them); times vary from run
to run, so they get a band.

    p = predictions.PREDICTIONS["10.2"]        # what is asked, and how it is scored
    predictions.score(0.004, 0.0052, "seconds", band=0.35).message

Predictions of several categories at once (peak bytes of params, grads, optimizer, ...):
`score_each(predicted: dict, measured: dict, kind)` scores each and says which missed.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from dataclasses import dataclass

KINDS = ("bytes", "count", "seconds", "tokens")


@dataclass(frozen=True)
class Score:
    """One prediction against its measurement."""

    ok: bool
    predicted: float | None  # None: not attempted
    measured: float
    kind: str
    message: str  # the verdict, with the direction and size of the miss

    @property
    def ratio(self) -> float | None:
        """predicted / measured (None: not attempted, or nothing measured)."""
        if self.predicted is None or self.measured == 0:
            return None
        return self.predicted / self.measured


def _show(value: float, kind: str) -> str:
    if kind == "seconds":
        return f"{value * 1e3:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"
    if kind == "bytes":
        return f"{value:,.0f} B"
    if kind == "tokens":
        return f"{value:,.0f} tokens"
    return f"{value:,.0f}"


def _miss(predicted: float, measured: float, kind: str) -> str:
    """'too high by 1,024 B (+0.4%)' or 'too low: 0.62x the measurement (-38%)'."""
    way = "too high" if predicted > measured else "too low"
    if measured == 0:
        return f"{way} by {_show(abs(predicted), kind)} (the measurement is 0)"
    rel = predicted / measured - 1
    if kind in ("seconds", "tokens"):
        return f"{way}: {predicted / measured:.2f}x the measurement ({rel:+.0%})"
    return f"{way} by {_show(abs(predicted - measured), kind)} ({rel:+.1%})"


def score(predicted: float | None, measured: float, kind: str, *, rounding: float = 0,
          band: float = 0.35) -> Score:
    """Score one prediction. kind: "bytes" (right within rounding / 2: rounding 0 is exact),
    "count" (exact) or "seconds" (right within a relative `band`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    if predicted is None:
        return Score(False, None, measured, kind,
                     "not attempted: write your prediction above, then run this cell again")
    if kind in ("seconds", "tokens"):
        if measured <= 0:
            raise ValueError(f"a {'time' if kind == 'seconds' else 'count of tokens'} to score "
                             f"against must be positive, got {measured}")
        ok = abs(predicted / measured - 1) <= band
        rule = f"the ±{band:.0%} band"
    elif kind == "bytes":
        ok = abs(predicted - measured) <= rounding / 2
        rule = "exact" if rounding == 0 else f"rounding to {_show(rounding, kind)}"
    else:
        ok = predicted == measured
        rule = "exact"
    shown = f"predicted {_show(predicted, kind)}, measured {_show(measured, kind)}"
    if ok:
        exact = predicted == measured
        return Score(True, predicted, measured, kind,
                     f"right: {shown}" + ("" if exact else f" ({rule}; "
                                          f"{_miss(predicted, measured, kind)})"))
    where = "outside" if kind in ("seconds", "tokens") else "beyond"
    return Score(False, predicted, measured, kind,
                 f"{_miss(predicted, measured, kind)}, {where} {rule}: {shown}")


def score_each(predicted: dict[str, float | None], measured: dict[str, float], kind: str, *,
               rounding: float = 0, band: float = 0.35) -> dict[str, Score]:
    """Score several at once (peak bytes by category): one Score per measured key. A key the
    learner left out counts as not attempted; one the run did not measure is an error."""
    extra = set(predicted) - set(measured)
    if extra:
        raise ValueError(f"predicted {sorted(extra)}, which the run does not measure; "
                         f"it measures {sorted(measured)}")
    return {k: score(predicted.get(k), m, kind, rounding=rounding, band=band)
            for k, m in measured.items()}


# Note: a measurement withheld. The notebooks ship with every prediction None, and nbval compares
# what they store: a cell that shows a graded prediction's measurement runs as always (its checks
# and its code run under nbval), but what it prints shows only once the learner has written a
# number, so that no answer sits under its question before they guess.


@contextlib.contextmanager
def withheld(prediction_id: str, predicted: float | None) -> Iterator[bool]:
    """Run the block; what it prints shows once the learner has predicted `prediction_id`
    (yields True), else one line says it is withheld (yields False)."""
    if prediction_id not in PREDICTIONS:
        raise KeyError(f"no prediction {prediction_id!r}; there are {sorted(PREDICTIONS)}")
    if predicted is not None:
        yield True
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield False
    print(f"withheld until you predict {prediction_id}: write your number in the cell above, "
          f"run it, then run this cell again")


def shown(prediction_id: str, predicted: float | None, figure: object) -> object:
    """`figure` once the learner has predicted `prediction_id` (a cell shows its last value),
    else None, and the line that says it is withheld."""
    with withheld(prediction_id, predicted) as ok:
        pass
    return figure if ok else None


@dataclass(frozen=True)
class PredictionExercise:
    """What a notebook asks the learner to predict, and how the answer is scored."""

    id: str  # "10.1": notebook 10's first prediction; "05.p1": notebook 05's (01 to 09)
    notebook: str  # the notebook's file stem
    name: str  # the variable the learner fills in the notebook
    question: str  # what to predict, in one sentence, with its unit
    kind: str  # "bytes", "count" or "seconds"
    rounding: float = 0  # bytes: right within rounding / 2
    band: float = 0.35  # seconds: right within this relative miss
    measure: str = ""  # "module:function" returning the measured value (for the grader)

    def score(self, predicted: float | None, measured: float) -> Score:
        return score(predicted, measured, self.kind, rounding=self.rounding, band=self.band)


_MEASURED = "zerolab.lessons.measured:measured_for"  # notebooks 01 to 09: ids "NN.pK"
_10 = "10_bytes_to_seconds"
_12B = "zerolab.lessons.n12_predict:measured_for"
_MEASURE = "zerolab.lessons.n10_time:measured_for"
_11 = "11_precision_and_optimizers"
_MEASURE_11 = "zerolab.lessons.n11_precision:measured_for"
_12 = "12_meshes_and_scale"
_MEASURE_12 = "zerolab.lessons.n12_meshes:measured_for"
PREDICTIONS = {p.id: p for p in (
    PredictionExercise(
        "01.p1", "01_ddp", "predicted_all_reduced_bytes",
        "Bytes (S, summed over the buckets) one rank all-reduces in one DDP step of the larger "
        "GPT, bucket_bytes=1 << 20", "bytes", measure=_MEASURED),
    PredictionExercise(
        "01b.p1", "01b_memory", "predicted_model_state_bytes",
        "Model-state bytes (params + grads + optimizer) rank 0 holds after one fp32 AdamW step "
        "with DDP, to the nearest KiB", "bytes", rounding=1024, measure=_MEASURED),
    PredictionExercise(
        "02.p1", "02_collectives", "predicted_all_reduce_wire_bytes",
        "Bytes rank 0 writes to its sockets in one all-reduce of S = 49,152 bytes at N = 3, "
        "to the nearest 4 KiB", "bytes", rounding=4096, measure=_MEASURED),
    PredictionExercise(
        "03.p1", "03_zero1", "predicted_zero1_optimizer_bytes",
        "Optimizer-state bytes rank 0 holds with ZeRO-1 at N = 4 after step(), to the nearest "
        "KiB", "bytes", rounding=1024, measure=_MEASURED),
    PredictionExercise(
        "04.p1", "04_zero2", "predicted_peak_grad_bytes",
        "The most gradient bytes rank 0 holds at any moment of one step of ZeRO-2 reduced "
        "after backward (ZeRO2AfterBackward), N = 2", "bytes", measure=_MEASURED),
    PredictionExercise(
        "05.p1", "05_zero3", "predicted_all_gathers",
        "All-gathers rank 0 issues in one ZeRO-3 step with prefetch off, forward and backward "
        "together (the root stays gathered from forward to backward)", "count", measure=_MEASURED),
    PredictionExercise(
        "06.p1", "06_fsdp2", "predicted_fsdp2_bytes",
        "Model-state bytes rank 0 holds with torch's FSDP2 (fully_shard) after step(), N = 2, "
        "to the nearest KiB", "bytes", rounding=1024, measure=_MEASURED),
    PredictionExercise(
        "07.p1", "07_scaling", "predicted_zero3_sent_bytes",
        "Bytes rank 0 sends in one ZeRO-3 step at N = 4, in the ring model (as zerolab.comm "
        "records each call), to the nearest KiB", "bytes", rounding=1024, measure=_MEASURED),
    PredictionExercise(
        "08.p1", "08_activations", "predicted_block_bytes",
        "Bytes block 0 saves for backward, h = 64, b = 2 sequences of s = 32 tokens, SDPA, "
        "fp32, to the nearest 4 KiB", "bytes", rounding=4096, measure=_MEASURED),
    PredictionExercise(
        "09.p1", "09_past_one_node", "predicted_bytes_across",
        "Bytes an HSDP rank (N = 4, nodes of 2) sends to the other node in one step, in the "
        "ring model, to the nearest KiB", "bytes", rounding=1024, measure=_MEASURED),
    PredictionExercise(
        "09b.p1", "09b_built_and_saved", "predicted_kept_bytes",
        "Model-state bytes rank 0 holds once ZeRO-3 has built notebook 09's GPT born sharded "
        "(meta device), N = 4, before any step, to the nearest KiB", "bytes", rounding=1024,
        measure=_MEASURED),
    PredictionExercise(
        "10.1", _10, "predicted_wire_bytes",
        "Bytes rank 0 writes to its sockets in one 4 MiB all-reduce at N = 2 (gloo's ring), "
        "to the nearest 4 KiB", "bytes", rounding=4096, measure=_MEASURE),
    PredictionExercise(
        "10.2", _10, "predicted_all_reduce_s",
        "Seconds of a 16 MiB all-reduce at N = 2, from your alpha and beta", "seconds",
        measure=_MEASURE),
    PredictionExercise(
        "10.3", _10, "predicted_ddp_comm_s",
        "Seconds DDP's collectives of one step take alone at N = 2 (its buckets' all-reduces "
        "one after another)", "seconds", measure=_MEASURE),
    PredictionExercise(
        "10.4", _10, "predicted_zero3_step_s",
        "Seconds of one ZeRO-3 step at N = 2: compute alone plus its communication, if none "
        "of it hides", "seconds", measure=_MEASURE),
    PredictionExercise(
        "10.5", _10, "predicted_threshold_tokens",
        "Tokens per rank at which one block's forward takes as long as its ZeRO-3 all-gather "
        "at N = 2, from your C, alpha and beta", "tokens", band=0.5,  # wider than a time's:
        # T* divides a difference of two times (the link's gather, t0) by a fitted slope
        measure="zerolab.lessons.n10_threshold:measured_for"),
    PredictionExercise(
        "11.p1", _11, "predicted_float8_gather_bytes",
        "Bytes rank 0 sends, in the ring model, in the float8 codes' all-gathers (forward and "
        "backward, not the scales) of one ZeRO-3 step, a scale per tensor, N = 2, to the nearest "
        "KiB", "bytes", rounding=1024, measure=_MEASURE_11),
    PredictionExercise(
        "11.p2", _11, "predicted_grads_before_last",
        "Gradient bytes rank 0 holds (model_state_bytes()['grads']) just before the last of 4 "
        "micro-batches when only the last reduces, ZeRO-3, N = 2, to the nearest KiB", "bytes",
        rounding=1024, measure=_MEASURE_11),
    PredictionExercise(
        "11.p3", _11, "predicted_fused_adamw_s",
        "Seconds of one step of torch.optim.AdamW(fused=True) over one flat fp32 tensor of "
        "2^23 parameters on this machine's CPU, one process", "seconds", measure=_MEASURE_11),
    PredictionExercise(
        "12.p1", _12, "predicted_tp_peer_bytes",
        "Bytes rank 0 sends to its tensor-parallel peer in one step of the 2x2 run (4 sequences "
        "per data-parallel rank), as its socket counters count them, to the nearest 32 KiB",
        "bytes", rounding=32768, measure=_MEASURE_12),
    PredictionExercise(
        "12.p2", _12, "predicted_crossover_seqs",
        "The fewest sequences (of 16 tokens) per data-parallel rank at which rank 0 sends more "
        "bytes to its tensor-parallel peer than to its data-parallel peer in one step",
        "count", measure=_MEASURE_12),
    PredictionExercise(
        "12b.p1", "12b_peak_without_building", "predicted_zero2_peak_bytes",
        "Peak bytes rank 0 holds in one fp32 ZeRO-2 step of the course GPT at N = 3, 4 "
        "sequences per rank (the ledger's peak), to the nearest 16 KiB", "bytes",
        rounding=16384, measure=_12B),
)}
