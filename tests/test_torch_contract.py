"""The engine a torch user meets (zerolab/shell.py): whatever torch's DDP or FSDP2 accepts gives
torch's result here, or a loud error at the first wrong call naming the right one.

One launch at 2 ranks runs nanoGPT's train.py loop, ported by replacing `DDP(model)`, on every
engine and on torch's DDP (workers/nanogpt_loop.py), straight and resumed from rank 0's
checkpoint; a second runs the habits of workers/contract.py. Each result is held to one
process on the whole batch, with torch's DDP's distance from it as the yardstick (Adam turns
reduction-order rounding into ~1e-5, test_habits.py). Refusals are triggered in this process.
"""

from __future__ import annotations

import pytest
import torch
from workers import contract as C
from workers import nanogpt_loop as L

import zerolab
from zerolab import engines, models
from zerolab.harness import max_diff

FLOOR = 1e-6


@pytest.fixture(scope="module")
def nanogpt():
    return L.reference(), zerolab.launch(L.run_all, 2, timeout=600)


def test_nanogpt_loop_trains_as_torch_ddp_on_every_engine(nanogpt):
    """Parameter groups, LR set by hand, require_backward_grad_sync, GradScaler (disabled),
    unscale_, clip_grad_norm_(model.parameters()), eval under no_grad: every engine lands where
    torch's DDP lands, straight through."""
    ref, results = nanogpt
    for rank, r in enumerate(results):
        yardstick = max(max_diff(r["torch_ddp"]["state"], ref["state"]), FLOOR)
        for key in L.ENGINES:
            got = {k.removeprefix("gpt."): v for k, v in r[key]["state"].items()}
            want = {k.removeprefix("gpt."): v for k, v in ref["state"].items()}
            assert max_diff(got, want) <= 2 * yardstick, (key, rank)
            assert max_diff(r[key]["state"], r["torch_ddp"]["state"]) <= 2 * yardstick, key
            assert r[key]["evals"] == pytest.approx(r["torch_ddp"]["evals"], abs=1e-5), key


def test_require_backward_grad_sync_false_reduces_nothing(nanogpt):
    """nanoGPT's flag is no_sync(): each iteration reduces each bucket once, not per micro-step."""
    _, results = nanogpt
    for key in L.ENGINES:
        got = results[0][key]
        assert got["reductions"] == L.RESUME_AT * got["buckets"], key


def test_nanogpt_resumes_from_rank0_checkpoint_or_refuses_by_name(nanogpt):
    """DDP resumes from rank 0's {"model", "optimizer"} exactly. A sharded engine's optimizer
    holds one rank's state: optimizer.state_dict() refuses, naming the calls that resume;
    engine.rank_state_dict() per rank resumes exactly."""
    ref, results = nanogpt
    for rank, r in enumerate(results):
        yardstick = max(max_diff(r["torch_ddp"]["resumed"], ref["state"]), FLOOR)
        for key in L.ENGINES:
            assert max_diff(r[key]["resumed"], r[key]["state"]) == 0, (key, rank)
            assert max_diff(r[key]["resumed"], r["torch_ddp"]["resumed"]) <= 2 * yardstick
        assert r["ddp"]["refused"] == ""
        for key in ("zero1", "zero2", "zero3"):
            said = r[key]["refused"]
            assert said.startswith(f"{engines.engine_class(key).__name__}.optimizer."
                                   "state_dict(): this rank's optimizer holds the state of its "
                                   "own shards only"), said
            assert "zerolab.checkpoint.save(engine, folder)" in said
            assert "engine.rank_state_dict()" in said


@pytest.fixture(scope="module")
def habits():
    refs = {habit: C.reference(habit) for habit in (*C.HABITS, "adafactor")}
    return refs, zerolab.launch(C.run_all, 2, timeout=600)


@pytest.mark.parametrize("habit", C.HABITS)
def test_torch_habits_give_the_single_process_result(habits, habit):
    """The user's own optimizer over engine.parameters(); an enabled GradScaler with unscale_
    and torch's clip_grad_norm_ over engine.parameters()."""
    refs, results = habits
    for rank, r in enumerate(results):
        for key in C.ENGINES:
            assert max_diff(r[habit, key], refs[habit]) < FLOOR, (habit, key, rank)


def test_a_matrix_optimizer_steps_whole_parameters_under_ddp(habits):
    """Adafactor's factored moments need whole matrices: DDP gives it whole parameters even
    where AdamW would be cut in tiles of 64 elements."""
    refs, results = habits
    for r in results:
        assert max_diff(r["adafactor", "ddp"], refs["adafactor"]) < FLOOR


def test_gradients_are_reduced_when_backward_returns(habits):
    """As torch's DDP: nothing in flight once loss.backward() returns, and DDP's .grad (the
    model's own, read without calling the engine) the single process's."""
    _, results = habits
    want = C.reference_grads()
    for r in results:
        for key in C.ENGINES:
            got = r["backward returns"][key]
            assert got["waited"] and all(got["waited"]), key
        assert max_diff(r["backward returns"]["ddp"]["grads"], want) < FLOOR


def test_grad_scaler_skips_together_or_refuses_under_zero(habits):
    """An inf in every rank's shard: every rank skips the step and halves its scale, as
    GradScaler does. An inf in one rank's shard only: the ranks' scales would part, refused."""
    _, results = habits
    for r in results:
        everywhere, one = r["inf"]["everywhere"], r["inf"]["one element"]
        assert everywhere["said"] == "" and everywhere["unchanged"]
        assert everywhere["scale"] == 2.0 ** 9
        assert one["said"].startswith("ZeRO2 with GradScaler: 1 of 2 ranks found inf or NaN "
                                      "in their gradient shards"), one["said"]
        assert "param_dtype=torch.bfloat16" in one["said"] and one["unchanged"]


def test_an_optimizer_over_the_sharded_models_own_parameters_is_refused(habits):
    _, results = habits
    for r in results:
        assert r["refused"]["ddp"] == ""  # torch's DDP habit: .grad holds the average
        for key in ("zero1", "zero2", "zero3"):
            said = r["refused"][key]
            assert said.startswith("a torch optimizer is stepping the parameters of a model "
                                   f"wrapped by {engines.engine_class(key).__name__}"), said
            assert "torch.optim.AdamW(engine.parameters(), ...)" in said


def test_engine_parameters_are_this_ranks_shards_under_zero(habits):
    """FSDP2's view: global sizes (the flat buckets, padded), this rank's part held."""
    _, results = habits
    psi = sum(p.numel() for p in models.GPT().parameters())
    assert results[0]["numel"]["ddp"] == (psi, psi)
    for key in ("zero1", "zero2", "zero3"):
        total, local = results[0]["numel"][key]
        assert psi <= total < psi + 2 * 64 and local == total // 2, key


# ---- in this process: one rank, no process group ------------------------------------------------

def test_an_engine_is_a_module_as_torch_ddp_is():
    model = models.GPT()
    engine = zerolab.ZeRO2(model, torch.optim.AdamW, lr=1e-3)
    assert isinstance(engine, torch.nn.Module) and engine.module is model
    engine.eval()
    assert not model.training and all(not m.training for m in model.modules())
    engine.train()
    assert model.training
    sd = engine.state_dict()
    assert set(sd) == {f"module.{k}" for k in model.state_dict()}
    engine.load_state_dict(sd)  # torch DDP's form back in


@pytest.mark.parametrize("key", C.ENGINES)
def test_conversions_after_wrapping_are_refused(key):
    model = models.GPT()
    engine = engines.make_engine(key, model, torch.optim.AdamW, lr=1e-3)
    for convert in (lambda: model.double(), lambda: engine.to(torch.float64),
                    lambda: model.half()):
        with pytest.raises(TypeError, match=r"the model was converted to torch\.float\d+ on cpu "
                                            r"after wrapping.*Convert the model before wrapping"):
            convert()
    engine.float()  # nothing changes: passes
    model.to("cpu")


@pytest.mark.parametrize("key", C.ENGINES)
def test_optimizers_that_cannot_run_are_refused_by_name(key):
    name = engines.engine_class(key).__name__
    with pytest.raises(TypeError, match=f"{name} cannot run LBFGS: it calls a closure"):
        engines.make_engine(key, models.GPT(), torch.optim.LBFGS, lr=1)
    # Adafactor and Muon run on every stage (tests/test_whole_params.py); HSDP and ZeroPP
    # refuse them by name (there too).


def test_a_closure_to_the_engines_optimizer_is_refused():
    model = models.GPT()
    engine = zerolab.DDP(model, torch.optim.AdamW, lr=1e-3)
    x, y = model.make_batch(2)
    model.loss(engine(x), y).backward()
    with pytest.raises(TypeError, match=r"DDP.optimizer.step\(closure\): .*LBFGS"):
        engine.optimizer.step(lambda: 0.0)


def test_some_shard_gradients_set_to_none_is_refused():
    """A user's zero_grad over engine.parameters() sets every .grad to None (that zeroes the
    engine's gradients); setting some only has no meaning under ZeRO: refused at backward."""
    model = models.GPT()
    engine = zerolab.ZeRO2(model, torch.optim.AdamW, lr=1e-3, bucket_bytes=1 << 14)
    shards = list(engine.parameters())
    assert len(shards) > 1
    x, y = model.make_batch(2)
    model.loss(engine(x), y).backward()
    shards[0].grad = None
    with pytest.raises(RuntimeError, match=r"ZeRO2: some of engine.parameters\(\) have their "
                                           r"\.grad set to None and others not"):
        model.loss(engine(x), y).backward()


def _trained(engine_cls, optimizer_cls, **kwargs):
    model = models.GPT()
    engine = engine_cls(model, optimizer_cls, lr=1e-3, **kwargs)
    x, y = model.make_batch(2)
    model.loss(engine(x), y).backward()
    engine.step()
    return engine


def test_a_checkpoint_loads_only_into_its_optimizer_and_groups():
    """Another optimizer's state, or two parameter groups into one, is refused by name."""
    saved = _trained(zerolab.ZeRO2, torch.optim.AdamW).rank_state_dict()
    with pytest.raises(ValueError, match=r"holds \['exp_avg', 'exp_avg_sq', 'step'\]; this "
                                         r"engine's Adagrad keeps \['step', 'sum'\]"):
        _trained(zerolab.ZeRO2, torch.optim.Adagrad).load_state_dict(saved)
    model = models.GPT()
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2]},
              {"params": [p for p in model.parameters() if p.dim() < 2], "lr": 0.0}]
    two = zerolab.ZeRO2(model, torch.optim.AdamW, lr=1e-3, param_groups=groups)
    with pytest.raises(ValueError, match="the checkpoint's optimizer has 2 parameter groups, "
                                         "this engine's 1"):
        _trained(zerolab.ZeRO2, torch.optim.AdamW).load_state_dict(
            {"model": two.module.state_dict(),
             "optimizer": {"state": {}, "param_groups": [{"lr": 1e-3}, {"lr": 0.0}]}})
    fresh = _trained(zerolab.ZeRO2, torch.optim.AdamW)
    fresh.load_state_dict(saved)  # the same optimizer and groups: loads
