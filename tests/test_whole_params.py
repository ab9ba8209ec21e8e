"""Matrix optimizers on ZeRO-1/2/3 (zerolab/parts/whole_params.py): each parameter stepped
whole by its owner rank. Adafactor and Muon (with AdamW for Muon's 1-D parameters) against one
process on the same global batch; the extra bytes against the formula; the refusals.

Tolerance: the engines reduce gradients in another order than one process's backward, so
their gradients differ in the last bits. Adafactor amplifies that little; Muon's Newton-Schulz
runs in bfloat16, where a last-bit difference can round a product the other way. The yardstick
is one process that sums the same gradient in another order (micro-batches of one rank's
share each): an engine may be YARDSTICK times as far from the reference as that, plus float32's
FLOOR. Stepping a flat shard instead is orders of magnitude further (checked too).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from workers import whole_params as W

import zerolab
from zerolab import engines, models
from zerolab.harness import max_diff
from zerolab.parts import whole_params
from zerolab.sharding import FlatLayout

YARDSTICK = 4  # times the reference's own distance from a reordered sum
FLOOR = 1e-6  # float32 rounding of weights of order 0.1 over a few steps
HEADERS = 256  # at most, gloo's own bytes per message on top of the payload


@pytest.fixture(scope="module")
def at_two():
    return 2, zerolab.launch(W.everything, 2, timeout=300)


@pytest.fixture(scope="module")
def at_three():
    return 3, zerolab.launch(W.everything, 3, args=(W.AT_THREE,), timeout=300)


@pytest.fixture(scope="module")
def references():
    return {opt: W.reference(opt) for opt in W.OPTIMIZERS}


@functools.cache
def _yardstick(optimizer: str, n: int) -> dict:
    return W.reference(optimizer, n)


def _tolerance(optimizer: str, n: int, references) -> float:
    return YARDSTICK * max_diff(_yardstick(optimizer, n), references[optimizer]) + FLOOR


def _runs(world: str, at_two, at_three) -> tuple[int, list[dict]]:
    return at_two if world == "2" else at_three


CASES = [("2", key, opt) for key in W.ENGINES for opt in W.OPTIMIZERS] + [
    ("3", *case) for case in W.AT_THREE]


@pytest.mark.parametrize("world, key, optimizer", CASES)
def test_matrix_optimizers_give_the_single_process_result(at_two, at_three, references, world,
                                                          key, optimizer):
    n, results = _runs(world, at_two, at_three)
    tolerance = _tolerance(optimizer, n, references)
    for r in results:
        got = max_diff(r[key, optimizer]["state"], references[optimizer])
        assert got <= tolerance, (key, optimizer, n, got, tolerance)


def test_bf16_masters_travel_and_match_ddp(at_two):
    """param_dtype=bf16: the owner needs the fp32 masters' values, which are shards too."""
    _, results = at_two
    assert sum(r["zero2", "adafactor", "bf16"]["sent"]["value"] for r in results) > 0
    for r in results:
        assert max_diff(r["zero2", "adafactor", "bf16"]["state"],
                        r["ddp", "adafactor", "bf16"]["state"]) <= FLOOR


@pytest.mark.parametrize("world, case", [("2", ("zero1", "adafactor")), ("2", ("zero2", "muon")),
                                         ("2", ("zero3", "adafactor")),
                                         ("2", ("zero2", "adafactor", "bf16")),
                                         *(("3", case) for case in W.AT_THREE)])
def test_extra_bytes_are_the_formula(at_two, at_three, world, case):
    """Every rank's whole.* collectives together, by the ring model (what each rank sends)
    and on the sockets, against extra_bytes(): Σ_p outside(p) per transfer."""
    n, results = _runs(world, at_two, at_three)
    formula = results[0][case]["formula"]
    assert formula > 0
    sent = sum(sum(r[case]["sent"].values()) for r in results)
    assert sent == formula
    travel = sum(r[case]["sent"]["value"] for r in results)
    assert (travel > 0) == (case[0] == "zero3" or "bf16" in case)
    wire = [w for r in results for w in r[case]["wire"]]
    if None not in wire:  # gloo on Linux: what the ranks wrote, headers on top
        calls = sum(r[case]["calls"] for r in results)
        assert formula <= sum(wire) <= formula + calls * (n - 1) * HEADERS


@pytest.mark.parametrize("world", ["2", "3"])
def test_every_parameter_has_one_owner(at_two, at_three, world):
    _, results = _runs(world, at_two, at_three)
    for case in results[0]:
        if "owned" in results[0][case]:
            assert sum(r[case]["owned"] for r in results) == results[0][case]["n_params"]


def test_formula_counts_only_what_leaves_the_owner():
    """A parameter inside one shard moves nothing; one cut in half moves its half, twice."""
    inside = FlatLayout.of([torch.empty(3), torch.empty(5)], 2)  # shards of 4: [3|1 of 5, 4]
    assert whole_params.owners(inside) == [0, 1]
    assert whole_params.outside_numel(inside) == 1
    half = FlatLayout.of([torch.empty(4, 2)], 2)
    assert whole_params.outside_numel(half) == 4
    assert whole_params.extra_bytes([half], 4, 4, values_travel=False) == 2 * 4 * 4
    assert whole_params.extra_bytes([half], 2, 4, values_travel=True) == 4 * (2 + 8)


def test_flat_shards_would_be_far_off():
    """What the refusal used to guard against: Adafactor on flat shards is not a rounding
    error away (the lesson measures it on ranks; here one matrix, two shards, one process)."""
    torch.manual_seed(0)
    w, g = torch.randn(7, 6), torch.randn(7, 6)
    whole = torch.nn.Parameter(w.clone())
    whole.grad = g
    torch.optim.Adafactor([whole], lr=1e-2).step()
    pieces = [torch.nn.Parameter(p.clone()) for p in w.reshape(-1).chunk(2)]
    for p, gp in zip(pieces, g.reshape(-1).chunk(2)):
        p.grad = gp.clone()
        torch.optim.Adafactor([p], lr=1e-2).step()
    flat = torch.cat([p.detach() for p in pieces]).view(7, 6)
    assert (flat - whole.detach()).abs().max() > 1e3 * FLOOR


# ---- refusals ----------------------------------------------------------------------------------


def _gpt() -> models.GPT:
    return models.GPT(W.CONFIG)


def test_muon_with_1d_parameters_says_how_to_pass_them():
    with pytest.raises(ValueError, match=r"torch.optim.Muon orthogonalises 2-D matrices only, "
                                         r"and \d+ trainable parameter\(s\) are not 2-D .*"
                                         r"'optimizer': torch.optim.AdamW"):
        zerolab.ZeRO2(_gpt(), torch.optim.Muon, lr=0.02)


def test_a_group_optimizer_must_be_an_optimizer_class():
    model = _gpt()
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['optimizer'\] must be a "
                                        r"torch.optim.Optimizer subclass"):
        zerolab.ZeRO3(model, torch.optim.Adafactor, param_groups=[
            {"params": [p for p in model.parameters() if p.dim() == 2]},
            {"params": [p for p in model.parameters() if p.dim() != 2], "optimizer": "adamw"}])


@pytest.mark.parametrize("key, optimizer_cls", [("ddp", torch.optim.Muon),
                                                ("zero2", torch.optim.AdamW)])
def test_a_group_optimizer_elsewhere_is_refused(key, optimizer_cls):
    model = _gpt()
    name = engines.engine_class(key).__name__
    with pytest.raises(TypeError, match=fr"{name}: param_groups\[1\] names its own "
                                        r"'optimizer'; only ZeRO-1/2/3 with a matrix optimizer"):
        engines.make_engine(key, model, optimizer_cls, lr=1e-3, param_groups=[
            {"params": [p for p in model.parameters() if p.dim() == 2]},
            {"params": [p for p in model.parameters() if p.dim() != 2],
             "optimizer": torch.optim.AdamW}])


REFUSED = r"{} steps flat 1-D shards that cut parameters apart.*{} is not one of them.*" \
    r"zerolab.ZeRO1, ZeRO2 or ZeRO3"


def test_engines_without_whole_steps_refuse_matrix_optimizers(at_two):
    """ZeroPP here; HSDP, which needs ranks, on them (workers/whole_params.py)."""
    for optimizer_cls in (torch.optim.Adafactor, torch.optim.Muon):
        with pytest.raises(TypeError, match=REFUSED.format("ZeroPP", optimizer_cls.__name__)):
            zerolab.ZeroPP(_gpt(), optimizer_cls, lr=1e-3)
    for r in at_two[1]:
        message = r["hsdp", "refused"]["message"]
        assert re.search(REFUSED.format("HSDP", "Adafactor"), message), message


def _one_backward(engine, model) -> None:
    x, y = model.make_batch(2)
    model.loss(engine(x), y).backward()


def test_a_users_matrix_optimizer_over_the_shards_is_refused():
    """engine.parameters() are flat 1-D shards: Adafactor over them is refused at its first
    step, by name; torch's Muon refuses them itself when it is built."""
    model = _gpt()
    engine = zerolab.ZeRO2(model, torch.optim.AdamW, lr=1e-3)
    mine = torch.optim.Adafactor(engine.parameters(), lr=1e-2)
    _one_backward(engine, model)
    with pytest.raises(TypeError, match=r"Adafactor over ZeRO2's engine.parameters\(\) steps "
                                        r"this rank's flat 1-D shards.*zerolab.ZeRO2\(model, "
                                        r"torch.optim.Adafactor"):
        mine.step()
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        torch.optim.Muon(engine.parameters(), lr=1e-2)


def test_checkpoints_of_whole_step_state_are_refused():
    model = _gpt()
    engine = zerolab.ZeRO1(model, torch.optim.Adafactor, lr=1e-2)
    _one_backward(engine, model)
    engine.step()
    with pytest.raises(NotImplementedError, match="ZeRO1 with Adafactor: each parameter is "
                                                  "stepped whole by one rank"):
        engine.rank_state_dict()


def test_one_rank_steps_as_torch_does(references):
    """World size 1: the owner is the only rank; every engine steps as torch (bit for bit)."""
    for opt in W.OPTIMIZERS:
        model = models.GPT(W.CONFIG)
        cls, groups, kwargs = W.groups(model, opt, engine=True)
        engine = zerolab.ZeRO3(model, cls, param_groups=groups, **kwargs)
        for step in range(W.STEPS):
            x, y = model.make_batch(W.GLOBAL_BATCH, seed=100 + step)
            model.loss(engine(x), y).backward()
            engine.optimizer.step()
            engine.optimizer.zero_grad()
        assert max_diff(engine.full_state_dict(), references[opt]) == 0.0
