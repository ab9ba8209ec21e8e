"""A torch user's habits on every engine give torch's result: the single-process reference on the
same global batch, and torch's DDP running the same loop (whose distance from the reference is
the yardstick, as in test_engines.py: Adam turns reduction-order rounding into ~1e-5).

One launch per world size runs every habit under every engine (workers/habits.py): zeroing
through the model or the optimizer, two or three backward passes before step() without
no_sync(), parameters read right after step(), model.state_dict() saved and loaded (ZeRO-3
gathers), BatchNorm's buffers, parameter groups, mixed dtypes. Refusals are triggered and their
messages checked, in this process.
"""

from __future__ import annotations

import pytest
import torch
from workers import habits as H

import zerolab
from zerolab.harness import max_diff

YARDSTICK_MULTIPLE = 5
FLOOR = 1e-6  # where torch's DDP lands bitwise on the reference


@pytest.fixture(scope="module")
def references():
    return {habit: H.reference(habit) for habit in H.HABITS if habit != "batchnorm"}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N{n}")
def runs(request):
    return request.param, zerolab.launch(H.habits, request.param, timeout=600)


def _close(got: dict, expected: dict, tol: float, where: str) -> None:
    diff = max_diff(got, expected)
    assert diff <= tol, f"{where}: {diff:.2e} from the reference (allowed {tol:.2e})"


def _tolerance(results: list, references: dict, habit: str) -> float:
    yardstick = max(max_diff(r["torch_ddp"][habit]["state"], references[habit]["state"])
                    for r in results)
    return max(YARDSTICK_MULTIPLE * yardstick, FLOOR)


def _cases(results: list, habits) -> list[tuple[str, str]]:
    return [(h, k) for (h, k) in results[0]["engines"] if h in habits]


GRADS_SHARDED = ("zero2", "zero3", "hsdp")  # no full .grad between steps


def test_every_zeroing_spelling_trains_as_torch(runs, references):
    """model.zero_grad(), optimizer.zero_grad() (set_to_none either way, before backward or
    after step), engine.zero_grad(), and p.grad = None by hand (DDP, ZeRO-1)."""
    n, results = runs
    for habit, key in _cases(results, H.ZEROING):
        if habit == "p.grad = None" and key in GRADS_SHARDED:
            continue  # the next test
        tol = _tolerance(results, references, habit)
        for rank, r in enumerate(results):
            _close(r["engines"][habit, key]["state"], references[habit]["state"], tol,
                   f"{key} {habit} N={n} rank {rank}")
    assert {k for h, k in _cases(results, ["model.zero_grad"])} == set(H.ENGINES)
    ran = {h for h, _ in _cases(results, H.ZEROING)}
    assert ran == set(H.ZEROING if n % 2 else H.ZEROING_AT_EVERY_SIZE), ran


def test_gradients_never_zeroed_are_said_to_add_up(runs):
    """ZeRO-2/3 hold no .grad between steps, so p.grad = None by hand zeroes nothing: the next
    backward adds to the last step's gradients, as torch's would had nothing zeroed them, and
    the engine warns, naming the calls that zero. No other habit warns."""
    _, results = runs
    for r in results:
        for (habit, key), got in r["engines"].items():
            warned = [w for w in got["warnings"] if "adds to the gradients the last step" in w]
            if habit == "p.grad = None" and key in GRADS_SHARDED:
                assert warned and "model.zero_grad()" in warned[0], key
                assert warned[0].startswith({"zero2": "ZeRO2", "zero3": "ZeRO3",
                                             "hsdp": "HSDP"}[key]), warned[0]
            else:
                assert not got["warnings"], (habit, key, got["warnings"])


@pytest.mark.parametrize("habit", ["two_backward", "three_backward"])
def test_backward_passes_without_no_sync_add_up(runs, references, habit):
    """Each backward reduces its own gradients; step() takes their sum, as torch's DDP."""
    n, results = runs
    tol = _tolerance(results, references, habit)
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            _close(r["engines"][habit, key]["state"], references[habit]["state"], tol,
                   f"{key} {habit} N={n} rank {rank}")
            first = results[0]["engines"][habit, key]["state"]
            assert max_diff(r["engines"][habit, key]["state"], first) == 0, (key, rank)
    for key in ("zero1", "zero2"):  # prefetch=True changes nothing here
        for r in results:
            _close(r["prefetch"]["two_backward", key]["state"], references["two_backward"]["state"],
                   _tolerance(results, references, "two_backward"), f"{key} prefetch")


def test_parameters_read_right_after_step_are_the_stepped_ones(runs, references):
    """model.parameters() (DDP, ZeRO-1/2) and model.state_dict() (every engine) read right after
    step(), before any forward: the reference's values after that step, on every rank."""
    n, results = runs
    for habit in ("read after step", "state_dict after step"):
        tol = _tolerance(results, references, habit)
        expected = references[habit]["reads"]
        for _, key in _cases(results, [habit]):
            for rank, r in enumerate(results):
                reads = r["engines"][habit, key]["reads"]
                for step, (got, want) in enumerate(zip(reads, expected, strict=True)):
                    got = dict(enumerate(got)) if isinstance(got, list) else got
                    want = dict(enumerate(want)) if isinstance(want, list) else want
                    _close(got, want, tol, f"{key} {habit} step {step} N={n} rank {rank}")
    for key in ("zero1", "zero2"):  # overlap opted into: model.state_dict() waits for it
        for rank, r in enumerate(results):
            for step, (got, want) in enumerate(zip(
                    r["prefetch"]["state_dict after step", key]["reads"],
                    references["state_dict after step"]["reads"], strict=True)):
                _close(got, want, _tolerance(results, references, "state_dict after step"),
                       f"{key} prefetch=True step {step} rank {rank}")


@pytest.fixture(scope="module")
def reference_state_dicts():
    return H.reference_state_dicts()


def test_model_state_dict_round_trips_through_torch_save(runs, reference_state_dicts):
    """ZeRO-3 too: model.state_dict() holds full tensors (a collective), torch.save writes them,
    and a plain model loads them."""
    n, results = runs
    tol = _tolerance(results, {"engine.zero_grad": {"state": reference_state_dicts["trained"]}},
                     "engine.zero_grad")
    full_bytes = sum(v.numel() * v.element_size()
                     for v in reference_state_dicts["trained"].values())
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            got = r["state_dicts"][key]
            _close(got["plain"], reference_state_dicts["trained"], tol, f"{key} N={n} {rank}")
            # A tied weight is saved once: the file holds each distinct tensor's bytes.
            assert got["saved_bytes"] > full_bytes - H.gpt().wte.weight.numel() * 4, key


def test_model_load_state_dict_fills_every_engine(runs, reference_state_dicts):
    """model.load_state_dict(full) into a fresh engine (other seeds): full_state_dict() gives
    the loaded values, training goes on from them; strict=False keeps what was left out."""
    n, results = runs
    ref = reference_state_dicts
    tol = _tolerance(results, {"engine.zero_grad": {"state": ref["trained"]}},
                     "engine.zero_grad")
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            got = r["state_dicts"][key]
            assert max_diff(got["loaded"], got["plain"]) == 0, (key, rank)
            _close(got["trained_on"], ref["trained_on"], 10 * tol, f"{key} trained on, {rank}")
            _close(got["partial"], ref["partial"], tol, f"{key} partial load, rank {rank}")
            assert got["missing"] and all(k.startswith("blocks.1.") for k in got["missing"])


def test_engine_state_dict_round_trips_per_rank_through_torch_save(runs):
    """engine.rank_state_dict(), this rank's part, saved with torch.save and read with torch.load's
    defaults (weights_only) into a fresh engine: the same parameters, and two more steps train
    to the same bits (Adam's state came back too); a full state dict loads as well; another
    rank's part is refused, naming the calls that change the world size."""
    _, results = runs
    assert results[0]["engine_state"]["zero3"]["not_pieces"][0] is not None  # (ZeRO-3: pieces)
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            got = dict(r["engine_state"][key])
            refused = got.pop("refused")
            chunked, not_pieces = got.pop("not_pieces")
            if chunked is not None:  # a rank's pieces, given whole instead: refused by name
                assert not_pieces == (f"{chunked}: expected this rank's pieces "
                                      "(engine.rank_state_dict()), got Tensor"), not_pieces
            assert got == {"same_loaded": True, "same_trained_on": True, "full_form": True}, (
                key, rank)
            assert f"'rank': {rank}" in refused and "zerolab.checkpoint.save" in refused, refused


def test_batchnorm_buffers_follow_torch_ddp(runs):
    """Rank 0's buffers are broadcast before each training forward (torch's DDP default):
    parameters, every rank's own buffers and eval outputs as torch's DDP; the broadcasts are
    tagged collectives; full_state_dict() gives rank 0's buffers."""
    n, results = runs
    yardstick = _batchnorm_tolerance(n)
    for key in H.ENGINES:
        name = "batchnorm"
        for rank, r in enumerate(results):
            got, torch_ddp = r["engines"][name, key], r["torch_ddp"][name]
            _close(got["local_buffers"], torch_ddp["local_buffers"], yardstick,
                   f"{key} buffers rank {rank}")
            _close({"eval": got["eval"]}, {"eval": torch_ddp["eval"]}, yardstick,
                   f"{key} eval rank {rank}")
            assert torch.equal(got["eval"], results[0]["engines"][name, key]["eval"])
            _close(got["state"], results[0]["torch_ddp"][name]["state"], yardstick,
                   f"{key} state rank {rank}")
            assert got["tags"] == [f"{key}/fwd/buffers.float32", f"{key}/fwd/buffers.int64"]
            assert got["buffer_broadcasts"] == 2 * H.STEPS, key


def _batchnorm_tolerance(n: int) -> float:
    """At 2 ranks the engines are bitwise torch's DDP; at 3 the reductions add in other orders
    (SGD here, workers/habits.py: nothing amplifies the last bits)."""
    return FLOOR if n == 2 else 1e-5


def test_broadcast_buffers_false_keeps_each_ranks_own(runs):
    n, results = runs
    name = "batchnorm, no broadcast"
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            got, torch_ddp = r["engines"][name, key], r["torch_ddp"][name]
            _close(got["local_buffers"], torch_ddp["local_buffers"], _batchnorm_tolerance(n),
                   f"{key} {rank}")
            assert got["buffer_broadcasts"] == 0, key
        mean = "bn.running_mean"
        assert not torch.equal(results[0]["engines"][name, key]["local_buffers"][mean],
                               results[1]["engines"][name, key]["local_buffers"][mean]), key


def test_a_copy_of_the_model_is_not_the_engine(runs):
    """copy.deepcopy(model) (an EMA, an eval copy) copies the engine's hooks: the copy's
    zero_grad() is torch's own, and its forward on rank 0 alone broadcasts no buffer."""
    _, results = runs
    for key, got in results[0]["copies"].items():
        assert got["grads_kept"] and got["copy_collectives"] == 0, key


def test_parameter_groups_train_as_torch(runs, references):
    n, results = runs
    tol = _tolerance(results, references, "param_groups")
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            got = r["engines"]["param_groups", key]
            _close(got["state"], references["param_groups"]["state"], tol, f"{key} {rank}")
            assert got["group_options"] == [(0.1, H.LR), (0.0, 2 * H.LR)], key


def test_mixed_dtypes_train_as_torch(runs, references):
    """float64 and bf16 parameters beside fp32 ones: a bucket per dtype."""
    n, results = runs
    tol = _tolerance(results, references, "dtypes")
    for key in H.ENGINES:
        for rank, r in enumerate(results):
            got = r["engines"]["dtypes", key]["state"]
            _close(got, references["dtypes"]["state"], tol, f"{key} dtypes rank {rank}")
            assert got["scale"].dtype == torch.float64 and got["shift"].dtype == torch.bfloat16


# ---- refusals, each triggered ------------------------------------------------------------------

@pytest.mark.parametrize("key", H.ENGINES[:4])
def test_params_keyword_is_refused_naming_param_groups(key):
    model = H.gpt()
    with pytest.raises(TypeError, match=r"takes no params=; name parameter groups with "
                                        r"param_groups=\[\{'params': decay"):
        H.engines.make_engine(key, model, torch.optim.AdamW, params=model.parameters())


@pytest.mark.parametrize("groups, message", [
    ({"params": []}, "param_groups must be a non-empty list of dicts"),
    ([], "param_groups must be a non-empty list of dicts"),
    ([{"lr": 1.0}], "param_groups must be a non-empty list of dicts, each with its 'params'"),
    ("outsider", r"param_groups\[0\] holds a tensor of shape \(3,\) that is not a parameter"),
    ("twice", r"parameter wte.weight is in param_groups\[0\] and param_groups\[1\]"),
    ("missing", "parameter ln_f.bias is in no group of param_groups: put every trainable"),
])
def test_bad_param_groups_are_refused_by_name(groups, message):
    model = H.gpt()
    params = list(model.parameters())
    groups = {"outsider": [{"params": [torch.nn.Parameter(torch.ones(3))] + params}],
              "twice": [{"params": params}, {"params": [model.wte.weight]}],
              "missing": [{"params": [p for p in params if p is not model.ln_f.bias]}],
              }.get(groups, groups) if isinstance(groups, str) else groups
    with pytest.raises((TypeError, ValueError), match=message):
        zerolab.ZeRO2(model, torch.optim.AdamW, param_groups=groups)
