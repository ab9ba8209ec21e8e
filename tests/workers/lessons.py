"""Workers for the lesson tests (tests/test_lesson_*.py): each runs several lessons' measurement
functions (zerolab.lessons.*) in one launch, since starting ranks costs seconds.

The launches that several lesson files share are session fixtures in tests/conftest.py:
lessons_00_01_at_2, lessons_00_03_at_4 and lessons_04_07_at_2. The arguments given to the
lessons here (smaller models than the notebooks use) are the figures the tests' formulas need,
so they live here beside the workers that pass them.
"""

from __future__ import annotations

from zerolab.comm import CommEvent, CommLog, Span
from zerolab.lessons import (
    n00_launch,
    n01_ddp,
    n01_memory,
    n02_collectives,
    n03_zero1,
    n04_zero2,
    n05_zero3,
    n06_fsdp2,
    n07_scaling,
    n08_activations,
)
from zerolab.models import GPT, GPTConfig, num_params
from zerolab.units import make_units

# ---- lessons 00-03 ------------------------------------------------------------------------------

BYTES_NUMEL = 12 * 1024  # n02's bytes experiment: S = 4 * BYTES_NUMEL bytes


def lessons_00_01_at_2() -> dict:
    return {"first": n00_launch.first_all_reduce(),
            "memory": n01_memory.ddp_memory()}  # the notebook's arguments


def lessons_00_03_at_4() -> dict:
    return {"first": n00_launch.first_all_reduce(),
            "groups": n00_launch.process_groups(),
            "tour": n02_collectives.collectives_tour(bytes_numel=BYTES_NUMEL,
                                                     timeline_numel=12 * 64),
            "zero1": n03_zero1.zero1_lesson()}


def n01_ddp_at_2() -> dict:
    return {"ddp": n01_ddp.ddp_lesson(steps=1, per_rank=1),
            "split": n01_ddp.ddp_memory_split()}


# ---- lessons 04-07: every lesson at N = 2, in one launch ----------------------------------------

WORLD_04_07 = 2
GPT04 = GPTConfig(n_layer=2, n_embd=32, n_head=2)  # 3 buckets of 20 kB
BUCKET_BYTES = 20_000
GPT05 = GPTConfig(n_layer=8, n_embd=32, n_head=2)  # 8 blocks: shards + 2 blocks < the model
GPT06 = GPTConfig(n_layer=2, n_embd=32, n_head=2)
STEPS06 = 4  # two warm-up steps, one timed, the last measured


def lessons_04_07_at_2() -> dict:
    return {"n04": n04_zero2.zero2_lesson(bucket_bytes=BUCKET_BYTES, config=GPT04),
            "n05": n05_zero3.zero3_lesson(config=GPT05),
            "n06": n06_fsdp2.side_by_side(config=GPT06, steps=STEPS06),
            "n07": n07_scaling.scaling_runs((1, 2))}


def psi(config: GPTConfig) -> int:
    return num_params(GPT(config))


def root_numel(config: GPTConfig, stage: str = "ZeRO-3") -> int:
    """ZeRO-3's root unit (embeddings, final LayerNorm): kept gathered from forward to
    backward, it is not gathered again (theory.comm_volume's root_numel); 0 for other stages."""
    return sum(p.numel() for p in make_units(GPT(config))[-1].params) if stage == "ZeRO-3" else 0


def hand_made_log(events: list[tuple[str, str, float, float, bool]],
                  spans: list[tuple[str, float, float]]) -> CommLog:
    """A log written by hand (no ranks), for the lessons' helpers that read one: events as
    (op, tag, start, end, async_op), spans as (name, start, end)."""
    return CommLog(rank=0, world_size=2,
                   events=[CommEvent(op, tag, 8, 4, a, b, async_op) for op, tag, a, b, async_op
                           in events],
                   spans=[Span(name, a, b) for name, a, b in spans])


# ---- lesson 08 ----------------------------------------------------------------------------------

SEQ_08, PER_RANK_08 = 64, 2  # a shorter sequence than the notebook's


def n08_checkpointing() -> n08_activations.CheckpointingLesson:
    return n08_activations.checkpointing_lesson(seq_len=SEQ_08, per_rank=PER_RANK_08)
