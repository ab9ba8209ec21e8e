"""Notebook 08's measurements on real ranks (zerolab.lessons.n08_activations): ZeRO-3 with and
without activation checkpointing, against the formulas.

One launch of 2 ranks runs the lesson on a shorter sequence than the notebook
(tests/workers/lessons.py: n08_checkpointing): the memory kept for backward, the recompute
counted, the collectives (counts, ring and wire bytes) with and without checkpointing, prefetch
on and off, the trap sprung by an unguarded engine, and the same weights everywhere.
"""

from __future__ import annotations

import pytest
from workers.lessons import PER_RANK_08 as PER_RANK
from workers.lessons import SEQ_08 as SEQ
from workers.lessons import n08_checkpointing

import zerolab
from zerolab import theory
from zerolab.lessons import n08_activations as lesson
from zerolab.models import GPT, num_params
from zerolab.units import make_units

N = 2
LAYERS = lesson.MODEL.n_layer


@pytest.fixture(scope="module")
def results() -> list[lesson.CheckpointingLesson]:
    return zerolab.launch(n08_checkpointing, world_size=N, timeout=400)


def test_kept_for_backward_is_the_formula(results):
    # A rank's token ids are a view of the global batch: their storage holds every rank's rows
    # and the targets' extra token. And the loss keeps a 4-byte weight total.
    ids = 8 * (N * PER_RANK * (SEQ + 1) - PER_RANK * SEQ)
    for r in results:
        for (attention, mode), run in r.runs.items():
            formula = lesson.model_formula(lesson.config(SEQ, attention, mode), PER_RANK)
            assert run.kept == formula + ids + 4, (attention, mode)


def test_checkpointing_lowers_the_peak(results):
    for r in results:
        peak = {key: run.memory.peak_bytes for key, run in r.runs.items()}
        assert peak["sdpa", "block"] < peak["sdpa", "none"]
        assert peak["explicit", "block"] < peak["explicit", "attention"] < peak["explicit", "none"]
        assert peak["sdpa", "attention"] <= peak["sdpa", "none"]


def test_the_recompute_is_counted(results):
    for r in results:
        for (_, mode), run in r.runs.items():
            assert run.block_calls == (2 if mode == "block" else 1) * LAYERS
            assert run.attention_calls == (1 if mode == "none" else 2) * LAYERS
        flops = {mode: r.runs["explicit", mode].flops for mode in theory.CHECKPOINTS}
        assert flops["none"] < flops["attention"] < flops["block"]


def test_every_variant_trains_the_same_weights(results):
    for r in results:
        assert r.max_diff and set(r.max_diff.values()) == {0.0}, r.max_diff
        for attention in theory.ATTENTIONS:
            losses = {tuple(run.losses) for (a, _), run in r.runs.items() if a == attention}
            assert len(losses) == 1


def test_zero3_gathers_each_unit_once_per_phase_with_checkpointing(results):
    model = GPT(lesson.config(SEQ))
    psi, root = num_params(model), sum(p.numel() for p in make_units(model)[-1].params)
    # The root (embeddings, head) stays gathered from forward to backward: gathered once.
    ring = theory.comm_volume(psi, N, "ZeRO-3", root_numel=root).ring_sent_bytes
    for r in results:
        for g in r.gathers.values():
            assert len(g.gathers) == 2 * LAYERS + 1 and set(g.gathers.values()) == {1}
            assert lesson.gathers_per_phase(g) == {"fwd": LAYERS + 1, "bwd": LAYERS}
            assert g.ring_bytes == ring
        for prefetch in (True, False):
            plain, ckpt = r.gathers[prefetch, "none"], r.gathers[prefetch, "block"]
            assert ckpt.ring_bytes == plain.ring_bytes
            assert ckpt.wire_bytes == plain.wire_bytes  # measured on the wire: no extra bytes
            if plain.wire_bytes is not None:  # Linux: gloo sends more than the ring model
                assert plain.wire_bytes > plain.ring_bytes


def test_the_recompute_shows_inside_backward(results):
    for r in results:
        log = lesson.with_recompute(r.timeline.log)
        names = [s.name for s in log.spans]
        assert names.count("forward") == LAYERS and names.count("recompute") == LAYERS
        [backward] = [s for s in log.spans if s.name == "backward"]
        assert all(backward.start <= s.start <= s.end <= backward.end
                   for s in log.spans if s.name == "recompute")
        window = lesson.with_recompute(r.timeline.log, backward_only=True)
        assert all("/bwd/" in e.tag for e in window.events)
        assert {s.name for s in window.spans} == {"backward", "recompute"}


def test_the_unguarded_engine_springs_the_trap(results):
    for r in results:
        default, whole = r.traps
        assert default.error is None and default.max_diff == 0.0
        twice = sorted(unit for unit, count in default.gathers.items() if count == 2)
        assert twice == [f"fwd/blocks.{i}" for i in range(1, LAYERS)]  # prefetched in backward
        assert whole.error is not None and "storage of size 0" in whole.error
