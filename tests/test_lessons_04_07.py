"""The measurement functions behind notebooks 04-07 (zerolab.lessons.n04..n07), on real ranks.

Every figure those notebooks print is checked here against its formula, on smaller models than
the notebooks use, so that a change in the package that moves a number fails a test instead of
silently changing a notebook. Starting ranks costs seconds: one launch of 2 ranks runs every
lesson (the combined worker below; spawned ranks import it from this module).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import zerolab
from zerolab import engines, theory
from zerolab.comm import CommEvent, CommLog, Span
from zerolab.lessons import n04_zero2, n05_zero3, n06_fsdp2, n07_scaling
from zerolab.models import GPT, GPTConfig, num_params
from zerolab.units import make_units

N = 2
GPT04 = GPTConfig(n_layer=2, n_embd=32, n_head=2)  # 3 buckets of 20 kB
BUCKET_BYTES = 20_000
GPT05 = GPTConfig(n_layer=8, n_embd=32, n_head=2)  # 8 blocks: shards + 2 blocks < the model
GPT06 = GPTConfig(n_layer=2, n_embd=32, n_head=2)
STEPS06 = 4  # two warm-up steps, one timed, the last measured


# ---- the worker: every lesson at N = 2, in one launch -------------------------------------------

def lessons_at_2() -> dict:
    return {"n04": n04_zero2.zero2_lesson(bucket_bytes=BUCKET_BYTES, config=GPT04),
            "n05": n05_zero3.zero3_lesson(config=GPT05),
            "n06": n06_fsdp2.side_by_side(config=GPT06, steps=STEPS06),
            "n07": n07_scaling.scaling_runs((1, 2))}


@pytest.fixture(scope="module")
def at2() -> list[dict]:
    return zerolab.launch(lessons_at_2, world_size=N, timeout=240)


def psi(config: GPTConfig) -> int:
    return num_params(GPT(config))


def root_numel(config: GPTConfig, stage: str = "ZeRO-3") -> int:
    """ZeRO-3's root unit (embeddings, final LayerNorm): kept gathered from forward to
    backward, it is not gathered again (theory.comm_volume's root_numel); 0 for other stages."""
    return sum(p.numel() for p in make_units(GPT(config))[-1].params) if stage == "ZeRO-3" else 0


# ---- 04: ZeRO-2 ---------------------------------------------------------------------------------

NAMES04 = ("zero1", "zero2_after_backward", "zero2")


def test_zero2_at_rest_is_the_formula_plus_one_step_counter_per_bucket(at2):
    p = psi(GPT04)
    for r in at2:
        r04 = r["n04"]
        assert r04.num_params == p and r04.full_grad_bytes == 4 * p
        n_buckets = len(r04.runs["zero2"].bucket_bytes)
        assert n_buckets >= 3  # several buckets: the hooked peak is well below the full gradient
        for key in NAMES04:
            stage = "ZeRO-1" if key == "zero1" else "ZeRO-2"
            formula = theory.model_state_memory(r04.runs[key].padded_numel, N, stage)
            held = r04.runs[key].step.held
            assert held["grads"] == formula.grads
            assert held["optimizer"] == formula.optimizer + 4 * n_buckets
            assert sum(held.values()) == formula.total + 4 * n_buckets


def test_zero2_peak_gradient_naive_holds_everything_hooked_one_bucket(at2):
    for r in at2:
        r04 = r["n04"]
        full, shards = r04.full_grad_bytes, r04.runs["zero2"].grad_shard_bytes
        largest = max(r04.runs["zero2"].bucket_bytes)
        peaks = {k: run.step.memory.max_by_category["grads"] for k, run in r04.runs.items()}
        assert peaks["zero1"] == full
        assert peaks["zero2_after_backward"] == full + shards
        hooked = peaks["zero2"]
        assert shards < hooked <= shards + 2 * largest
        assert hooked < full


def test_zero2_variants_take_the_same_step(at2):
    for r in at2:
        assert len({r["n04"].runs[k].loss_after for k in NAMES04}) == 1


def test_zero2_reduce_scatters_during_backward_only_when_hooked(at2):
    runs = at2[0]["n04"].runs
    n_buckets = len(runs["zero2"].bucket_bytes)
    hooked = n04_zero2.ops_by_phase(runs["zero2"].step.log)
    naive = n04_zero2.ops_by_phase(runs["zero2_after_backward"].step.log)
    assert hooked["backward"] == {"reduce_scatter": n_buckets}
    assert hooked["step"] == {"all_gather": n_buckets}
    assert naive["backward"] == {}
    assert naive["step"] == {"reduce_scatter": n_buckets, "all_gather": n_buckets}


def test_zero2_sends_2psi_and_phases_are_on_the_trace_clock(at2):
    runs = at2[0]["n04"].runs
    expected = theory.comm_volume(runs["zero2"].padded_numel, N, "ZeRO-2").ring_sent_bytes
    for key in NAMES04:
        assert runs[key].step.log.total_ring_bytes() == expected
        trace = runs[key].step.memory
        phases = runs[key].step.phases()
        assert [s.name for s in phases] == ["forward", "backward", "step"]
        starts_ends = [t for s in phases for t in (s.start, s.end)]
        assert starts_ends == sorted(starts_ends)
        last_sample = trace.samples[-1][0] - trace.samples[0][0]
        assert 0 <= starts_ends[0] and starts_ends[-1] <= last_sample + 0.05


def test_zero2_hooked_holds_about_two_buckets_of_full_gradient(at2):
    for r in at2:
        run = r["n04"].runs["zero2"]
        largest = max(run.bucket_bytes)
        peak = run.step.memory.max_by_category
        assert 0 < peak["comm"] <= largest  # one flattened bucket in flight at a time
        assert peak["grads"] + peak["comm"] <= run.grad_shard_bytes + 2 * largest


def test_zero2_buckets_close_once_they_reach_bucket_bytes(at2):
    run = at2[0]["n04"].runs["zero2"]
    assert [sum(sizes) for sizes in run.param_bytes] == run.bucket_bytes  # no padding at N=2
    for sizes in run.param_bytes:
        assert sum(sizes[:-1]) < BUCKET_BYTES  # still open when its last parameter came
    assert all(b >= BUCKET_BYTES for b in run.bucket_bytes[:-1])  # closed: reached the cap
    assert max(run.bucket_bytes) > BUCKET_BYTES  # a soft cap


def test_zero2_wire_bytes_are_what_gloo_ran(at2):
    for r in at2:
        for key in NAMES04:
            log = r["n04"].runs[key].step.log
            ring, wire = log.bytes_by_op(), log.wire_bytes_by_op()
            impl = {e.op: e.impl for e in log.events}
            assert "send/recv pair" in impl["reduce_scatter"]
            assert f"as {N} broadcasts" in impl["all_gather"]
            n_events = len(log.events) // 2  # one reduce-scatter, one all-gather per bucket
            assert_wire(wire["reduce_scatter"], ring["reduce_scatter"], n_events)
            assert_wire(wire["all_gather"], ring["all_gather"], n_events)
            assert 2 * ring["all_gather"] <= log.total_wire_bytes()


def assert_wire(wire: int, expected: int, n_events: int) -> None:
    """Measured bytes: `expected` plus message headers (under 1 KiB per call). Overlapping calls
    share their bytes out in proportion, so a per-op figure may also fall a little short."""
    assert expected * 0.98 <= wire <= expected + 1024 * n_events


def test_zero2_accumulation_reduces_every_micro_batch_and_adds_up(at2):
    for r in at2:
        n_buckets = len(r["n04"].runs["zero2"].bucket_bytes)
        acc = r["n04"].accumulation
        assert acc.reduce_scatters == [n_buckets, 2 * n_buckets]
        assert acc.max_diff < 1e-6


def test_zero2_prefetch_finishes_the_gathers_in_the_next_forward(at2):
    for r in at2:
        n_buckets = len(r["n04"].runs["zero2"].bucket_bytes)
        steps = r["n04"].two_steps
        assert [s.name for s in steps[True].spans] == ["forward", "backward", "step"] * 2
        assert n04_zero2.gathers_finished_in(steps[False], "step") == n_buckets
        assert n04_zero2.gathers_finished_in(steps[False], "forward") == 0
        assert n04_zero2.gathers_finished_in(steps[True], "step") == 0
        assert n04_zero2.gathers_finished_in(steps[True], "forward") == n_buckets


def test_gathers_finished_in_counts_the_first_steps_gathers_by_span():
    def gather(start, end):
        return CommEvent("all_gather", "zero2/step/b", 8, 4, start=start, end=end)

    log = CommLog(rank=0, world_size=2, events=[gather(1.0, 2.5), gather(1.1, 1.5),
                                                 gather(5.0, 5.5), gather(5.1, 9.0)],
                  spans=[Span("step", 1.0, 1.6), Span("forward", 2.0, 3.0),
                         Span("step", 5.0, 5.2)])
    assert n04_zero2.gathers_finished_in(log, "step") == 1
    assert n04_zero2.gathers_finished_in(log, "forward") == 1


# ---- 05: ZeRO-3 ---------------------------------------------------------------------------------

def test_zero3_at_rest_is_16psi_over_n_plus_step_counters(at2):
    p = psi(GPT05)
    for r in at2:
        run = r["n05"].no_prefetch
        assert r["n05"].num_params == p and run.full_param_bytes == 4 * p
        n_units = len(run.unit_bytes)
        assert n_units == GPT05.n_layer + 1 and list(run.unit_bytes)[-1] == "root"
        formula = theory.model_state_memory(run.padded_numel, N, "ZeRO-3")
        assert run.shard_bytes == formula.params
        assert sum(run.step.held.values()) == formula.total + 4 * n_units


def test_zero3_parameter_peaks_stay_within_shards_plus_units(at2):
    for r in at2:
        on, off = r["n05"].prefetch, r["n05"].no_prefetch
        shards, root = off.shard_bytes, off.unit_bytes["root"]
        block = max(b for name, b in off.unit_bytes.items() if name != "root")
        peak_on = on.step.memory.max_by_category["params"]
        assert off.step.memory.max_by_category["params"] == shards + root + block
        assert shards + root + block <= peak_on <= shards + root + 2 * block
        assert peak_on < on.full_param_bytes
        assert r["n05"].same_weights


def test_zero3_gathers_twice_and_sends_3psi_against_zero2s_2psi(at2):
    """3Ψ less the root's backward gather: the root stays gathered from forward to backward."""
    r05 = at2[0]["n05"]
    off = r05.no_prefetch
    padded, root = off.padded_numel, off.unit_bytes["root"] // 4
    one_pass = theory.ring_sent_bytes("all_gather", 4 * padded, N)
    assert n05_zero3.bytes_by_phase(off.step.log) == {
        "fwd all_gather": one_pass,
        "bwd all_gather": theory.ring_sent_bytes("all_gather", 4 * (padded - root), N),
        "bwd reduce_scatter": one_pass}
    assert off.step.log.total_ring_bytes() == theory.comm_volume(
        padded, N, "ZeRO-3", root_numel=root).ring_sent_bytes
    assert r05.zero2_log.total_ring_bytes() == theory.comm_volume(padded, N, "ZeRO-2"
                                                                  ).ring_sent_bytes
    blocks = [f"blocks.{i}" for i in range(GPT05.n_layer)]
    assert n05_zero3.gathers_by_phase(off.step.log) == {
        "fwd": ["root", *blocks], "bwd": list(reversed(blocks))}


def test_zero3_prefetch_issues_gathers_ahead_and_overlaps_compute(at2):
    for r in at2:
        on, off = r["n05"].prefetch, r["n05"].no_prefetch
        assert n05_zero3.issued_ahead(on.step.log) == 2 * GPT05.n_layer
        assert n05_zero3.issued_ahead(off.step.log) == 0
        assert n05_zero3.overlapped_gathers(on.timeline) == GPT05.n_layer - 1
        assert n05_zero3.overlapped_gathers(off.timeline) == 0
        window = n05_zero3.forward_window(on.timeline)
        assert len(window.spans) == GPT05.n_layer  # one compute span per block
        assert all("/fwd/" in e.tag for e in window.events) and window.events


def test_zero3_working_set_does_not_grow_with_depth(at2):
    for r in at2:
        r05 = r["n05"]
        off = r05.no_prefetch
        root = off.unit_bytes["root"]
        block = max(b for name, b in off.unit_bytes.items() if name != "root")
        assert [d.n_layer for d in r05.depths] == sorted((*n05_zero3.DEPTHS, GPT05.n_layer))
        for d in r05.depths:
            config = dataclasses.replace(GPT05, n_layer=d.n_layer)
            assert d.full_param_bytes == 4 * psi(config)
            assert d.shard_bytes * N >= d.full_param_bytes  # 4Ψ/N, + padding
            assert d.peak_param_bytes - d.shard_bytes == root + 2 * block
        ratios = [d.peak_param_bytes / d.full_param_bytes for d in r05.depths]
        assert ratios == sorted(ratios, reverse=True) and ratios[0] > 1 > ratios[-1]
        assert r05.cpu_cores >= 1 and r05.compute_threads >= 1


def test_zero3_and_zero2_wire_bytes_are_ring_times_what_gloo_ran(at2):
    for r in at2:
        r05 = r["n05"]
        for log in (r05.no_prefetch.step.log, r05.zero2_log):
            ring = log.bytes_by_op()
            gloo = ring["all_gather"] + ring["reduce_scatter"]  # N broadcasts; send/recv pairs
            assert gloo <= log.total_wire_bytes() <= gloo + 1024 * len(log.events)  # headers


def test_block_compute_ms_is_the_median_forward_span():
    log = CommLog(rank=0, world_size=2, spans=[
        Span("forward", 0.0, 0.002), Span("forward", 0.01, 0.014), Span("forward", 0.02, 0.03),
        Span("backward", 0.03, 1.0)])
    assert n05_zero3.block_compute_ms(log) == pytest.approx(4.0)


# ---- 06: FSDP2 and ZeroRedundancyOptimizer -----------------------------------------------------

STAGE_OF = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
            "torch_ddp": "DDP", "torch_ddp_zero": "ZeRO-1", "torch_fsdp2": "ZeRO-3"}


def test_every_variant_ends_bitwise_equal_to_torch_ddp(at2):
    for r in at2:
        variants = r["n06"].variants
        assert tuple(variants) == tuple(STAGE_OF) == n06_fsdp2.VARIANTS
        reference = variants["torch_ddp"].full
        for name in STAGE_OF:
            full = variants[name].full
            assert set(reference) == set(full), name  # state_dicts: the tied head is named too
            assert all(torch.equal(full[k], reference[k]) for k in reference), name


def test_model_states_match_the_formulas_within_step_counters(at2):
    p = psi(GPT06)
    tensors = len(list(GPT(GPT06).parameters()))
    for r in at2:
        r06 = r["n06"]
        assert r06.num_params == p
        for name, stage in STAGE_OF.items():
            held = sum(r06.variants[name].held.values())
            extra = held - theory.model_state_memory(p, N, stage).total
            assert 0 < extra <= 4 * tensors, (name, extra)  # AdamW's 4-byte step counters
        zero_ro = r06.variants["torch_ddp_zero"]
        assert zero_ro.held["optimizer"] == 8 * zero_ro.owned["numel"] + 4 * zero_ro.owned[
            "tensors"]
    owned = [r["n06"].variants["torch_ddp_zero"].owned for r in at2]
    assert sum(o["numel"] for o in owned) == p and sum(o["tensors"] for o in owned) == tensors


def test_collectives_counted_and_recorded(at2):
    variants = at2[0]["n06"].variants
    units = GPT06.n_layer + 1
    assert variants["torch_ddp"].calls == {"all_reduce": 1}
    # parameters_as_bucket_view=True: each rank broadcasts the parameters it owns as one bucket.
    assert variants["torch_ddp_zero"].calls == {"all_reduce": 1, "broadcast": N}
    # FSDP2 keeps the root gathered from forward into backward: units + blocks all-gathers.
    assert variants["torch_fsdp2"].calls == {"all_gather": units + GPT06.n_layer,
                                             "reduce_scatter": units}
    for name in engines.STAGE_ENGINES:
        stage = STAGE_OF[name]
        expected = theory.comm_volume(psi(GPT06), N, stage,
                                      root_numel=root_numel(GPT06, stage)).ring_sent_bytes
        assert sum(variants[name].sent.values()) == expected, name
    shapes = variants["torch_fsdp2"].shapes
    assert shapes["wte.weight"] == ((GPT06.vocab_size, GPT06.n_embd),
                                    (GPT06.vocab_size // N, GPT06.n_embd))


def test_torch_traffic_counted_is_the_ring_formula(at2):
    p = psi(GPT06)
    model = GPT(GPT06)
    root = sum(q.numel() for n, q in model.named_parameters() if not n.startswith("blocks."))
    all_reduce = theory.ring_sent_bytes("all_reduce", 4 * p, N)
    for r in at2:
        variants = r["n06"].variants
        assert variants["torch_ddp"].sent == {"all_reduce": all_reduce}
        zero_ro = variants["torch_ddp_zero"]  # at N = 2 the owner sends its bucket, once
        assert zero_ro.sent == {"all_reduce": all_reduce, "broadcast": 4 * zero_ro.owned["numel"]}
        fsdp2 = sum(variants["torch_fsdp2"].sent.values())  # the root is gathered once
        assert fsdp2 == theory.ring_sent_bytes("all_gather", 4 * (3 * p - root), N)


def test_step_times_are_recorded(at2):
    for name in STAGE_OF:
        times = at2[0]["n06"].variants[name].times
        assert len(times) == STEPS06 and all(t > 0 for t in times)
        assert n06_fsdp2.median_ms(times) > 0


# ---- 07: scaling --------------------------------------------------------------------------------

def test_scaling_runs_match_the_formulas_at_each_world_size(at2):
    p = psi(n07_scaling.MODEL)
    assert at2[1]["n07"][1] is None  # rank 1 sat out the N = 1 run
    for n in (1, 2):
        for r in at2[:n]:
            run = r["n07"][n]
            assert run.world_size == n and run.num_params == p
            assert tuple(run.stages) == n07_scaling.STAGES == ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
            for stage in n07_scaling.STAGES:
                held = sum(run.stages[stage].held.values())
                formula = theory.model_state_memory(p, n, stage).total
                assert 0 <= held - formula < 1e-3 * formula, (n, stage)
                assert run.stages[stage].sent == theory.comm_volume(
                    p, n, stage, root_numel=root_numel(n07_scaling.MODEL, stage)).ring_sent_bytes


# ---- helpers on hand-made logs (no ranks) -------------------------------------------------------

def _log(events: list[tuple[str, str, float, float, bool]], spans: list[tuple[str, float, float]]
         ) -> CommLog:
    return CommLog(rank=0, world_size=2,
                   events=[CommEvent(op, tag, 8, 4, a, b, async_op) for op, tag, a, b, async_op
                           in events],
                   spans=[Span(name, a, b) for name, a, b in spans])


def test_ops_by_phase_assigns_each_event_to_the_span_it_was_issued_in():
    log = _log([("reduce_scatter", "z/bwd/b0", 1.5, 2.5, True),
                ("all_gather", "z/step/b0", 3.5, 3.6, False),
                ("broadcast", "z/init/w", 0.1, 0.2, False)],  # outside every span: not counted
               [("forward", 0.5, 1.0), ("backward", 1.0, 3.0), ("step", 3.0, 4.0)])
    assert n04_zero2.ops_by_phase(log) == {"forward": {}, "backward": {"reduce_scatter": 1},
                                           "step": {"all_gather": 1}}


def test_overlapped_gathers_needs_the_gather_to_span_the_previous_block():
    spans = [("forward", 1.0, 2.0), ("forward", 3.0, 4.0), ("forward", 5.0, 6.0)]
    ahead = _log([("all_gather", "zero3/fwd/blocks.1", 0.9, 2.5, True),
                  ("all_gather", "zero3/fwd/blocks.2", 2.9, 4.5, True)], spans)
    serial = _log([("all_gather", "zero3/fwd/blocks.1", 2.1, 2.9, False),
                   ("all_gather", "zero3/fwd/blocks.2", 4.1, 4.9, False)], spans)
    assert n05_zero3.overlapped_gathers(ahead) == 2
    assert n05_zero3.overlapped_gathers(serial) == 0
    assert n05_zero3.issued_ahead(ahead) == 2 and n05_zero3.issued_ahead(serial) == 0


def test_median_ms_leaves_out_warmup_and_the_measured_last_step():
    times = [9.0] * n06_fsdp2.WARMUP + [0.001, 0.003, 0.002] + [9.0]
    assert n06_fsdp2.median_ms(times) == pytest.approx(2.0)


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
