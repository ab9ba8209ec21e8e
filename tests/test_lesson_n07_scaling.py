"""Notebook 07's measurements (zerolab.lessons.n07_scaling): the stages at 1 and 2 ranks against
the formulas, the traffic beside the ring model at 3 ranks, and torchrun's command.

At 1 and 2 ranks the runs come from a launch shared with lessons 04-06's tests (conftest.py:
lessons_04_07_at_2). The traffic has a launch of 3 ranks of its own
(`n07_scaling.scaling_runs((3,), global_batch=6)`): a world size where gloo's all-gather is 3
broadcasts. Every wire figure is checked against the formula of the algorithm gloo ran: an
all-reduce sends 2(N-1)/N·S, a reduce-scatter (N-1 send/recv pairs) and an all-gather (N
broadcasts) (N-1)/N·S, plus message headers.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from workers.lessons import root_numel

import zerolab
from zerolab import theory
from zerolab.lessons import n07_scaling
from zerolab.models import GPT, num_params
from zerolab.units import make_units

N = 3
HEADERS = 0.01  # gloo's message headers: under 1% of these payloads
GLOO = {"all_reduce": 1, "reduce_scatter": 1, "all_gather": 1}  # wire / ring, per op, on gloo


def test_scaling_runs_match_the_formulas_at_each_world_size(lessons_04_07_at_2):
    p = num_params(GPT(n07_scaling.MODEL))
    assert lessons_04_07_at_2[1]["n07"][1] is None  # rank 1 sat out the N = 1 run
    for n in (1, 2):
        for r in lessons_04_07_at_2[:n]:
            run = r["n07"][n]
            assert run.world_size == n and run.num_params == p
            assert tuple(run.stages) == n07_scaling.STAGES == ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
            for stage in n07_scaling.STAGES:
                held = sum(run.stages[stage].held.values())
                formula = theory.model_state_memory(p, n, stage).total
                assert 0 <= held - formula < 1e-3 * formula, (n, stage)
                assert run.stages[stage].sent == theory.comm_volume(
                    p, n, stage, root_numel=root_numel(n07_scaling.MODEL, stage)).ring_sent_bytes


def test_run_torchrun_builds_the_command_and_reads_the_losses(monkeypatch):
    """The subprocess is faked here (tests/test_train.py runs the real torchrun)."""
    seen = {}

    def fake_run(argv, **kwargs):
        seen["argv"] = argv
        json_path = argv[argv.index("--json") + 1]
        with open(json_path, "w") as f:
            json.dump({"losses": [4.0, 3.5, 3.0]}, f)
        return subprocess.CompletedProcess(argv, 0, stdout="ok\n", stderr="")

    monkeypatch.setattr(n07_scaling.subprocess, "run", fake_run)
    run = n07_scaling.run_torchrun(nproc=2, engine_key="zero2", steps=3)
    assert seen["argv"][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert seen["argv"][3:11] == ["--standalone", "--nproc-per-node", "2", "-m", "zerolab.train",
                                  "--engine", "zero2", "--steps"]
    assert run.command.startswith("torchrun --standalone --nproc-per-node 2 -m zerolab.train")
    assert run.returncode == 0 and run.losses == [4.0, 3.5, 3.0] and run.output == "ok\n"


@pytest.fixture(scope="module")
def at3() -> list[n07_scaling.ScalingRun]:
    runs = zerolab.launch(n07_scaling.scaling_runs, world_size=N, args=((N,), 6), timeout=240)
    return [r[N] for r in runs]


def test_ring_bytes_by_op_add_up_to_the_stage_formula(at3):
    model = GPT(n07_scaling.MODEL)
    psi, root = num_params(model), sum(p.numel() for p in make_units(model)[-1].params)
    for run in at3:
        for stage, m in run.stages.items():
            assert sum(m.ring_by_op.values()) == m.sent
            # ZeRO-3: its root stays gathered from forward to backward, not gathered again
            formula = theory.comm_volume(psi, N, stage, root_numel=root if stage == "ZeRO-3"
                                         else 0).ring_sent_bytes
            assert formula <= m.sent <= formula * 1.001  # flat buffers padded to a multiple of N
            expected_ops = set(theory.STEP_COLLECTIVES[stage])
            assert set(m.ring_by_op) == set(m.wire_by_op) == set(m.impl_by_op) == expected_ops


def test_impl_says_what_gloo_ran(at3):
    for run in at3:
        for m in run.stages.values():
            for op, impl in m.impl_by_op.items():
                if op == "reduce_scatter":
                    assert f"as {N - 1} send/recv pairs" in impl
                elif op == "all_gather":
                    assert f"as {N} broadcasts" in impl
                else:
                    assert impl.startswith("all_reduce")


def test_wire_bytes_per_op_are_gloos_algorithm_plus_headers(at3):
    """DDP, ZeRO-1, ZeRO-2 (one call window per op, not overlapping): op by op."""
    for run in at3:
        for stage in ("DDP", "ZeRO-1", "ZeRO-2"):
            m = run.stages[stage]
            for op, ring in m.ring_by_op.items():
                expected = GLOO[op] * ring
                assert expected <= m.wire_by_op[op] <= expected * (1 + HEADERS), (stage, op)


def test_wire_bytes_per_step_are_gloos_algorithm_plus_headers(at3):
    """ZeRO-3's gathers overlap (prefetch), so only the step's total is exact."""
    for run in at3:
        for stage, m in run.stages.items():
            expected = sum(GLOO[op] * b for op, b in m.ring_by_op.items())
            assert m.wire == sum(m.wire_by_op.values())
            assert expected <= m.wire <= expected * (1 + HEADERS), stage
        # every stage's wire is its ring figure (plus headers): ZeRO-3 sends 1.5x ZeRO-2's,
        # less the root's backward gather (the root stays gathered from forward to backward)
        for stage in ("ZeRO-2", "ZeRO-3"):
            assert run.stages[stage].wire / run.stages[stage].sent == pytest.approx(1, 0.01)
        model = GPT(n07_scaling.MODEL)
        psi, root = num_params(model), sum(p.numel() for p in make_units(model)[-1].params)
        assert run.stages["ZeRO-3"].wire / run.stages["ZeRO-2"].wire == pytest.approx(
            (3 * psi - root) / (2 * psi), 0.01)


def test_wire_is_none_when_any_op_was_unmeasured():
    m = n07_scaling.StageMeasure({}, 10, {"all_reduce": 6, "all_gather": 4},
                                 {"all_reduce": 7, "all_gather": None}, {})
    assert m.wire is None
    m.wire_by_op["all_gather"] = 5
    assert m.wire == 12
