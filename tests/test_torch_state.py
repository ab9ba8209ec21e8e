"""What torch's DDP and FSDP2 take and every engine must too, or refuse by name (workers/
torch_state.py): a parameter unused on some ranks, torch's get_state_dict/set_state_dict, and
ZeRO-3's parameters touched after wrapping. Refusals are triggered in this process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from workers import torch_state as T

import zerolab
from zerolab import engines, models
from zerolab.harness import max_diff

FLOOR = 1e-6  # SGD at 2 ranks: reduction order leaves rounding only (contract.py)


def _check_branch(results: list[dict], world_size: int) -> None:
    refs = {spare: T.branch_reference(world_size, spare) for spare in (False, True)}
    for rank, r in enumerate(results):
        for key, weights in r.items():
            ref = refs[key.endswith("spare")]
            assert max_diff(weights, ref) < FLOOR, (key, rank, max_diff(weights, ref))


def test_a_branch_taken_on_one_rank_counts_missing_gradients_as_zeros():
    """Each micro-step one rank of two takes a branch (a Linear inside each ZeRO-3 unit, one in
    the root), the other leaves its parameters without gradient: DDP, ZeRO-2 and ZeRO-3 issue
    their collectives in one order on every rank and land on the single process's result, with
    no_sync() and with two synced backward passes before a step. ZeRO-3 also with a unit no
    rank runs in some steps (its gradient zeros, as FSDP2's: workers/torch_state.py)."""
    _check_branch(zerolab.launch(T.run_branch, 2, timeout=300), 2)


def test_zero3_takes_a_branch_on_some_of_three_ranks():
    """At 3 ranks two take the branch and one does not, then the other way round."""
    _check_branch(zerolab.launch(T.run_branch_zero3, 3, timeout=120), 3)


def test_zero1_refuses_a_branch_left_unreduced_between_two_backward_passes():
    """ZeRO-1 reduce-scatters in place: reducing the rest when the next backward starts trained
    1.6e-2 off one process, so it refuses there, naming what works."""
    with pytest.raises(zerolab.LaunchError) as raised:
        zerolab.launch(T.run_branch_zero1, 2, timeout=120)
    said = str(raised.value)
    assert "ZeRO1: the last backward gave no gradient to some parameters on this rank" in said
    assert "engine.no_sync()" in said and "zerolab.ZeRO2" in said


def test_get_and_set_state_dict_resume_ddp_exactly(tmp_path):
    """torchtitan's habit on zerolab.DDP, with the engine or engine.module as the model: saved
    with DCP after 2 steps, loaded into a new engine, 2 more steps: the same weights as the
    run that did not stop (Adam's moments came back)."""
    results = zerolab.launch(T.run_dsd, 2, args=(str(tmp_path),), timeout=300)
    for r in results:
        for form in ("engine", "module"):
            assert max_diff(r[form]["resumed"], r[form]["straight"]) == 0, form
        assert r["module"]["keys"] == ["blocks.0.fc.bias", "blocks.0.fc.weight"]
        assert r["engine"]["keys"] == ["module.blocks.0.fc.bias", "module.blocks.0.fc.weight"]


@pytest.mark.parametrize("key", ["zero1", "zero2", "zero3"])
def test_get_and_set_state_dict_are_refused_by_name_on_sharded_engines(key):
    model = models.GPT()
    engine = engines.make_engine(key, model, torch.optim.AdamW, lr=1e-3)
    name = engines.engine_class(key).__name__
    said = (rf"get_state_dict/set_state_dict\({name}, \.\.\.\): {name}'s optimizer steps flat "
            r"shards.*zerolab\.checkpoint\.save\(engine, folder\).*engine\.rank_state_dict\(\)")
    for form in (engine, model):
        with pytest.raises(RuntimeError, match=said):
            get_state_dict(form, engine.optimizer)
        with pytest.raises(RuntimeError, match=said):
            set_state_dict(form, engine.optimizer, model_state_dict={}, optim_state_dict={})


def _hooked(where: str):
    """A ZeRO-3 engine, then forward hooks on `where` that copy what they see."""
    model = models.GPT()
    full = {k: v.clone() for k, v in model.state_dict().items()}
    engine = zerolab.ZeRO3(model, torch.optim.AdamW, lr=1e-3)
    module = model.get_submodule(where)
    seen = {}

    def look(when: str) -> None:
        seen[when] = module.get_parameter("fc.weight").detach().clone()

    module.register_forward_pre_hook(lambda m, args: look("pre"))
    module.register_forward_hook(lambda m, args, out: look("post"))
    x, y = model.make_batch(2)
    model.loss(engine(x), y).backward()
    return seen, full[f"{where}.fc.weight"]


def test_zero3_forward_hooks_registered_after_wrapping_see_the_full_weights():
    seen, full = _hooked("blocks.1")
    assert torch.equal(seen["pre"], full) and torch.equal(seen["post"], full)


@pytest.mark.parametrize("write", ["normal_", "nn.init.ones_", "data"])
def test_zero3_a_write_to_a_freed_parameter_is_refused_at_the_next_forward(write):
    """Between steps a ZeRO-3 parameter holds nothing: a write after wrapping would be lost."""
    model = models.GPT()
    engine = zerolab.ZeRO3(model, torch.optim.AdamW, lr=1e-3)
    p = model.blocks[1].fc.weight
    with torch.no_grad():
        if write == "normal_":
            p.normal_()
        elif write == "nn.init.ones_":
            torch.nn.init.ones_(p)
        else:
            p.data = torch.randn(128, 32)
    x, y = model.make_batch(2)
    with pytest.raises(RuntimeError, match=r"ZeRO3: a parameter of the wrapped model was written "
                                           r"in place between steps.*Initialise the model before "
                                           r"wrapping it.*engine\.module\.load_state_dict"):
        engine(x)
