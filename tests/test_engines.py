"""DDP and ZeRO-1/2/3 against a single-process reference, torch's DDP and torch's FSDP2.

Adam amplifies reduction-order noise, so each engine is held to the yardstick of torch's own
DistributedDataParallel run on the same data in the same launch: equal at 1 rank, bitwise equal
at 2 ranks (a sum of two numbers and a halving are exact in any order), and within a small
multiple of torch DDP's own distance from the reference at 3 and 4 ranks. Gradient accumulation
(no_sync() and micro-batches) is held to torch's DDP.no_sync() the same way.
"""

from __future__ import annotations

import pytest
import torch
from workers import engines as W
from workers import features as F
from workers.features import KIND, STAGES

import zerolab
from zerolab import harness, theory
from zerolab.engines import ENGINES
from zerolab.harness import max_diff
from zerolab.units import make_units

ALL = list(W.ENGINES_TESTED)
KINDS = ["gpt", "mlp", "mlp_reuse"]
YARDSTICK_MULTIPLE = W.YARDSTICK_MULTIPLE




@pytest.fixture(scope="module")
def references():
    return {kind: W.reference_run(kind) for kind in KINDS}


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"N{n}")
def runs(request):
    n = request.param
    return n, zerolab.launch(W.equivalence, n, args=(KINDS, ALL, True), timeout=300)


def test_every_engine_matches_the_single_process_reference(runs, references):
    n, results = runs
    for kind in KINDS:
        yardstick = max_diff(results[0][kind]["torch_ddp"], references[kind])
        tol = YARDSTICK_MULTIPLE * yardstick
        for engine_key in ALL:
            for rank, res in enumerate(results):
                state = res[kind][engine_key]["state"]
                for name, ref in references[kind].items():
                    torch.testing.assert_close(
                        state[name], ref, atol=tol, rtol=0,
                        msg=lambda m, where=f"{engine_key} {kind} N={n} rank {rank} {name}",
                        y=yardstick: f"{where}: {m} (torch DDP's distance: {y:.2e})")


def test_bitwise_where_reduction_order_allows(runs):
    n, results = runs
    if n > 2:
        pytest.skip("sums of three or more numbers depend on their order: see the tolerance test")
    for kind in KINDS:
        expected = results[0][kind]["torch_ddp"]
        for engine_key in ALL:
            state = results[0][kind][engine_key]["state"]
            assert all(torch.equal(state[k], expected[k]) for k in expected), (engine_key, kind)


def test_every_rank_returns_the_same_full_state(runs):
    _, results = runs
    for kind in KINDS:
        for engine_key in ALL:
            first = results[0][kind][engine_key]["state"]
            for res in results[1:]:
                other = res[kind][engine_key]["state"]
                assert all(torch.equal(first[k], other[k]) for k in first), (engine_key, kind)


def test_zero3_matches_torch_fully_shard(runs):
    n, results = runs
    for kind in ["gpt"]:
        fsdp2 = results[0][kind]["torch_fsdp2"]
        ours = results[0][kind]["zero3"]["state"]
        if n <= 2:
            assert all(torch.equal(ours[k], fsdp2[k]) for k in fsdp2)
        else:
            yardstick = max_diff(results[0][kind]["torch_ddp"], fsdp2)
            assert max_diff(ours, fsdp2) <= YARDSTICK_MULTIPLE * max(yardstick, 1e-7)


# ---- memory: model-state bytes after a step, measured from the live tensors -------------------

def expected_state_bytes(engine_key: str, res: dict, model) -> dict[str, int]:
    """Exact bytes from the layouts: the formula plus padding and Adam's 4-byte step counters."""
    psi_all = sum(p.numel() for p in model.parameters())
    psi_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_train = sum(1 for p in model.parameters() if p.requires_grad)
    padded = sum(pad for _, pad in res["layouts"])
    n_buckets = len(res["layouts"])
    n = res["log"].world_size
    if engine_key == "ddp":
        return {"params": 4 * psi_all, "grads": 4 * padded,
                "optimizer": 8 * psi_train + 4 * n_train}
    sharded_opt = 8 * padded // n + 4 * n_buckets
    full_params = 4 * padded + 4 * (psi_all - psi_train)  # frozen params stay as they were
    if engine_key in ("zero1", "zero1_after_backward", "zero1_all_reduce"):
        return {"params": full_params, "grads": 4 * padded, "optimizer": sharded_opt}
    if engine_key in ("zero2", "zero2_after_backward"):
        return {"params": full_params, "grads": 4 * padded // n, "optimizer": sharded_opt}
    all_padded = sum(pad for unit in res["unit_layouts"] for pad, _ in unit)
    return {"params": 4 * all_padded // n, "grads": 4 * padded // n, "optimizer": sharded_opt}


def test_model_state_bytes_exact(runs):
    _, results = runs
    for kind in KINDS:
        model = W.build_model(kind)
        for engine_key in ALL:
            for res in results:
                got = res[kind][engine_key]["bytes"]
                assert got == expected_state_bytes(engine_key, res[kind][engine_key], model), (
                    engine_key, kind)


FORMULAS = {  # fp32 Adam, bytes per rank, Ψ parameters, N ranks
    "ddp": lambda psi, n: 16 * psi,
    "zero1": lambda psi, n: 8 * psi + 8 * psi / n,
    "zero1_after_backward": lambda psi, n: 8 * psi + 8 * psi / n,
    "zero1_all_reduce": lambda psi, n: 8 * psi + 8 * psi / n,
    "zero2": lambda psi, n: 4 * psi + 12 * psi / n,
    "zero2_after_backward": lambda psi, n: 4 * psi + 12 * psi / n,
    "zero3": lambda psi, n: 16 * psi / n,
}


def test_model_state_bytes_follow_the_paper(runs):
    """GPT (every parameter trainable): the totals are the paper's, up to padding (< 1%)."""
    n, results = runs
    psi = zerolab.models.num_params(W.build_model("gpt"))
    for engine_key in ALL:
        total = sum(results[0]["gpt"][engine_key]["bytes"].values())
        assert total == pytest.approx(FORMULAS[engine_key](psi, n), rel=0.01), engine_key


# ---- communication: bytes per rank per step --------------------------------------------------

def test_comm_bytes_per_step_match_the_formulas(runs):
    n, results = runs
    ring = (n - 1) / n  # one ring pass: each rank sends (N-1)/N of the tensor
    for kind in KINDS:
        buffer_bytes = sum(b.numel() * b.element_size() for b in W.build_model(kind).buffers())
        for engine_key in ALL:
            for res in results:
                r = res[kind][engine_key]
                # Buffers (the MLP's input_shift) are broadcast from rank 0 before each forward,
                # as torch's DDP does (parts/buffers.py): on top of the formulas, counted apart.
                buffers = [e for e in r["log"].events if e.tag.startswith(f"{engine_key}/fwd/buf")]
                assert [(e.op, e.nbytes) for e in buffers] == (
                    [("broadcast", buffer_bytes)] * W.STEPS if buffer_bytes and n > 1 else []), kind
                per_step = (r["log"].total_ring_bytes()
                            - sum(e.ring_bytes for e in buffers)) / W.STEPS
                padded = sum(pad for _, pad in r["layouts"])
                passes = {"ddp": 2, "zero1": 2, "zero1_after_backward": 2, "zero1_all_reduce": 3,
                          "zero2": 2, "zero2_after_backward": 2}
                if engine_key == "zero3":  # gather in forward and in backward, reduce-scatter
                    frozen = sum(pad for unit in r["unit_layouts"] for pad, t in unit if not t)
                    # ... but the root, kept gathered from forward to backward (root last)
                    root = sum(pad for pad, _ in r["unit_layouts"][-1])
                    expected = ring * 4 * (3 * padded + 2 * frozen - root)
                    if kind == "mlp_reuse":  # layers.1 runs twice: gathered again for the 2nd
                        expected += ring * 4 * r["unit_layouts"][1][0][0]
                else:
                    expected = passes[engine_key] * ring * 4 * padded
                assert per_step == expected, (engine_key, kind)
                assert all(e.tag.startswith(engine_key + "/") for e in r["log"].events)


def test_comm_volume_is_2psi_or_3psi(runs):
    """ZeRO-3's 3Ψ less the root's backward gather: the root stays gathered (FSDP2's does)."""
    n, results = runs
    model = W.build_model("gpt")
    psi = zerolab.models.num_params(model)
    root = sum(p.numel() for p in make_units(model)[-1].params)
    assert 0 < root < psi
    for engine_key in ALL:
        stage = theory.stage_name(ENGINES[engine_key].traffic)
        formula = theory.comm_volume(psi, n, stage, root_numel=root if stage == "ZeRO-3" else 0)
        per_step = results[0]["gpt"][engine_key]["log"].total_ring_bytes() / W.STEPS
        assert per_step == pytest.approx(formula.ring_sent_bytes, rel=0.01), engine_key


def test_which_collectives_run_in_which_phase(runs):
    n, results = runs
    ops = {s: {(e.op, e.tag.split("/")[1]) for e in results[0]["gpt"][s]["log"].events}
           for s in ALL}
    assert ops["ddp"] == {("all_reduce", "bwd")}
    assert ops["zero1"] == {("reduce_scatter", "bwd"), ("all_gather", "step")}
    assert ops["zero1_after_backward"] == {("reduce_scatter", "step"), ("all_gather", "step")}
    assert ops["zero1_all_reduce"] == {("all_reduce", "bwd"), ("all_gather", "step")}
    assert ops["zero2"] == {("reduce_scatter", "bwd"), ("all_gather", "step")}
    assert ops["zero3"] == {("all_gather", "fwd"), ("all_gather", "bwd"), ("reduce_scatter", "bwd")}


# ---- peak memory during a step ---------------------------------------------------------------

@pytest.fixture(scope="module")
def peaks():
    return zerolab.launch(W.peaks, 2, timeout=300)[0]


def test_zero2_hooks_keep_peak_gradient_below_the_full_gradient(peaks):
    hooked, naive = peaks["zero2"], peaks["zero2_after_backward"]
    full_grad, shards = hooked["trainable_bytes"], hooked["grad_shard_bytes"]
    # Hooked: the persistent shards plus about a bucket (two at a boundary) in flight.
    assert hooked["max"]["grads"] <= shards + 2 * max(hooked["bucket_bytes"])
    assert hooked["max"]["grads"] < full_grad
    # Naive: at the end of backward every full gradient is alive, beside the shards.
    assert naive["max"]["grads"] >= full_grad + shards


def test_zero3_peak_parameters_stay_within_shards_plus_two_units(peaks):
    for key, units_in_flight in [("zero3", 2), ("zero3_no_prefetch", 1)]:
        p = peaks[key]
        bound = p["shard_bytes"] + p["root_bytes"] + units_in_flight * max(p["unit_bytes"])
        assert p["max"]["params"] <= bound, key
        assert p["max"]["params"] < p["full_param_bytes"], key


def test_zero3_prefetch_issues_gathers_ahead(peaks):
    with_prefetch = [e for e in peaks["zero3"]["log"].events if e.op == "all_gather"]
    without = [e for e in peaks["zero3_no_prefetch"]["log"].events if e.op == "all_gather"]
    assert any(e.async_op for e in with_prefetch)
    assert not any(e.async_op for e in without)
    assert len(with_prefetch) == len(without)  # the same gathers, only earlier


# ---- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("engine_key", ALL)
def test_model_without_parameters_is_refused(engine_key):
    with pytest.raises(ValueError, match="has no parameters"):
        W.ENGINES_TESTED[engine_key](torch.nn.ReLU(), torch.optim.AdamW)


@pytest.mark.parametrize("engine_key", ALL)
@pytest.mark.parametrize("bad", ["adam", torch.nn.Linear, None])
def test_optimizer_class_must_be_a_torch_optimizer(engine_key, bad):
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        W.ENGINES_TESTED[engine_key](W.build_model("mlp"), bad)


def test_optimizer_instance_instead_of_class_is_refused():
    model = W.build_model("mlp")
    with pytest.raises(TypeError, match="the class, not an instance"):
        zerolab.ZeRO1(model, torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("engine_key", ALL)
def test_step_before_backward_is_refused(engine_key):
    with pytest.raises(RuntimeError, match="before backward"):
        W.step_without_backward(engine_key)


def test_zero3_units_must_be_submodules():
    model = W.build_model("gpt")
    with pytest.raises(ValueError, match="submodules of the model"):
        zerolab.ZeRO3(model, torch.optim.AdamW, units=[torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="submodules of the model"):
        zerolab.ZeRO3(model, torch.optim.AdamW, units=[model])


@pytest.mark.parametrize("engine_key", ALL)
def test_single_process_without_a_process_group(engine_key, references):
    """World size 1 with no process group (a notebook without launch) trains exactly."""
    model = W.build_model("mlp")
    engine = W.ENGINES_TESTED[engine_key](model, torch.optim.AdamW, lr=W.LR, weight_decay=0.1)
    for x, y in W.batches(model, 0, 1):
        model.loss(engine(x), y).backward()
        engine.step()
        engine.zero_grad()
    state = engine.full_state_dict()
    assert all(torch.equal(state[k], v) for k, v in references["mlp"].items())


# ---- ZeRO-1 and ZeRO-2 gather parameters asynchronously after step() -------------------------

@pytest.fixture(scope="module")
def prefetched(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("prefetch"))
    return zerolab.launch(W.prefetched_params, 2, args=(["zero1", "zero2"], folder), timeout=300)


@pytest.mark.parametrize("engine_key", ["zero1", "zero2"])
def test_readers_after_step_see_the_gathered_parameters(prefetched, engine_key):
    for res in prefetched:
        r = res[engine_key]
        # Right after the last step the gathers were still pending: each reader had to wait.
        assert r["pending_before_read"] > 0 and r["pending_before_save"] > 0
        reference = r["no_prefetch"]
        assert max_diff(r["read"], reference) == 0  # full_state_dict() right after step()
        saved = {k: v for k, v in r["saved"].items() if k in reference}
        assert max_diff(saved, reference) == 0  # checkpoint.save() right after step()


@pytest.mark.parametrize("engine_key", ["zero1", "zero2"])
def test_parameter_gathers_overlap_the_next_forward(prefetched, engine_key):
    log = prefetched[0][engine_key]["log"]
    forwards = [s for s in log.spans if s.name == "forward"]
    gathers = [e for e in log.events if e.op == "all_gather"]
    assert gathers and all(e.async_op for e in gathers)
    steps = len(forwards)
    per_step = len(gathers) // steps
    for k in range(steps - 1):  # step k's gathers are waited for inside forward k + 1
        for e in gathers[k * per_step:(k + 1) * per_step]:
            assert forwards[k + 1].start <= e.end <= forwards[k + 1].end, (k, e.tag)


# ---- ZeRO-3 with activation checkpointing ------------------------------------------------------

@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no_prefetch"])
def test_zero3_with_checkpointing_gathers_each_unit_once_per_phase(prefetch):
    """Backward re-runs each checkpointed block's forward: its hooks fire again and must neither
    prefetch the next block nor free the block being back-propagated."""
    results = zerolab.launch(W.checkpointed_zero3, 2, args=(prefetch,), timeout=300)
    for res in results:
        plain, ckpt = res["none"], res["block"]
        assert max_diff(ckpt["state"], plain["state"]) == 0  # the same training, bitwise
        assert ckpt["gathers"] == plain["gathers"]  # the same gathers, no extra
        for i in range(4):  # once in forward and once in backward, every step
            assert ckpt["gathers"][f"fwd/blocks.{i}"] == W.STEPS
            assert ckpt["gathers"][f"bwd/blocks.{i}"] == W.STEPS
        assert ckpt["ring"] == plain["ring"]


# ---- gradient accumulation: no_sync() and micro-batches, every stage with the GPT ---------------

@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def accumulated(request):
    return request.param, zerolab.launch(F.accumulate, request.param, args=(STAGES, KIND),
                                         timeout=300)


def test_accumulation_equals_one_big_batch(accumulated):
    """4 micro-batches with no_sync() then one synced == one step on the 4x batch."""
    n, results = accumulated
    reference = F.reference_big_batch(KIND)
    yardstick = max_diff(results[0]["torch_ddp"], reference)
    for engine_key in STAGES:
        for rank, res in enumerate(results):
            diff = max_diff(res[engine_key]["state"], reference)
            assert diff <= W.YARDSTICK_MULTIPLE * yardstick, (engine_key, rank, diff, yardstick)
            if n == 2:  # sums of two are exact: bitwise equal to torch's DDP.no_sync()
                assert diff == yardstick, engine_key


def test_no_reduction_inside_no_sync(accumulated):
    _, results = accumulated
    for engine_key in STAGES:
        assert results[0][engine_key]["reductions_inside_no_sync"] == 0, engine_key


@pytest.mark.parametrize("rows, micro_batches", [(5, 2), (4, 0), (3, 4)])
def test_micro_batches_that_do_not_divide_the_batch_are_refused(rows, micro_batches):
    """Unequal micro-batches, each loss divided by their count, would not give the mean."""
    x = y = torch.zeros(rows, 3)
    with pytest.raises(ValueError, match=f"micro_batches={micro_batches} must divide the "
                                         f"batch's {rows} rows"):
        harness.train_step(None, x, y, torch.nn.functional.mse_loss,
                           micro_batches=micro_batches)
