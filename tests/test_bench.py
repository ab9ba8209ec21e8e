"""`python -m zerolab.bench --quick`: all seven engines run, and each ends where torch DDP does.

One quick benchmark (a few seconds) is run as a subprocess, exactly as CI or a learner would run
it; the tests read its JSON, its table and its plot. A second one runs a pair (ZeRO-3 and FSDP2),
the way `--gpt2` runs each stage with its counterpart; the GPT-2 run itself is not a test (it
takes minutes per pair): its preset is checked without building the model.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from zerolab import bench, engines, theory
from zerolab.bench import config as bench_config
from zerolab.bench import profile as bench_profile
from zerolab.bench import report as bench_report
from zerolab.bench import runner as bench_runner
from zerolab.launcher import progress
from zerolab.models import GPT, num_params

REPO = Path(__file__).resolve().parent.parent


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run_bench(out: Path, *args: str) -> dict:
    json_path, plot_path = out / "bench.json", out / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "zerolab.bench", *args, "--json", str(json_path),
         "--plot", str(plot_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    return {"proc": proc, "report": report, "plot": plot_path,
            "rows": {r["key"]: r for r in report["engines"]}}


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("bench"), "--quick")


@pytest.fixture(scope="module")
def quick_pair(tmp_path_factory) -> dict:
    return run_bench(tmp_path_factory.mktemp("pair"), "--quick", "--pairs",
                     "--engines", "zero3")


def test_every_engine_matches_the_reference(quick):
    rows = quick["rows"]
    assert set(rows) == set(bench_config.BENCHED)
    for key, row in rows.items():
        assert row["matches_reference"] is True, (
            f"{key}: max |param - torch DDP's| = {row['max_abs_diff']:.2e} > "
            f"atol {quick['report']['config']['atol']:g}")


def test_table_lists_all_seven_engines(quick):
    table = quick["proc"].stdout
    for label in map(bench_config.label, bench_config.BENCHED):
        assert label in table
    for key in bench_config.OVERHEAD_TARGETS:
        assert f"target {bench_config.label(key)} overhead" in table
        assert (f"  {bench_config.label(key)}, for comparison: its overhead in CPU seconds "
                f"(every rank's), ") in table


def test_timings_and_measurements_are_complete(quick):
    cfg = quick["report"]["config"]
    for key, row in quick["rows"].items():
        assert len(row["step_times_s"]) == cfg["steps"]
        assert row["median_step_s"] > 0
        assert len(row["peak_bytes_per_rank"]) == cfg["world_size"]
        for state, peak in zip(row["model_state_bytes_per_rank"], row["peak_bytes_per_rank"]):
            assert 0 < sum(state.values()) <= peak, key
        # what the step added above what was live at its start (the parameters at least were)
        for rise, peak in zip(row["tracker_rise_bytes_per_rank"], row["peak_bytes_per_rank"]):
            assert 0 < rise < peak, key
        assert row["device_rise_bytes_per_rank"] == [None] * cfg["world_size"], key  # CPU
        assert not row["c10d_unknown_ops"], key
    for key in bench_config.OVERHEAD_TARGETS:
        assert quick["rows"][key]["ratio_to_counterpart"] > 0


def test_table_says_how_to_read_it_and_under_what_load(quick):
    table = quick["proc"].stdout
    assert "How to read it:" in table
    assert "load average (1, 5, 15 min) at start" in table
    assert "what measuring costs" in table
    env = quick["report"]["environment"]
    assert len(env["load_average_start"]) == len(env["load_average_end"]) == 3


def test_cores_busy_is_every_ranks_cpu_time_over_the_steps_wall_time(quick):
    """What bounds a step on one machine: a measured ratio, printed for every engine."""
    table = quick["proc"].stdout
    line = next(li for li in table.splitlines() if li.startswith("cores busy during a step"))
    for row in quick["report"]["engines"]:
        busy = sum(row["median_cpu_s_per_rank"]) / row["median_step_s"]
        assert row["cores_busy"] == pytest.approx(busy)
        assert 0 < busy <= quick["report"]["environment"]["cores"] * 1.25  # medians of two clocks
        assert f"{bench_report._short_label(row)} {busy:.2f}" in line


def test_page_faults_per_step_are_reported(quick):
    world_size = quick["report"]["config"]["world_size"]
    for key, row in quick["rows"].items():
        faults = row["median_page_faults_per_rank"]
        assert len(faults) == world_size and all(f >= 0 for f in faults), key
    assert "page faults per step (median, the rank with more): zerolab DDP " in \
        quick["proc"].stdout


def test_model_state_matches_the_formulas(quick):
    """Live bytes after step() against zerolab.theory: padding and Adam's step counters only.
    (torch's ZeroRedundancyOptimizer shards whole parameters: its ranks hold unequal parts.)"""
    for key, row in quick["rows"].items():
        slack = 0.25 if key == "torch_ddp_zero" else 0.02
        assert 1.0 <= row["model_state_to_formula"] <= 1.0 + slack, key
        stage = engines.ENGINES[key].stage
        assert row["model_state_formula"] == theory.memory_formula(stage)


def test_zerolab_traffic_matches_the_formulas(quick):
    """2Ψ; ZeRO-3 3Ψ less the root's backward gather (ring model; padding only). FSDP2 keeps
    its root gathered from forward to backward too: its figure is the same formula's."""
    root = quick["report"]["model"]["root_params"]
    assert 0 < root < quick_psi(quick["report"])
    for key in engines.STAGE_ENGINES:
        assert 1.0 <= quick["rows"][key]["sent_to_formula"] <= 1.01, key
    assert quick["rows"]["torch_ddp"]["sent_to_formula"] == 1.0
    assert 1.0 <= quick["rows"]["torch_fsdp2"]["sent_to_formula"] <= 1.01  # first dims padded


def test_measuring_costs_are_reported(quick):
    """Each measured step against the plain step just before it, median over the rounds."""
    rounds = quick["report"]["config"]["measure_rounds"]
    line = next(li for li in quick["proc"].stdout.splitlines()
                if li.startswith("what measuring costs"))
    for key, row in quick["rows"].items():
        plain, recorded, tracked = row["plain_s"], row["recorded_s"], row["tracked_s"]
        assert len(plain) == len(recorded) == len(tracked) == rounds, key
        assert min(plain + recorded + tracked) > 0, key
        assert row["tracker_overhead"] == pytest.approx(
            statistics.median(t / p for t, p in zip(tracked, plain)))
        over = "" if row["tracker_overhead"] <= bench_config.TRACKER_LIMIT else " (over the limit)"
        assert (f"{bench_report._short_label(row)} {row['recorder_overhead']:.2f}x/"
                f"{row['tracker_overhead']:.2f}x{over}") in line


def test_targets_are_checked_on_paired_ratios(quick):
    table = quick["proc"].stdout
    for t in quick["report"]["targets"]:
        if "paired_ratio" in t:
            assert t["met"] == (t["paired_ratio"] <= t["limit"])
            assert t["interval"] is None  # 2 rounds: no 95% interval for a median exists
            assert f"{t['what']}: {t['paired_ratio']:.3f}" in table
            assert "too few rounds to tell it from noise" in table


def test_median_interval_is_the_sign_tests():
    # 30 values: the 10th smallest and the 10th largest, 1 - 2 P(Bin(30, 1/2) < 10) = 0.957
    low, high, coverage = bench_report.median_interval(list(range(30, 0, -1)))
    assert (low, high) == (10, 21)
    assert coverage == pytest.approx(0.957226, abs=1e-6)
    assert bench_report.median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) is None  # [min, max]: 0.9375
    assert bench_report.median_interval([float(i) for i in range(6)]) == (0.0, 5.0, 0.96875)


@pytest.mark.parametrize("n", [10, 30])
def test_median_interval_holds_the_median_as_often_as_it_says(n):
    # A skewed distribution (exponential: median ln 2, mean 1): nothing assumed about the shape.
    rng = random.Random(n)
    trials = 4000
    hits, coverage = 0, None
    for _ in range(trials):
        low, high, coverage = bench_report.median_interval(
            [rng.expovariate(1.0) for _ in range(n)])
        hits += low <= math.log(2) <= high
    assert coverage >= 0.95
    assert hits / trials == pytest.approx(coverage, abs=0.012)  # ~5 standard errors


@pytest.mark.parametrize("ratio, interval, expected", [
    (0.98, (0.96, 0.99), "met (the interval lies below it)"),
    (0.99, (0.96, 1.03), "met, but within this run's noise (the interval holds 1.00)"),
    (1.02, (0.99, 1.05), "MISSED, but within this run's noise (the interval holds 1.00)"),
    (1.04, (1.01, 1.06), "MISSED (the interval lies above it)"),
    (1.04, None, "MISSED (too few rounds to tell it from noise)"),
])
def test_verdict_says_whether_noise_could_have_decided_it(ratio, interval, expected):
    target = {"paired_ratio": ratio, "limit": 1.0, "met": ratio <= 1.0, "interval": interval,
              "floor_ratio": 0.6}
    assert bench_report.verdict(target) == expected
    assert bench_report.verdict({"ratio": 0.7, "limit": 1.0, "met": True}) == "met"  # memory


def test_targets_are_overheads_above_the_floor_of_the_same_round(quick, quick_pair):
    """Per round: (stage's step - floor) / (counterpart's step - floor), the floor being the
    same round's forward and backward alone; the target is on their median."""
    for run in (quick, quick_pair):
        report = run["report"]
        (floors,) = report["floor_times_s"]
        rows = {r["label"]: r for r in report["engines"]}
        for row in rows.values():
            assert row["overheads_s"] == [s - f for s, f in zip(row["step_times_s"], floors)]
        for t in (t for t in report["targets"] if "paired_ratio" in t):
            stage, counterpart = (rows[name] for name in
                                  t["what"].removesuffix("'s").split(" overhead / "))
            ratios = [bench_report._over(a, b)
                      for a, b in zip(stage["overheads_s"], counterpart["overheads_s"])]
            assert t["paired_ratio"] == pytest.approx(statistics.median(ratios))
            assert t["limit"] == bench_config.OVERHEAD_TARGETS[stage["key"]]
            assert t["step_ratio"] == pytest.approx(statistics.median(
                a / b for a, b in zip(stage["step_times_s"], counterpart["step_times_s"])))
            assert t["cpu_ratio"] == pytest.approx(statistics.median(
                bench_report._over(a, b)
                for a, b in zip(stage["cpu_overheads_s"], counterpart["cpu_overheads_s"])))


def test_a_round_whose_counterpart_took_no_longer_than_the_floor_counts_against_the_stage():
    assert bench_report._over(0.02, 0.04) == 0.5
    assert bench_report._over(0.02, 0.0) == bench_report._over(0.02, -0.01) == math.inf


def test_the_floor_is_timed_in_every_launch_and_under_every_step(quick, quick_pair):
    """Forward + backward alone, in the same rotation: positive, below every engine's step
    (each does that and more), one per launch, and printed."""
    for run in (quick, quick_pair):
        report = run["report"]
        (floor,) = report["floor_step_s"]
        assert 0 < floor < min(r["median_step_s"] for r in report["engines"])
        assert f"the floor under every engine), median ms: {1e3 * floor:.0f}" in (
            run["proc"].stdout)
        for t in report["targets"]:
            if "paired_ratio" in t:
                counterpart = next(r for r in report["engines"]
                                   if t["what"].endswith(f"{r['label']}'s"))
                assert t["floor_ratio"] == pytest.approx(floor / counterpart["median_step_s"])


def test_progress_bar_went_to_stderr(quick):
    assert "bench [" in quick["proc"].stderr
    assert "compare parameters" in quick["proc"].stderr


def test_plot_is_a_png(quick):
    assert quick["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bytes sent: the counter of torch's collectives against what is known ----------------------


def quick_psi(report: dict) -> int:
    cfg = bench_config.BenchConfig(**{k: v for k, v in report["config"].items()
                               if k not in ("engines", "atol")})
    return num_params(GPT(cfg.gpt_config()))


def test_collective_counter_agrees_with_record_comm(quick):
    """On zerolab's engines, the counter used for torch's engines sees what record_comm does
    (a gloo reduce-scatter as the sends it is made of: the same ring figure)."""
    for key in engines.STAGE_ENGINES:
        row = quick["rows"][key]
        assert row["sent_bytes_source"] == "zerolab.record_comm"
        assert row["c10d_bytes_per_rank"] == row["sent_bytes_per_rank"], key


def test_torch_traffic_follows_the_known_algorithms(quick):
    """World size 2, fp32: the ring figures for what each torch engine is known to send."""
    report = quick["report"]
    assert report["config"]["world_size"] == 2
    full = 4 * quick_psi(report)  # bytes of every parameter once
    ddp, zero, fsdp = (quick["rows"][k] for k in ("torch_ddp", "torch_ddp_zero", "torch_fsdp2"))
    # DDP: one all-reduce of every gradient: 2(N-1)/N * S = S at N=2.
    assert ddp["sent_by_op_per_rank"] == [{"all_reduce": full}] * 2
    # DDP + ZeroRedundancyOptimizer: the same all-reduce, then each rank broadcasts the
    # parameters it updated (the two partitions add up to the whole model).
    assert all(ops["all_reduce"] == full for ops in zero["sent_by_op_per_rank"])
    assert sum(ops["broadcast"] for ops in zero["sent_by_op_per_rank"]) == full
    # FSDP2: gradients reduce-scattered once ((N-1)/N * S = S/2, FSDP2 pads each parameter's
    # first dimension to a multiple of N); parameters all-gathered in forward and again in
    # backward, except the root's, which stay gathered from forward to backward.
    for ops in fsdp["sent_by_op_per_rank"]:
        assert full / 2 <= ops["reduce_scatter"] <= full / 2 * 1.01
        assert full / 2 < ops["all_gather"] < full


# --- pairs: each stage with its counterpart, one launch each (how --gpt2 runs) -------------------


def test_a_pair_runs_alone_and_is_compared_with_its_counterpart(quick_pair):
    report, rows = quick_pair["report"], quick_pair["rows"]
    assert report["config"]["pairs"] is True
    assert set(rows) == {"zero3", "torch_fsdp2"}
    for row in rows.values():
        assert row["reference"] == "torch_fsdp2"
        assert row["matches_reference"] is True, row
    assert rows["zero3"]["paired_ratio_to_counterpart"] > 0
    assert "pair: zerolab ZeRO-3 against torch FSDP2 (fully_shard) (reference)" in (
        quick_pair["proc"].stdout)


def test_pairs_and_side_by_side_groups():
    pairs = bench_config.BenchConfig(pairs=True).groups()
    assert pairs == [(("ddp", "torch_ddp"), "torch_ddp"),
                     (("zero1", "torch_ddp_zero"), "torch_ddp_zero"),
                     (("zero2", "torch_ddp"), "torch_ddp"),
                     (("zero3", "torch_fsdp2"), "torch_fsdp2")]
    [(keys, reference)] = bench_config.BenchConfig(engines=("zero3",)).groups()
    assert keys == ("zero3", "torch_ddp") and reference == "torch_ddp"  # always the reference
    with pytest.raises(ValueError, match="pairs need"):
        bench_config.BenchConfig(pairs=True, engines=("torch_ddp",)).check()


def test_gpt2_preset_is_gpt2_small():
    config, _ = bench.parse_args(["--gpt2"])
    assert config.pairs and config.tokens == 64 < config.block_size == 1024
    c = config.gpt_config()
    assert theory.gpt_param_count(c.vocab_size, c.n_embd, c.n_layer, c.block_size,
                                  c.tie_weights) == 124_439_808
    assert c.n_head == 12 and c.tie_weights
    config.check()
    config, _ = bench.parse_args(["--gpt2", "--seq-len", "128", "--steps", "3"])
    assert (config.tokens, config.steps, config.pairs) == (128, 3, True)
    with pytest.raises(ValueError, match="seq_len"):
        bench_config.BenchConfig(seq_len=65).check()


def test_under_torchrun_the_world_size_is_torchruns(monkeypatch):
    """torchrun --nproc-per-node 8 -m zerolab.bench: the ranks are torchrun's, not spawned."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not bench.under_torchrun() and bench.parse_args([])[0].world_size == 2
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert bench.under_torchrun() and bench.parse_args([])[0].world_size == 8


# --- the pieces, in-process ---------------------------------------------------------------------


def test_progress_bar_off_a_terminal_prints_every_tenth():
    stream = io.StringIO()
    bar = progress.ProgressBar("x", stream=stream, width=10)
    for i in range(1, 21):
        bar(i, 20, f"item {i}")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11  # the first call, then each 10%
    assert lines[0] == "x [..........] 1/20 item 1"
    assert lines[-1] == "x [##########] 20/20 item 20"


def test_progress_relayed_through_a_file():
    stream = io.StringIO()
    bar = progress.ProgressBar("relay", stream=stream, width=4)
    with progress.follow_progress(bar, poll_s=0.01) as sink:
        sink.message("hello")
        sink(1, 1, "done")
    assert stream.getvalue().splitlines() == ["hello", "relay [####] 1/1 done"]


def test_config_is_checked():
    with pytest.raises(ValueError, match="unknown engines"):
        bench_config.BenchConfig(engines=("ddp", "zero4")).check()
    with pytest.raises(ValueError, match="must divide"):
        bench_config.BenchConfig(global_batch=3).check()


def test_profile_lists_each_engines_operators_by_self_time(monkeypatch, capsys):
    """--profile: per engine, rank 0's operators per step, largest first, summing to the
    total; the same model's forward and backward run the same matrix products in zerolab's DDP
    and torch's, and DDP's all-reduces show (one per bucket), above the floor's operators.
    The command runs once, here: its profiles are kept as it prints them."""
    ran = []

    def kept(config):
        ran.append(bench_profile.run_profile(config))
        return ran[-1]

    monkeypatch.setattr(bench_runner, "run_profile", kept)
    assert bench_runner.main(["--profile", "--quick", "--engines", "ddp,torch_ddp"]) == 0
    stdout = capsys.readouterr().out
    profiles = {p.key: p for p in ran[0]}
    assert set(profiles) == {"ddp", "torch_ddp"}
    for key, p in profiles.items():
        heads = [li for li in stdout.splitlines() if li.startswith(f"{key}: ")]
        assert len(heads) == 1 and "ms of operator self time per step" in heads[0]
        times = [op.self_ms for op in p.ops]
        assert times == sorted(times, reverse=True)
        assert p.self_ms == pytest.approx(sum(times))
    calls = {key: {op.name: op.calls for op in p.ops} for key, p in profiles.items()}
    assert calls["ddp"]["aten::mm"] == calls["torch_ddp"]["aten::mm"] > 0
    assert calls["ddp"]["c10d::allreduce_"] >= 1
    # The floor, profiled in alternation with each engine: the same products, no collective;
    # above it, only what the engine runs more often (its all-reduce, its optimizer step).
    assert stdout.count("above the floor (forward and backward alone") == 2
    for key, p in profiles.items():
        floor = {op.name: op.calls for op in p.floor.ops}
        assert floor["aten::mm"] == calls[key]["aten::mm"] and "c10d::allreduce_" not in floor
        extra, _ = bench_profile.above_floor(p)
        assert all(op.calls > 0 for op in extra)
        assert {"c10d::allreduce_", "aten::addcdiv_"} <= {op.name for op in extra}, key
