"""`python -m zerolab.bench --quick`: all seven strategies run, and each ends where torch DDP does.

One quick benchmark (a few seconds) is run as a subprocess, exactly as CI or a learner would run
it; the tests read its JSON, its table and its plot.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerolab import bench_config, harness, progress
from zerolab.models import GPT, num_params

REPO = Path(__file__).resolve().parent.parent


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    json_path, plot_path = out / "bench.json", out / "bench.png"
    proc = subprocess.run(
        [sys.executable, "-m", "zerolab.bench", "--quick", "--json", str(json_path),
         "--plot", str(plot_path)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    return {"proc": proc, "report": report, "plot": plot_path,
            "rows": {r["key"]: r for r in report["strategies"]}}


def test_every_strategy_matches_the_reference(quick):
    rows = quick["rows"]
    assert set(rows) == set(bench_config.STRATEGIES)
    for key, row in rows.items():
        assert row["matches_reference"] is True, (
            f"{key}: max |param - torch DDP's| = {row['max_abs_diff']:.2e} > "
            f"atol {quick['report']['config']['atol']:g}")


def test_table_lists_all_seven_strategies(quick):
    table = quick["proc"].stdout
    for label in bench_config.LABELS.values():
        assert label in table
    for key in bench_config.TIME_TARGETS:
        assert f"target {bench_config.LABELS[key]} step time" in table


def test_timings_and_measurements_are_complete(quick):
    cfg = quick["report"]["config"]
    for key, row in quick["rows"].items():
        assert len(row["step_times_s"]) == cfg["steps"]
        assert row["median_step_s"] > 0
        assert len(row["peak_bytes_per_rank"]) == cfg["world_size"]
        for state, peak in zip(row["model_state_bytes_per_rank"], row["peak_bytes_per_rank"]):
            assert 0 < sum(state.values()) <= peak, key
        assert not row["c10d_unknown_ops"], key
    for key in bench_config.TIME_TARGETS:
        assert quick["rows"][key]["ratio_to_counterpart"] > 0


def test_progress_bar_went_to_stderr(quick):
    assert "bench [" in quick["proc"].stderr
    assert "compare parameters" in quick["proc"].stderr


def test_plot_is_a_png(quick):
    assert quick["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bytes sent: the counter of torch's collectives against what is known ----------------------


def quick_psi(report: dict) -> int:
    cfg = bench_config.BenchConfig(**{k: v for k, v in report["config"].items()
                               if k not in ("strategies", "atol")})
    return num_params(GPT(cfg.gpt_config()))


def test_collective_counter_agrees_with_record_comm(quick):
    """On zerolab's engines, the counter used for torch's strategies sees what record_comm does.

    One allowance: a backend may run a reduce-scatter as an all-reduce (gloo does), which the
    counter sees as such, at twice the reduce-scatter's ring figure.
    """
    for key in harness.ZEROLAB_ENGINES:
        row = quick["rows"][key]
        assert row["sent_bytes_source"] == "zerolab.record_comm"
        for counted, recorded, by_op in zip(row["c10d_bytes_per_rank"],
                                            row["sent_bytes_per_rank"],
                                            row["sent_by_op_per_rank"]):
            assert recorded <= counted <= recorded + by_op.get("reduce_scatter", 0), key
    ddp = quick["rows"]["ddp"]
    assert ddp["c10d_bytes_per_rank"] == ddp["sent_bytes_per_rank"]


def test_torch_traffic_follows_the_known_algorithms(quick):
    """World size 2, fp32: the ring figures for what each torch strategy is known to send."""
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
    with pytest.raises(ValueError, match="unknown strategies"):
        bench_config.BenchConfig(strategies=("ddp", "zero4")).check()
    with pytest.raises(ValueError, match="must divide"):
        bench_config.BenchConfig(global_batch=3).check()
