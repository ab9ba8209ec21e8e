"""Notebook 09's checkpoint round trips (zerolab.lessons.n09_dcp): ZeRO-3 at 2 ranks -> a plain
model and FSDP2 at 2 ranks; FSDP2 -> ZeRO-2 at 3 ranks; every value arrives exactly; one rank's
file listed as rectangles."""

from __future__ import annotations

import os

import pytest

from zerolab import checkpoint
from zerolab.lessons import n09_dcp
from zerolab.models import GPT


@pytest.fixture(scope="module")
def trips(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("trips"))
    return workdir, n09_dcp.round_trips(workdir)


def test_every_round_trip_is_exact(trips):
    _, done = trips
    assert [t.what.split(" -> ")[-1] for t in done] == [
        "plain GPT", "FSDP2 (2 ranks)", "zerolab ZeRO-2 (3 ranks)"]
    assert all(t.params == 0 and t.optimizer == 0 for t in done)
    table = n09_dcp.trip_table(done)
    assert len(table) == 4 and all(row.split()[-2:] == ["0", "0"] for row in table[1:])


def test_each_rank_file_holds_rectangles_of_half_the_model(trips):
    workdir, _ = trips
    path = checkpoint.latest(os.path.join(workdir, "zero3"))
    params = dict(GPT(n09_dcp.MODEL).named_parameters())
    for rank in (0, 1):
        rows = n09_dcp.chunk_table(path, rank, limit=10_000)
        held = sum(int(row.split()[-2].replace(",", "")) for row in rows
                   if not row.startswith("model.lm_head.weight"))  # the tied wte, again
        assert held == sum(p.numel() for p in params.values()) // 2  # no unit is padded
        assert all(row.split()[0].removeprefix("model.") in {*params, "lm_head.weight"}
                   for row in rows)
    short = n09_dcp.chunk_table(path, 0, limit=3)
    assert len(short) == 4 and short[-1].startswith("... ")
