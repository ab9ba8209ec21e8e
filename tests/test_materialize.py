"""Models born sharded (zerolab/parts/materialize.py): an engine accepts a model built on the meta
device and builds it.

ZeRO-3 materialises one unit at a time (initialise the unit in full, keep this rank's shard,
free the rest), so a rank never holds the whole model; DDP and ZeRO-1/2, which hold every
parameter anyway, build it at once. The course GPT initialises each parameter from a generator
seeded by its name, so the same model comes out however it was built.
"""

from __future__ import annotations

import pytest
import torch
from workers import materialize as W

import zerolab
from zerolab.harness import max_diff

ENGINES_TESTED = ["ddp", "zero2", "zero3"]


def test_the_gpt_is_the_same_built_in_full_or_on_meta():
    full = W.build(meta=False)
    meta = W.build(meta=True)
    for name, p in meta.named_parameters():
        t = torch.empty(p.shape)
        meta.init_tensor(name, t)
        assert torch.equal(t, dict(full.named_parameters())[name]), name


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"N{n}")
def runs(request):
    return request.param, zerolab.launch(W.compare, request.param, args=(ENGINES_TESTED,),
                                         timeout=300)


def test_meta_built_engines_train_exactly_like_full_built_ones(runs):
    n, results = runs
    for res in results:
        for engine_key in ENGINES_TESTED:
            assert max_diff(res[engine_key]["meta"], res[engine_key]["full"]) == 0, (engine_key, n)


def test_zero3_never_holds_the_whole_model_while_building_it(runs):
    n, results = runs
    for res in results:
        meta, full = res["zero3"]["peak_meta"], res["zero3"]["peak_full"]
        kept = sum(meta["held"].values())  # parameter and gradient shards (no Adam state yet)
        # What it keeps, plus the one unit being built: never the whole model at once.
        assert meta["peak"] <= kept + meta["largest_unit_bytes"], n
        # Built in full first, the whole model is there while the engine copies a unit out.
        assert full["peak"] >= full["full_model_bytes"] + full["largest_unit_bytes"], n
        if n > 1:
            assert meta["peak"] < full["peak"], n


def test_mixed_precision_on_meta_is_refused_with_the_reason():
    model = W.build(meta=True)
    with pytest.raises(ValueError, match="meta device is not supported"):
        zerolab.ZeRO3(model, torch.optim.AdamW, param_dtype=torch.bfloat16)


def test_a_meta_model_without_an_initialiser_is_refused_with_the_fix():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="init_tensor"):
        zerolab.ZeRO3(model, torch.optim.AdamW)
