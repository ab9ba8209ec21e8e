"""The DDP lesson of notebook 01 (zerolab.lessons.n01_ddp), checked against its formulas.

Hook order and flat gradient views run here, in this process; the rest shares one launch on 2
ranks (tests/workers/lessons.py: n01_ddp_at_2). Timings vary by machine and are not checked;
counts, tags, bytes and bitwise equality are.
"""

from __future__ import annotations

import pytest
import torch
from workers import lessons as L

import zerolab
from zerolab import models, theory
from zerolab.lessons import n01_ddp

PSI = 28_032  # zerolab.models.GPT()
PARAM_TENSORS = 28
N = 2


@pytest.fixture(scope="module")
def at2() -> list[dict]:
    return zerolab.launch(L.n01_ddp_at_2, world_size=N, timeout=240)


def greedy_buckets(numels: list[int], bucket_bytes: int) -> list[int]:
    """The bucket rule written out again: reverse order, close a bucket once it holds
    bucket_bytes (fp32), never split a parameter. Elements per bucket."""
    buckets, size = [[]], 0
    for numel in reversed(numels):
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(numel)
        size += 4 * numel
    return [sum(b) for b in buckets]


# ---- in this process ----------------------------------------------------------------------------

def test_hooks_fire_in_reverse_forward_order_and_the_tied_weight_last():
    model = models.GPT()
    order = n01_ddp.hook_order(model, *model.make_batch(4))
    names = [n for n, _ in model.named_parameters()]
    assert sorted(order) == sorted(names)  # once each, the tied weight too
    modules = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in order))
    forward = list(dict.fromkeys(n.rsplit(".", 1)[0] for n in names))
    assert modules == [m for m in reversed(forward) if m != "wte"] + ["wte"]
    assert all(p._post_accumulate_grad_hooks in (None, {}) for p in model.parameters())


def test_flat_grad_views_are_filled_by_backward_with_the_usual_gradients():
    model, reference = models.GPT(), models.GPT()
    x, y = model.make_batch(4)
    params = list(model.parameters())
    flat = n01_ddp.flat_grad_views(params)
    model.loss(model(x), y).backward()
    reference.loss(reference(x), y).backward()
    assert flat.numel() == PSI
    assert all(p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
               for p in params)
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    torch.testing.assert_close(flat, expected)


# ---- on 2 ranks ---------------------------------------------------------------------------------

def test_bucket_sweep_follows_the_greedy_rule_one_all_reduce_per_bucket(at2):
    model = models.GPT(n01_ddp.SWEEP_CONFIG)
    numels = [p.numel() for p in model.parameters()]
    psi = sum(numels)
    for r in at2:
        lesson = r["ddp"]
        assert lesson.psi == psi and lesson.grad_bytes == 4 * psi
        assert [run.bucket_bytes for run in lesson.sweep] == list(n01_ddp.SWEEP_BUCKETS)
        counts = []
        for run in lesson.sweep:
            assert run.bucket_numels == greedy_buckets(numels, run.bucket_bytes)
            assert run.all_reduces == len(run.bucket_numels)
            # each bucket once, in the order its last gradient arrived (not always bucket order:
            # a LayerNorm's weight gradient comes before its bias's)
            assert sorted(e.tag for e in run.log.events) == sorted(
                f"ddp/bwd/bucket{i}" for i in range(len(run.bucket_numels)))
            padded = sum(-(-k // N) * N for k in run.bucket_numels)
            assert run.log.total_ring_bytes() == 2 * (N - 1) * 4 * padded // N
            counts.append(run.all_reduces)
        assert counts == [len(numels), 4, 1]  # what notebook 01 prints
        assert 4 * max(lesson.sweep[1].bucket_numels) > n01_ddp.SWEEP_BUCKETS[1]  # soft cap


def test_ddp_overlaps_backward_and_after_backward_does_not_with_equal_results(at2):
    for r in at2:
        lesson = r["ddp"]
        assert lesson.params_equal
        for log in lesson.overlapped:
            assert n01_ddp.issued_during_backward(log) == len(log.events) == 4
            assert {e.tag.rsplit("/", 1)[0] for e in log.events} == {"ddp/bwd"}
        for log in lesson.after:
            assert n01_ddp.issued_during_backward(log) == 0
            assert len(log.events) == 4
            assert {e.tag.rsplit("/", 1)[0] for e in log.events} == {"ddp_after_backward/step"}
            # every all-reduce starts inside step(), after backward
            step = next(s for s in log.spans if s.name == "step")
            assert all(step.start <= e.start <= step.end for e in log.events)
    for steps in ([r["ddp"].overlapped for r in at2], [r["ddp"].after for r in at2]):
        assert all(n01_ddp.exposed_seconds(list(logs)) >= 0 for logs in zip(*steps))


def test_memory_split_activations_grow_with_the_batch_model_states_do_not(at2):
    for r in at2:
        split = r["split"]
        assert list(split.peaks) == [4, 8, 16]
        for peak in split.peaks.values():
            assert (peak["params"], peak["grads"]) == (4 * PSI, 4 * PSI)
            assert peak["optimizer"] == 8 * PSI + 4 * PARAM_TENSORS
        acts = [p["activations"] for p in split.peaks.values()]
        assert [round(a / acts[0], 1) for a in acts] == [1.0, 2.0, 4.0]
        # at least what the two blocks keep (theory's count, fp32, fused attention)
        for batch, a in zip(split.peaks, acts):
            assert a >= theory.activation_bytes(16, batch, 32, 2, num_layers=2)
        # what notebook 01 prints: activations outweigh the model states from batch 8
        assert acts[0] < 16 * PSI < acts[1]
        first, last = split.trace.samples[0][1], split.trace.samples[-1][1]
        assert first["optimizer"] == 0 and last["activations"] == 0
        assert split.trace.max_by_category["activations"] > 0
