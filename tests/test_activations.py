"""Activations, measured against their formulas: what autograd saves, block by block.

In this process (activations are each rank's own; no ranks needed): zerolab.memory's saved-tensor
hooks and "activations" category, zerolab.activations' per-block attribution, theory's
formulas for both attentions and every checkpointing, the calculator's figure on the course
GPT, and the solutions of notebook 08's exercises.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from zerolab import activations, theory
from zerolab.grading.check import load_module
from zerolab.grading.defaults import SOLUTIONS_DIR
from zerolab.lessons import n08_activations as lesson
from zerolab.memory import SavedForBackward, module_state, track_memory
from zerolab.models import GPT, GPTConfig
from zerolab.plots import calculator as widgets

SMALL = GPTConfig(n_layer=3, n_embd=32, n_head=4, vocab_size=40)
COURSE = theory.ModelShape(hidden=64, num_layers=4, num_heads=4, vocab_size=64)


def small(seq_len: int, attention: str = "sdpa", checkpoint: str = "none") -> GPTConfig:
    return lesson.config(seq_len, attention, checkpoint, base=SMALL)


@pytest.fixture(scope="module")
def solutions():
    return load_module(SOLUTIONS_DIR / "ex08_activations.py")


# ---- the hooks ----------------------------------------------------------------------------------


def test_saved_for_backward_holds_what_autograd_holds():
    layer = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    seen = []
    with SavedForBackward(on_save=seen.append) as saved:
        y = torch.tanh(layer(x)).sum()
    # addmm saves its input and the weight; tanh saves its output
    assert {tuple(t.shape) for t in saved.tensors()} == {(5, 4), (4, 3), (5, 3)}
    assert len(seen) == len(saved.tensors())
    y.backward()  # each node frees what it saved as it runs
    assert saved.tensors() == []
    assert x.grad is not None and x.grad.shape == (5, 4)


def test_the_tracker_counts_activations_only_when_asked():
    model = GPT(small(16))
    x, y = model.make_batch(2)
    with track_memory(lambda: module_state(model, None)) as plain:
        model.loss(model(x), y).backward()
    assert set(plain.samples[-1][1]) == {"params", "grads", "optimizer", "other"}
    model.zero_grad(set_to_none=True)
    with track_memory(lambda: module_state(model, None), activations=True) as trace:
        model.loss(model(x), y).backward()
    assert set(trace.samples[-1][1]) == {"params", "grads", "optimizer", "activations", "other"}
    measured = activations.measure(GPT(small(16)), x, y).total
    assert trace.max_by_category["activations"] == measured  # the end of forward
    assert trace.samples[-1][1]["activations"] == 0  # backward freed it all
    # Parameters that ops saved (every Linear's weight) stay "params".
    assert trace.max_by_category["params"] == 4 * sum(p.numel() for p in model.parameters())


# ---- per block, against the formula -------------------------------------------------------------


@pytest.mark.parametrize("checkpoint", theory.CHECKPOINTS)
@pytest.mark.parametrize("attention", theory.ATTENTIONS)
@pytest.mark.parametrize(("batch", "seq_len"), [(1, 8), (2, 16), (3, 24)])
def test_each_block_saves_its_formula(attention, checkpoint, batch, seq_len):
    cfg = small(seq_len, attention, checkpoint)
    saved = lesson.saved_one_step(cfg, batch)
    blocks = saved.blocks()
    assert len(blocks) == cfg.n_layer
    assert set(blocks) == {lesson.block_formula(cfg, batch)}
    # The rest of the model: the formula counts this batch's token ids; the batch's storage
    # also holds the targets' extra token, and the loss keeps a 4-byte weight total. With one
    # sequence, the flattened targets are a view of that storage, not a copy.
    rest = saved.total - sum(blocks)
    head = theory.head_activation_bytes(seq_len, batch, cfg.n_embd, cfg.vocab_size)
    targets_copy = 8 * seq_len * batch if batch > 1 else 0
    assert rest == head - 8 * seq_len * batch + targets_copy + 8 * batch + 4


def test_the_storages_and_who_saved_them():
    saved = lesson.saved_one_step(small(16), 2, name_savers=True)
    block = saved.of("blocks.0")
    savers = [name for st in block for name in st.savers]
    assert sum(name == "NativeLayerNormBackward0.input" for name in savers) == 2
    assert "GeluBackward0.self" in savers
    [qkv] = [st for st in block if any(name.endswith(".query") for name in st.savers)]
    assert {name.rsplit(".", 1)[1] for name in qkv.savers} == {"query", "key", "value"}
    assert qkv.nbytes == 3 * 4 * 2 * 16 * 32  # q, k, v: one storage, 3h per token
    assert [st.owner for st in saved.storages[:2]] == ["embeddings"] * 2  # ids, positions
    assert {st.owner for st in saved.storages} == {"embeddings", "blocks.0", "blocks.1",
                                                   "blocks.2", "head"}


def test_checkpointed_blocks_keep_their_input():
    cfg = small(32)
    full = lesson.block_formula(cfg, 2)
    one_input = lesson.block_formula(cfg, 2, checkpoint="block")
    assert one_input == 4 * 2 * 32 * cfg.n_embd
    head = theory.head_activation_bytes(32, 2, cfg.n_embd, cfg.vocab_size) + 8 * 2 + 4
    for chosen in ([], [0], [1, 2], [0, 1, 2]):
        kept = lesson.kept_with_checkpoints(cfg, 2, chosen)
        assert kept == head + len(chosen) * one_input + (cfg.n_layer - len(chosen)) * full


def test_linear_in_batch_and_in_sequence_with_sdpa_quadratic_with_explicit():
    at = {(p.attention, p.batch, p.seq_len): p.block
          for p in lesson.sweep(batches=(1, 2), seq_lens=(16, 32, 64), base=SMALL)}
    for attention, s in itertools.product(theory.ATTENTIONS, (16, 32, 64)):
        mask = s * s if attention == "explicit" else 0  # one per block, whatever the batch
        assert at[attention, 2, s] - mask == 2 * (at[attention, 1, s] - mask)
    assert at["sdpa", 1, 64] == 2 * at["sdpa", 1, 32] == 4 * at["sdpa", 1, 16]
    # explicit: the second difference is constant (a quadratic), and positive
    d1 = at["explicit", 1, 32] - at["explicit", 1, 16]
    d2 = at["explicit", 1, 64] - at["explicit", 1, 32]
    assert d2 > 2 * d1
    a = SMALL.n_head  # per block, 4·a·s² (probabilities) + s² (mask): the quadratic part
    assert d2 - 2 * d1 == (4 * a + 1) * (64**2 - 32**2 - 2 * (32**2 - 16**2))


# ---- the calculator against the course GPT ------------------------------------------------------


@pytest.mark.parametrize("checkpoint", theory.CHECKPOINTS)
def test_calculator_activations_against_the_measured_course_gpt(checkpoint):
    """The calculator's activations for the course GPT's shape: what is kept at the end of
    forward is the measurement within 0.1% (the token ids' storage); the peak of activations
    and everything else that is not model state is at least the calculator's figure and at
    most 40% above it (the gradients in flight, which the formula leaves out), with SDPA."""
    s, b = 128, 2
    cfg = lesson.config(s, "sdpa", checkpoint)
    model = GPT(cfg)
    x, y = model.make_batch(b)
    params = list(model.parameters())
    with lesson.one_thread(), track_memory(lambda: {"params": params, "grads": [
            p.grad for p in params if p.grad is not None]}, activations=True) as trace:
        model.loss(model(x), y).backward()
    calc = widgets.calculate(1e6, world_size=2, seq_len=s, micro_batch=b, checkpoint=checkpoint,
                             shape=COURSE)
    kept = theory.model_activation_bytes(COURSE, s, b, peak=False, checkpoint=checkpoint)
    assert kept == pytest.approx(trace.max_by_category["activations"], rel=1e-3)
    peak = max(d["activations"] + d["other"] for _, d in trace.samples)
    assert calc.activations.nbytes <= peak <= 1.4 * calc.activations.nbytes


# ---- the exercises' solutions -------------------------------------------------------------------


@pytest.mark.parametrize("attention", theory.ATTENTIONS)
def test_solution_8_1_is_the_measurement(solutions, attention):
    for b, s in ((1, 8), (3, 24)):
        measured = lesson.saved_one_step(small(s, attention), b).blocks()[0]
        assert solutions.bytes_saved(b, s, SMALL.n_embd, SMALL.n_head, attention) == measured
    assert solutions.bytes_saved(2, 16, 32, 2, "sdpa") == 66_304  # the stub's examples
    assert solutions.bytes_saved(2, 16, 32, 2, "explicit") == 70_400


def brute_force(block: list[int], inputs: list[int], head: int, budget: int) -> list[int] | None:
    """8.2 by trying every subset, in the order the contract ranks them."""
    subsets = [list(c) for k in range(len(block) + 1)
               for c in itertools.combinations(range(len(block)), k)]
    kept = {tuple(c): head + sum(inputs[i] if i in c else block[i] for i in range(len(block)))
            for c in subsets}
    fits = [c for c in subsets if kept[tuple(c)] <= budget]
    return min(fits, key=lambda c: (len(c), kept[tuple(c)], c)) if fits else None


def test_solution_8_2_is_the_best_choice(solutions):
    rng = random.Random(8)
    for _ in range(300):
        n = rng.randint(0, 6)
        block = [rng.choice((10, 20, 30, 50)) for _ in range(n)]
        inputs = [rng.randint(0, b) for b in block]
        head = rng.randint(0, 20)
        budget = rng.randint(head, head + sum(block) + 5)
        assert solutions.blocks_to_checkpoint(block, inputs, head, budget) == brute_force(
            block, inputs, head, budget), (block, inputs, head, budget)
    assert solutions.blocks_to_checkpoint([100, 300, 200], [10, 10, 10], 50, 400) == [1]
