"""The benchmark's report: per-rank results combined, a text table, a figure.

`python -m zerolab.bench` (bench.py) runs the ranks; this file turns what they return into the
report (JSON-ready dict), the table it prints and the PNG it draws.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

import torch

from zerolab import engines, theory
from zerolab.bench.config import (
    COUNTERPARTS,
    MEMORY_TARGETS,
    OVERHEAD_TARGETS,
    TRACKER_LIMIT,
    BenchConfig,
    label,
)
from zerolab.engines import STAGE_ENGINES


def summarize(config: BenchConfig, results: list[list[dict[str, Any]]],
              load: tuple[list[float], list[float]], command: str) -> dict[str, Any]:
    """Combine the ranks' results of every launch (one side by side, or one per pair)."""
    psi, root = results[0][0]["params"], results[0][0]["root_params"]
    rows, targets, floors, floor_rounds = [], [], [], []
    timed = range(config.warmup, config.warmup + config.steps)
    for group, per_rank in enumerate(results):
        # forward + backward alone, the slowest rank per round (config.forward_backward)
        floor_times = [max(res["floor_times"][i] for res in per_rank) for i in timed]
        floor_cpu = [sum(res["floor_cpu_times"][i] for res in per_rank) for i in timed]
        group_rows = {key: _row(config, key, per_rank, group, psi, root, floor_times, floor_cpu)
                      for key in per_rank[0]["times"]}
        floors.append(statistics.median(floor_times))
        floor_rounds.append(floor_times)
        targets += _targets(config, group_rows, floors[-1])
        rows += group_rows.values()
    first = results[0][0]
    return {
        "command": command,
        "config": {**asdict(config), "atol": config.atol},
        "model": {"params": psi, "root_params": root, "gpt_config": asdict(config.gpt_config()),
                  "tokens_per_sequence": config.tokens},
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cores": os.cpu_count(),
            "backend": first["backend"], "device": first["device"],
            "threads_per_rank": first["threads"],
            "load_average_start": load[0], "load_average_end": load[1],
        },
        "method": {
            "step_time": "per round, the slowest rank's time from a barrier to the end of "
                         "zero_grad; median over the timed rounds; engines rotated per round",
            "overhead": "per round, the step time minus the floor's (forward + backward "
                        "alone, no engine) in the same round: what the engine adds",
            "ratio": "overhead_ratio (the targets): median over rounds of the two engines' "
                     "overheads in the same round; step_ratio: the same of their step times; "
                     "interval: the sign test's distribution-free interval for that median "
                     "(bench_report.median_interval), interval_confidence its coverage",
            "torch_settings": "DistributedDataParallel(gradient_as_bucket_view=True, "
                              f"bucket_cap_mb={config.bucket_mb:g}); ZeroRedundancyOptimizer("
                              "parameters_as_bucket_view=True); fully_shard on each block, then "
                              "on the root (defaults); AdamW(lr, weight_decay) for all; "
                              "zero_grad(set_to_none=False) for DDP, as zerolab's engines keep "
                              "their gradient buffers",
            "memory": "zerolab.track_memory over one step (forward, backward, optimizer step), "
                      "separate from timing; peak = largest total of live tensor bytes",
            "model_state": "distinct storages of params, grads, optimizer state after step(); "
                           "formula: zerolab.theory.model_state_memory (fp32 Adam)",
            "sent_bytes": "ring-algorithm bytes this rank sends in one step: zerolab's from "
                          "record_comm, torch's from the c10d collectives it issues; formula: "
                          "zerolab.theory.comm_volume (ZeRO-3 and FSDP2: root_numel = the "
                          "root unit's, kept gathered from forward to backward)",
            "measuring_cost": "tracked_s: a step under the comm recorder, the memory "
                              "tracker and the c10d counter (two dispatch modes); recorded_s: "
                              "under the comm recorder only; plain_s: neither, just before them; "
                              "tracker_overhead: the median over measure_rounds of tracked_s / "
                              "plain_s (recorder_overhead: of recorded_s / plain_s)",
            "matches_reference": f"max |param - the reference's param| <= atol={config.atol:g} "
                                 "after the last step, same initial weights and batches",
        },
        "engines": rows,
        "floor_step_s": floors,  # per launch: forward + backward alone, median over the rounds
        "floor_times_s": floor_rounds,  # per launch, per timed round (the slowest rank's)
        "targets": targets,
    }


def _row(config: BenchConfig, key: str, per_rank: list[dict[str, Any]], group: int,
         psi: int, root: int, floor_times: list[float], floor_cpu: list[float]
         ) -> dict[str, Any]:
    """One engine of one launch: its step times (slowest rank per round), overheads above the
    floor of the same round (and in CPU seconds, every rank's), and measurements."""
    timed = range(config.warmup, config.warmup + config.steps)
    step_times = [max(res["times"][key][i] for res in per_rank) for i in timed]
    overheads = [t - f for t, f in zip(step_times, floor_times)]
    cpu = [sum(res["cpu_times"][key][i] for res in per_rank) - f for i, f in zip(timed, floor_cpu)]
    diff = max(res["max_abs_diff"][key] for res in per_rank)
    row: dict[str, Any] = {
        "key": key, "label": label(key), "counterpart": COUNTERPARTS.get(key),
        "group": group, "reference": per_rank[0]["reference"],
        "step_times_s": step_times, "median_step_s": statistics.median(step_times),
        "overheads_s": overheads, "median_overhead_s": statistics.median(overheads),
        # The same in CPU seconds, every rank's (gloo's threads included): what the engine's
        # work adds, less moved than wall time by other jobs on the machine (no waiting in it).
        "cpu_overheads_s": cpu, "median_cpu_overhead_s": statistics.median(cpu),
        # CPU seconds per step of each rank's process (compute and gloo's threads): less
        # sensitive than wall time to other jobs on the machine.
        "median_cpu_s_per_rank": [statistics.median(res["cpu_times"][key][i] for i in timed)
                                  for res in per_rank],
        "median_page_faults_per_rank": [statistics.median(res["page_faults"][key][i]
                                                          for i in timed) for res in per_rank],
        "max_abs_diff": diff, "matches_reference": diff <= config.atol,
    }
    # Cores kept busy by the step: every rank's CPU seconds over the step's wall seconds.
    row["cores_busy"] = sum(row["median_cpu_s_per_rank"]) / row["median_step_s"]
    if not config.measure:
        return row
    m = [res["measured"][key] for res in per_rank]
    zl = key in STAGE_ENGINES  # issues its collectives through zerolab.comm
    states = [sum(r["model_state_bytes"].values()) for r in m]
    sent = [r["record_comm_bytes"] if zl else r["c10d_bytes"] for r in m]
    info = engines.ENGINES[key]
    formula_state = theory.model_state_memory(psi, config.world_size, info.stage)
    kept = root if theory.stage_name(info.traffic) == "ZeRO-3" else 0  # the root, not regathered
    formula_sent = theory.comm_volume(psi, config.world_size, info.traffic,
                                      root_numel=kept).ring_sent_bytes

    def seconds(name: str) -> list[float]:  # per measuring round, the slowest rank's
        return [max(r[name][i] for r in m) for i in range(len(m[0][name]))]

    plain, recorded, tracked = seconds("plain_s"), seconds("recorded_s"), seconds("tracked_s")
    row.update({
        "peak_bytes_per_rank": [r["peak_bytes"] for r in m],
        "peak_by_category_per_rank": [r["peak_by_category"] for r in m],
        "device_peak_bytes_per_rank": [r["device_peak_bytes"] for r in m],
        "device_rise_bytes_per_rank": [r["device_rise_bytes"] for r in m],
        "tracker_rise_bytes_per_rank": [r["tracker_rise_bytes"] for r in m],
        "model_state_bytes_per_rank": [r["model_state_bytes"] for r in m],
        "model_state_formula_bytes": formula_state.as_dict(),
        "model_state_formula": theory.memory_formula(info.stage),
        "model_state_to_formula": max(states) / formula_state.total,
        "sent_bytes_per_rank": sent,
        "sent_formula_bytes": formula_sent,
        "sent_to_formula": max(sent) / formula_sent if formula_sent else None,
        "sent_bytes_source": "zerolab.record_comm" if zl else
        "c10d collectives counted by CollectiveCounter, ring formula",
        "sent_by_op_per_rank": [r["record_comm_by_op"] if zl else r["c10d_by_op"] for r in m],
        "c10d_bytes_per_rank": [r["c10d_bytes"] for r in m],
        "c10d_calls_per_rank": [r["c10d_calls"] for r in m],
        "c10d_unknown_ops": sorted({op for r in m for op in r["c10d_unknown_ops"]}),
        "plain_s": plain, "recorded_s": recorded, "tracked_s": tracked,
        "recorder_overhead": statistics.median(r / p for r, p in zip(recorded, plain)),
        "tracker_overhead": statistics.median(t / p for t, p in zip(tracked, plain)),
    })
    return row


def _targets(config: BenchConfig, rows: dict[str, dict[str, Any]],
             floor: float) -> list[dict[str, Any]]:
    """Each zerolab stage of this launch against its torch counterpart, if both ran in it.
    floor: this launch's forward + backward alone, in seconds (no engine is faster)."""
    targets = []
    for key, limit in OVERHEAD_TARGETS.items():
        other = COUNTERPARTS[key]
        if key in rows and other in rows:
            mine, theirs = rows[key], rows[other]
            # Both ran in every round, seconds apart, so a machine that slows down for a while
            # slows both; the median of their per-round ratios cancels that.
            ratios = [_over(a, b) for a, b in zip(mine["overheads_s"], theirs["overheads_s"])]
            steps = [a / b for a, b in zip(mine["step_times_s"], theirs["step_times_s"])]
            cpus = [_over(a, b) for a, b in zip(mine["cpu_overheads_s"], theirs["cpu_overheads_s"])]
            interval, step_interval = median_interval(ratios), median_interval(steps)
            cpu_interval = median_interval(cpus)
            mine.update(overhead_ratio_to_counterpart=statistics.median(ratios),
                        paired_ratio_to_counterpart=statistics.median(steps),
                        ratio_to_counterpart=mine["median_step_s"] / theirs["median_step_s"])
            targets.append({
                "what": f"{label(key)} overhead / {label(other)}'s",
                "paired_ratio": mine["overhead_ratio_to_counterpart"], "limit": limit,
                "ratio": mine["median_overhead_s"] / theirs["median_overhead_s"],
                "met": mine["overhead_ratio_to_counterpart"] <= limit,
                "interval": interval and interval[:2],
                "interval_confidence": interval and interval[2],
                "step_ratio": mine["paired_ratio_to_counterpart"],
                "step_interval": step_interval and step_interval[:2],
                "cpu_ratio": statistics.median(cpus), "cpu_interval": cpu_interval and
                cpu_interval[:2],
                "floor_ratio": floor / theirs["median_step_s"]})
    for key, limit in MEMORY_TARGETS.items():
        other = COUNTERPARTS[key]
        if config.measure and key in rows and other in rows:
            ratio = max(rows[key]["peak_bytes_per_rank"]) / max(rows[other]["peak_bytes_per_rank"])
            rows[key]["peak_ratio_to_counterpart"] = ratio
            targets.append({"what": f"{label(key)} peak memory per rank / {label(other)}",
                            "ratio": ratio, "limit": limit, "met": ratio <= limit})
    return targets


def _over(mine: float, theirs: float) -> float:
    """One round's ratio of overheads. If the counterpart's step took no longer than the floor
    (its overhead lost in the round's noise), the round counts against zerolab's stage: inf."""
    return mine / theirs if theirs > 0 else math.inf


# Note: how sure a verdict is. The per-round ratios scatter, and their median moves by a few
# percent between runs here, so a median of 1.02 against a limit of 1.00 may be a difference or
# chance. The sign test gives an interval for the median that assumes nothing about how the
# ratios are distributed, only that the rounds are independent draws: each ratio falls below
# the true median with probability 1/2, so the count below it, B, is Binomial(n, 1/2), and the
# j-th smallest and j-th largest ratios enclose the median unless B < j or B > n - j. A machine
# whose speed drifts during the run makes the rounds a little dependent; pairing the two
# engines within each round is what keeps a slow drift out of the ratios themselves.
def median_interval(values: list[float], confidence: float = 0.95
                    ) -> tuple[float, float, float] | None:
    """(low, high, coverage): the narrowest [j-th smallest, j-th largest] of `values` that holds
    the median of the distribution they were drawn from with probability `coverage` >=
    `confidence`, whatever that distribution (see the Note above). None if even [min, max] is
    not that sure (fewer than 6 values at 95%)."""
    xs, n = sorted(values), len(values)
    best = None
    for j in range(1, (n + 1) // 2 + 1):
        coverage = 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n  # 1 - 2 P(B < j)
        if coverage < confidence:
            break
        best = (xs[j - 1], xs[n - j], coverage)
    return best


def verdict(target: dict[str, Any]) -> str:
    """"met" / "MISSED", and for step times whether the run's noise could have decided it."""
    word = "met" if target["met"] else "MISSED"
    if "paired_ratio" not in target:
        return word
    if target["interval"] is None:
        return f"{word} (too few rounds to tell it from noise)"
    low, high = target["interval"]
    if low <= target["limit"] < high:
        return f"{word}, but within this run's noise (the interval holds {target['limit']:.2f})"
    return f"{word} (the interval lies {'below' if target['met'] else 'above'} it)"


def _in(n: float, scale: float) -> str:
    return f"{n / scale:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table, one engine per row (grouped by pair), the targets, what
    measuring costs, and how to read it all."""
    rows = report["engines"]
    cfg, env = report["config"], report["environment"]
    measured = "peak_bytes_per_rank" in rows[0]
    largest = max((max(r["peak_bytes_per_rank"]) for r in rows), default=0) if measured else 0
    unit, scale = ("KiB", 2**10) if 0 < largest < 2**20 else ("MiB", 2**20)
    header = ["engine", "step ms", "over floor ms", "overhead vs torch", f"peak {unit}/rank",
              "  params/grads/optim/other", f"state {unit}/rank", "/formula",
              f"sent {unit}/rank/step", "/formula", "matches ref (max |diff|)"]
    lines: list[list[str] | str] = []
    for r in rows:
        if cfg["pairs"] and r["key"] in STAGE_ENGINES:
            lines.append(f"pair: {r['label']} against {label(r['reference'])} (reference)")
        lines.append(_cells(r, measured, scale))
    widths = [max(len(row[i]) for row in [header, *lines] if isinstance(row, list))
              for i in range(len(header))]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    mode = "in pairs, one launch each" if cfg["pairs"] else "side by side in the same ranks"
    out = [f"{report['model']['params']:,}-parameter GPT (n_layer={cfg['n_layer']}, "
           f"n_embd={cfg['n_embd']}, vocab={cfg['vocab_size']}, block={cfg['block_size']}), "
           f"{report['model']['tokens_per_sequence']} tokens/sequence, world size "
           f"{cfg['world_size']} ({env['backend']}, {env['threads_per_rank']} thread/rank), "
           f"global batch {cfg['global_batch']}, {cfg['warmup']} warm-up + {cfg['steps']} "
           f"timed rounds, {mode}",
           "load average (1, 5, 15 min) at start " + _load(env["load_average_start"])
           + ", at end " + _load(env["load_average_end"]) + f" on {env['cores']} cores",
           fmt.format(*header), "  ".join("-" * w for w in widths)]
    out += [fmt.format(*line) if isinstance(line, list) else line for line in lines]
    if env["backend"] == "gloo":
        out.append("gloo has no reduce-scatter: torch's (FSDP2's) runs an all-reduce, 2(N-1)/N*S "
                   "where the table counts (N-1)/N*S; zerolab's sends each chunk to its owner, "
                   "(N-1)/N*S")
    if cfg["steps"] < 5:
        out.append(f"note: {cfg['steps']} timed round(s): the timings are indicative only")
    out.append("forward + backward alone (no collective, no optimizer step: the floor under "
               "every engine), median ms: " + ", ".join(
                   f"{1e3 * s:.0f}" for s in report["floor_step_s"])
               + (" (one per pair)" if cfg["pairs"] else ""))
    for t in report["targets"]:
        if "paired_ratio" in t:
            # Three decimals: at two, a median of 1.004 would read "1.00 ... MISSED".
            out.append(f"target {t['what']}: {t['paired_ratio']:.3f} (median of per-round "
                       f"ratios{_sure(t['interval'], t['interval_confidence'])}; ratio of "
                       f"medians {t['ratio']:.3f}) <= {t['limit']:.2f}: {verdict(t)}")
        else:
            out.append(f"target {t['what']}: {t['ratio']:.2f} <= {t['limit']:.2f}: {verdict(t)}")
    for t in (t for t in report["targets"] if "step_ratio" in t):
        out.append(f"  {t['what'].split(' overhead')[0]}, for comparison: its overhead in CPU "
                   f"seconds (every rank's), {t['cpu_ratio']:.3f} of the counterpart's"
                   f"{_sure(t['cpu_interval'], t['interval_confidence'])}; whole steps, "
                   f"{t['step_ratio']:.3f}{_sure(t['step_interval'], t['interval_confidence'])} "
                   f"(the floor alone: {t['floor_ratio']:.3f} of the counterpart's step)")
    if measured and any(None not in r["device_rise_bytes_per_rank"] for r in rows):
        # The allocator counts every tensor of the process, the other engines' in the same rank
        # too: what the step added above what was live at its start is what compares.
        out.append(f"what a step adds above what was live at its start, {unit}/rank (the rank "
                   "with more), by the CUDA allocator (max_memory_allocated - memory_allocated) "
                   "/ by the tracker: " + ", ".join(
                       f"{_short_label(r)} {_in(max(r['device_rise_bytes_per_rank']), scale)}/"
                       f"{_in(max(r['tracker_rise_bytes_per_rank']), scale)}"
                       for r in rows if None not in r["device_rise_bytes_per_rank"]))
    if measured:
        costs = [f"{_short_label(r)} {r['recorder_overhead']:.2f}x/{r['tracker_overhead']:.2f}x"
                 + ("" if r["tracker_overhead"] <= TRACKER_LIMIT else " (over the limit)")
                 for r in rows]
        out.append(f"what measuring costs, a step's time / a plain step's just before it (comm "
                   f"recorder / comm recorder + memory tracker, median of "
                   f"{cfg['measure_rounds']}; limit {TRACKER_LIMIT:.1f}x): " + ", ".join(costs))
    if env["backend"] == "gloo":  # every rank on this machine's cores
        out.append(f"cores busy during a step (CPU seconds of every rank / the step's seconds), "
                   f"on {env['cores']} cores: "
                   + ", ".join(f"{_short_label(r)} {r['cores_busy']:.2f}" for r in rows))
    out.append("page faults per step (median, the rank with more): " + ", ".join(
        f"{_short_label(r)} {max(r['median_page_faults_per_rank']):,.0f}" for r in rows))
    out.append(HOW_TO_READ)
    return "\n".join(out)


HOW_TO_READ = """How to read it:
- step ms: median, over the timed rounds, of the slowest rank's step (forward, backward,
  optimizer step, zero_grad). Other jobs on the machine move it.
- forward + backward alone (the floor): the same model trained by no engine, in the same
  rotation: the compute every engine does, with no collective and no optimizer step.
- over floor ms: the median over rounds of the step minus the floor of the same round: the
  engine's overhead, what it adds to the compute. "overhead vs torch" is the median of the
  per-round ratios of overheads to the torch counterpart's, which ran in the same round
  seconds apart: the targets are checked on it. Beside each target, an interval that holds
  that median with at least 95% probability, its own coverage printed (the sign test's: the
  j-th smallest to the j-th largest ratio, no assumption on how they scatter; with 30 rounds,
  96%): where it holds the limit, this run cannot tell the difference from noise;
  more rounds (--steps) narrow it. A round in which the counterpart's step took no longer
  than the floor counts against the stage. Whole-step ratios are printed below the targets.
- peak: the largest total of live tensor bytes during one step, on the rank with the larger
  one, split at that moment into params/grads/optimizer state/other (activations, gathered
  units, gradient buckets in flight).
- state: model-state bytes held after step(). /formula divides by zerolab.theory's (fp32 Adam):
  DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N; a little over 1.00 is padding
  to N equal shards and Adam's step counters; torch's ZeroRedundancyOptimizer shards whole
  parameters, so its ranks hold unequal parts.
- sent: ring-model bytes one rank sends per step. /formula divides by 2Ψ·4 B·(N-1)/N (DDP,
  ZeRO-1, ZeRO-2), 3Ψ (torch's ZeRO-1, which all-reduces and then broadcasts) or 3Ψ less the
  root (ZeRO-3 and FSDP2 keep the root unit, embeddings and head, gathered from forward to
  backward: it is not gathered again).
- matches ref: the largest |parameter - the reference's| after the last step; 0 is bitwise
  equal (at N=2 every sum of two numbers is exact in any order).
- what measuring costs: a plain step, one under the comm recorder, then one under the memory
  tracker (and the c10d counter) as well; each measured step against the plain one just
  before it. The tracker follows every op (keep it off when timing).
- cores busy (gloo): the CPU seconds that every rank's threads (compute, and gloo's, which
  copy every byte sent) spent in a step, over the step's wall seconds. Close to the number of
  cores, the step is bound by the CPU: on one machine, sending costs CPU time too (the kernel
  copies loopback bytes), so overlapping it with compute hides nothing, and an engine is as
  fast as the CPU work it does. There ZeRO-3, which sends 1.5x DDP's bytes and does DDP's
  compute, cannot be much faster than DDP, whatever FSDP2's time.
- optimizer: zerolab's engines step their shards in tiles of 2^18 elements on a CPU
  (zerolab.parts.tiles: the same result, in cache); torch's optimizers step whole tensors.
- page faults: first touches of memory the C allocator had just taken from the kernel, which
  zeroes each 4 KiB page. zerolab's ranks keep the memory they free (zerolab.launcher.allocator,
  as a GPU's caching allocator does), so a step in its ranks should take next to none; thousands
  mean the allocator gives memory back and takes it again every step (ZEROLAB_KEEP_FREED_MEMORY=0,
  or torchrun on another C library), a cost that falls unevenly on the engines."""


def _sure(interval: tuple[float, float] | None, confidence: float | None) -> str:
    return "" if interval is None else (f"; {confidence:.0%} interval {interval[0]:.3f}-"
                                        f"{interval[1]:.3f}")


def _load(values: list[float]) -> str:
    return "/".join(f"{v:.1f}" for v in values)


def _short_label(row: dict[str, Any]) -> str:
    return engines.ENGINES[row["key"]].short.replace("\n", " ")


def _cells(r: dict[str, Any], measured: bool, scale: float) -> list[str]:
    paired = r.get("overhead_ratio_to_counterpart")
    vs = f"{paired:.2f}x {_short_key(r['counterpart'])}" if paired is not None else "-"
    cells = [r["label"], f"{r['median_step_s'] * 1e3:.0f}",
             f"{r['median_overhead_s'] * 1e3:.0f}", vs]
    if measured:
        k = max(range(len(r["peak_bytes_per_rank"])), key=r["peak_bytes_per_rank"].__getitem__)
        cat = r["peak_by_category_per_rank"][k]
        state = max(sum(s.values()) for s in r["model_state_bytes_per_rank"])
        sent_ratio = r["sent_to_formula"]
        cells += [_in(r["peak_bytes_per_rank"][k], scale),
                  "/".join(_in(cat.get(c, 0), scale)
                           for c in ("params", "grads", "optimizer", "other")),
                  _in(state, scale), f"{r['model_state_to_formula']:.2f}",
                  _in(max(r["sent_bytes_per_rank"]), scale),
                  "-" if sent_ratio is None else f"{sent_ratio:.2f}"]
    else:
        cells += ["-"] * 6
    cells.append(f"{'yes' if r['matches_reference'] else 'NO'} ({r['max_abs_diff']:.1e})")
    return cells


def _short_key(key: str | None) -> str:
    return {"torch_ddp": "DDP", "torch_ddp_zero": "DDP+ZeRO", "torch_fsdp2": "FSDP2"}.get(
        key or "", key or "")


def plot(report: dict[str, Any], path: str) -> None:
    """Step time, peak memory by category and bytes sent, stacked into one PNG at `path`."""
    import io

    import numpy as np
    from matplotlib.figure import Figure
    from matplotlib.image import imread, imsave

    from zerolab import plots

    rows = report["engines"]
    labels = [engines.ENGINES[r["key"]].short for r in rows]
    fig = Figure(figsize=plots.FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(len(rows)), [r["median_step_s"] * 1e3 for r in rows],
           color=["#4c72b0" if r["key"] in STAGE_ENGINES else "#999999" for r in rows])
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("Step time (slowest rank)")
    figures = [fig]
    if "peak_bytes_per_rank" in rows[0]:
        figures.append(plots.memory_bars(
            [r["peak_by_category_per_rank"][0] for r in rows], labels=labels,
            xlabel="engine", title="Peak memory in one step, rank 0"))
        figures.append(plots.bytes_per_rank(
            {lab: r["sent_bytes_per_rank"] for lab, r in zip(labels, rows)},
            title="Bytes sent per rank in one step"))
    images = []
    for f in figures:
        png = io.BytesIO()
        f.savefig(png, format="png", dpi=100)
        png.seek(0)
        images.append(imread(png))  # (height, width, 4) floats in [0, 1]
    width = max(im.shape[1] for im in images)
    padded = [np.pad(im, ((0, 0), (0, width - im.shape[1]), (0, 0)), constant_values=1.0)
              for im in images]
    imsave(path, np.concatenate(padded, axis=0))
