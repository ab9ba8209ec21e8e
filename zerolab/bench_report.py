"""The benchmark's report: per-rank results combined, a text table, a figure.

`python -m zerolab.bench` (bench.py) runs the ranks; this file turns what they return into the
report (JSON-ready dict), the table it prints and the PNG it draws.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

import torch

from zerolab.bench_config import (
    COUNTERPARTS,
    LABELS,
    MEMORY_TARGETS,
    SHORT_LABELS,
    TIME_TARGETS,
    BenchConfig,
)
from zerolab.harness import ZEROLAB_ENGINES


def summarize(config: BenchConfig, per_rank: list[dict[str, Any]],
              load: tuple[list[float], list[float]], command: str) -> dict[str, Any]:
    """Combine the ranks' results: step time = the slowest rank's, per round; medians; targets."""
    keys = list(per_rank[0]["times"])
    rows: dict[str, dict[str, Any]] = {}
    for key in keys:
        timed = range(config.warmup, config.warmup + config.steps)
        step_times = [max(res["times"][key][i] for res in per_rank) for i in timed]
        diff = max(res["max_abs_diff"][key] for res in per_rank)
        row: dict[str, Any] = {
            "key": key, "label": LABELS[key], "counterpart": COUNTERPARTS.get(key),
            "step_times_s": step_times, "median_step_s": statistics.median(step_times),
            # CPU seconds per step of each rank's process (compute and gloo's threads): less
            # sensitive than wall time to other jobs on the machine.
            "median_cpu_s_per_rank": [statistics.median(res["cpu_times"][key][i] for i in timed)
                                      for res in per_rank],
            "max_abs_diff": diff, "matches_reference": diff <= config.atol,
        }
        if config.measure:
            m = [res["measured"][key] for res in per_rank]
            zl = key in ZEROLAB_ENGINES  # issues its collectives through zerolab.comm
            row.update({
                "peak_bytes_per_rank": [r["peak_bytes"] for r in m],
                "peak_by_category_per_rank": [r["peak_by_category"] for r in m],
                "device_peak_bytes_per_rank": [r["device_peak_bytes"] for r in m],
                "model_state_bytes_per_rank": [r["model_state_bytes"] for r in m],
                "sent_bytes_per_rank": [r["record_comm_bytes"] if zl else r["c10d_bytes"]
                                        for r in m],
                "sent_bytes_source": "zerolab.record_comm" if zl else
                "c10d collectives counted by CollectiveCounter, ring formula",
                "sent_by_op_per_rank": [r["record_comm_by_op"] if zl else r["c10d_by_op"]
                                        for r in m],
                "c10d_bytes_per_rank": [r["c10d_bytes"] for r in m],
                "c10d_calls_per_rank": [r["c10d_calls"] for r in m],
                "c10d_unknown_ops": sorted({op for r in m for op in r["c10d_unknown_ops"]}),
            })
        rows[key] = row
    targets = []
    for key, limit in TIME_TARGETS.items():
        other = COUNTERPARTS[key]
        if key in rows and other in rows:
            ratio = rows[key]["median_step_s"] / rows[other]["median_step_s"]
            # A check on noise: both ran in every round, seconds apart, so a machine that slows
            # down for a while slows both; the median of their per-round ratios cancels that.
            paired = statistics.median(a / b for a, b in zip(rows[key]["step_times_s"],
                                                             rows[other]["step_times_s"]))
            rows[key]["ratio_to_counterpart"] = ratio
            rows[key]["paired_ratio_to_counterpart"] = paired
            targets.append({"what": f"{LABELS[key]} step time / {LABELS[other]}",
                            "ratio": ratio, "paired_ratio": paired, "limit": limit,
                            "met": ratio <= limit})
    for key, limit in MEMORY_TARGETS.items():
        other = COUNTERPARTS[key]
        if config.measure and key in rows and other in rows:
            ratio = max(rows[key]["peak_bytes_per_rank"]) / max(rows[other]["peak_bytes_per_rank"])
            rows[key]["peak_ratio_to_counterpart"] = ratio
            targets.append({"what": f"{LABELS[key]} peak memory per rank / {LABELS[other]}",
                            "ratio": ratio, "limit": limit, "met": ratio <= limit})
    first = per_rank[0]
    return {
        "command": command,
        "config": {**asdict(config), "atol": config.atol},
        "model": {"params": first["params"], "gpt_config": asdict(config.gpt_config())},
        "environment": {
            "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cores": os.cpu_count(),
            "backend": first["backend"], "device": first["device"],
            "threads_per_rank": first["threads"],
            "load_average_start": load[0], "load_average_end": load[1],
        },
        "method": {
            "step_time": "per round, the slowest rank's time from a barrier to the end of "
                         "zero_grad; median over the timed rounds; strategies rotated per round",
            "ratio": "median step time / the torch counterpart's; paired_ratio: median over "
                     "rounds of the two strategies' times in the same round",
            "torch_settings": "DistributedDataParallel(gradient_as_bucket_view=True, "
                              f"bucket_cap_mb={config.bucket_mb:g}); ZeroRedundancyOptimizer("
                              "parameters_as_bucket_view=True); fully_shard on each block, then "
                              "on the root (defaults); AdamW(lr, weight_decay) for all; "
                              "zero_grad(set_to_none=False) for DDP, as zerolab's engines keep "
                              "their gradient buffers",
            "memory": "zerolab.track_memory over one step (forward, backward, optimizer step), "
                      "separate from timing; peak = largest total of live tensor bytes",
            "model_state": "distinct storages of params, grads, optimizer state after step()",
            "sent_bytes": "ring-algorithm bytes this rank sends in one step: zerolab's from "
                          "record_comm, torch's from the c10d collectives it issues",
            "matches_reference": f"max |param - torch DDP's param| <= atol={config.atol:g} "
                                 "after the last step, same initial weights and batches",
        },
        "strategies": [rows[k] for k in keys],
        "targets": targets,
    }


def _in(n: float, scale: float) -> str:
    return f"{n / scale:.1f}"


def format_table(report: dict[str, Any]) -> str:
    """The report as a text table, one strategy per row, then the targets."""
    rows = report["strategies"]
    cfg = report["config"]
    measured = "peak_bytes_per_rank" in rows[0]
    largest = max((max(r["peak_bytes_per_rank"]) for r in rows), default=0) if measured else 0
    unit, scale = ("KiB", 2**10) if 0 < largest < 2**20 else ("MiB", 2**20)
    header = ["strategy", "step ms", "vs torch", f"peak {unit}/rank",
              "  params/grads/optim/other", f"state {unit}/rank", f"sent {unit}/rank/step",
              "matches ref (max |diff|)"]
    lines = []
    for r in rows:
        ratio = r.get("ratio_to_counterpart")
        vs = f"{ratio:.2f}x {_short_key(r['counterpart'])}" if ratio is not None else "-"
        cells = [r["label"], f"{r['median_step_s'] * 1e3:.0f}", vs]
        if measured:
            k = max(range(len(r["peak_bytes_per_rank"])), key=r["peak_bytes_per_rank"].__getitem__)
            cat = r["peak_by_category_per_rank"][k]
            state = max(sum(s.values()) for s in r["model_state_bytes_per_rank"])
            cells += [_in(r["peak_bytes_per_rank"][k], scale),
                      "/".join(_in(cat.get(c, 0), scale)
                               for c in ("params", "grads", "optimizer", "other")),
                      _in(state, scale), _in(max(r["sent_bytes_per_rank"]), scale)]
        else:
            cells += ["-", "-", "-", "-"]
        cells.append(f"{'yes' if r['matches_reference'] else 'NO'} ({r['max_abs_diff']:.1e})")
        lines.append(cells)
    widths = [max(len(str(row[i])) for row in [header, *lines]) for i in range(len(header))]
    out = [f"{report['model']['params']:,}-parameter GPT (n_layer={cfg['n_layer']}, "
           f"n_embd={cfg['n_embd']}, vocab={cfg['vocab_size']}, block={cfg['block_size']}), "
           f"world size {cfg['world_size']} ({report['environment']['backend']}, "
           f"{report['environment']['threads_per_rank']} thread/rank), global batch "
           f"{cfg['global_batch']}, {cfg['warmup']} warm-up + {cfg['steps']} timed rounds"]
    fmt = "  ".join(f"{{:{'<' if i == 0 else '>'}{w}}}" for i, w in enumerate(widths))
    out.append(fmt.format(*header))
    out.append("  ".join("-" * w for w in widths))
    out += [fmt.format(*cells) for cells in lines]
    out.append("peak: the rank with the larger peak; sent: zerolab from record_comm, torch from "
               "its c10d collectives (ring formula)")
    if report["environment"]["backend"] == "gloo":
        out.append("gloo has no reduce-scatter: it runs an all-reduce (2(N-1)/N*S, not (N-1)/N*S) "
                   "where the table counts a reduce-scatter")
    if cfg["steps"] < 5:
        out.append(f"note: {cfg['steps']} timed round(s): the timings are indicative only")
    for t in report["targets"]:
        paired = (f" (median of per-round ratios {t['paired_ratio']:.2f})"
                  if "paired_ratio" in t else "")
        out.append(f"target {t['what']}: {t['ratio']:.2f}{paired} <= {t['limit']:.2f}: "
                   f"{'met' if t['met'] else 'MISSED'}")
    return "\n".join(out)


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

    rows = report["strategies"]
    labels = [SHORT_LABELS[r["key"]] for r in rows]
    fig = Figure(figsize=plots.FIGSIZE, layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(len(rows)), [r["median_step_s"] * 1e3 for r in rows],
           color=["#4c72b0" if r["key"] in ZEROLAB_ENGINES else "#999999" for r in rows])
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("median step time (ms)")
    ax.set_title("Step time (slowest rank)")
    figures = [fig]
    if "peak_bytes_per_rank" in rows[0]:
        figures.append(plots.memory_bars(
            [r["peak_by_category_per_rank"][0] for r in rows], labels=labels,
            xlabel="strategy", title="Peak memory in one step, rank 0"))
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
