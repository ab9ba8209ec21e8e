"""The schematic figures (zerolab.plots.schematics, zerolab.plots.holdings): each drawn from
data recorded on real ranks (zerolab.lessons.schematics), and each checked here to say what
the data says: arrows against the recorded sends and receives, cells against each rank's
shards, markers and bars against the recorded times, groups against torch's groups.

One launch of 4 ranks gathers every figure's data (tests/workers/schematics.py).
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402
from workers.schematics import every_schematic  # noqa: E402

import zerolab  # noqa: E402
from zerolab import plots  # noqa: E402
from zerolab.lessons import schematics  # noqa: E402
from zerolab.plots import holdings as holdings_plot  # noqa: E402

N = 4


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return zerolab.launch(every_schematic, world_size=N, timeout=240)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def gids(fig, kind=object) -> dict[str, object]:
    return {a.get_gid(): a for ax in fig.axes for a in ax.get_children()
            if isinstance(a, kind) and a.get_gid()}


def shard(bucket, rank: int) -> tuple[int, int]:
    """Rank's part of a bucket's model elements, by the flat layout's arithmetic."""
    size = bucket.padded_numel // N
    return (bucket.start + min(rank * size, bucket.numel),
            bucket.start + min((rank + 1) * size, bucket.numel))


# ---- 1. the ring all-reduce ---------------------------------------------------------------------


def test_ring_sums_fill_up_then_spread(ranks):
    story = schematics.ring_story([r["ring"] for r in ranks])
    everyone = tuple(range(N))
    assert story.phases == ["reduce-scatter"] * (N - 1) + ["all-gather"] * (N - 1)
    assert all(story.sums[0][r][c] == (r,) for r in range(N) for c in range(N))
    for r in range(N):  # after the reduce-scatter, rank r holds chunk r summed over all
        assert story.sums[N - 1][r][r] == everyone
        assert all(len(story.sums[N - 1][r][c]) < N for c in range(N) if c != r)
    assert all(chunk == everyone for rank in story.sums[-1] for chunk in rank)
    for t in story.transfers:  # what arrives is what the sender held, added to what was there
        before, after = story.sums[t.step - 1], story.sums[t.step]
        if t.phase == "reduce-scatter":
            assert set(after[t.dst][t.chunk]) == (set(before[t.src][t.chunk])
                                                  | set(before[t.dst][t.chunk]))
        else:
            assert after[t.dst][t.chunk] == before[t.src][t.chunk] == everyone


def test_ring_arrows_are_the_recorded_sends(ranks):
    runs = [r["ring"] for r in ranks]
    story = schematics.ring_story(runs)
    fig = plots.ring_all_reduce(story)
    arrows = {g: a for g, a in gids(fig, FancyArrowPatch).items() if not g.endswith("|in")}
    sent = {(r.rank, e.tag) for r in runs for e in r.log.events if e.op == "send"}
    received = {(r.rank, e.tag) for r in runs for e in r.log.events if e.op == "recv"}
    assert len(sent) == len(received) == 2 * (N - 1) * N  # each rank: one chunk per step
    drawn = set()
    for gid in arrows:
        step, chunk, pair = gid.split("|")
        src, dst = map(int, pair.split("->"))
        phase = "rs" if int(step.removeprefix("step")) < N else "ag"
        tag = f"ring/{phase}/{step}/{chunk}"
        assert (src, tag) in sent and (dst, tag) in received, gid
        assert dst == (src + 1) % N  # a ring: always to the next rank
        drawn.add((src, tag))
    assert drawn == sent
    # An arrow leaves its sender's group of chunks and lands in the receiver's.
    group = N + 1.4
    for gid, arrow in arrows.items():
        src, dst = map(int, gid.split("|")[2].split("->"))
        (x0, _), (x1, _) = arrow._posA_posB
        assert math.floor(x0 / group) == src
        if dst > src:
            assert math.floor(x1 / group) == dst
        else:
            (x1, _) = gids(fig, FancyArrowPatch)[gid + "|in"]._posA_posB[1]
            assert math.floor(x1 / group) == dst


def test_ring_stripes_show_each_chunks_sum(ranks):
    story = schematics.ring_story([r["ring"] for r in ranks])
    fig = plots.ring_all_reduce(story)
    stripes = {g for g in gids(fig, Rectangle) if g.startswith("step")}
    expected = {f"step{s}|rank{r}|chunk{c}|from{k}" for s, step in enumerate(story.sums)
                for r, chunks in enumerate(step) for c, ks in enumerate(chunks) for k in ks}
    assert stripes == expected
    assert "reduce-scatter" in fig.axes[0].get_title()


def test_contributors_refuse_what_is_not_a_sum_of_distinct_inputs():
    assert schematics.contributors(13.0) == (0, 2, 3)
    with pytest.raises(ValueError, match="powers of two"):
        schematics.contributors(2.5)


# ---- 2. who holds what --------------------------------------------------------------------------


def cells(fig) -> dict[str, dict[tuple[int, str], list[tuple[float, float, str, str]]]]:
    """Panel title -> (rank, category) -> [(left, right, status, the gid's extent)]: where
    each rectangle sits in its cell, as a fraction of the cell."""
    out: dict[str, dict] = {}
    for ax in fig.axes:
        for p in ax.patches:
            if not p.get_gid():
                continue
            panel, rank, category, status, extent = p.get_gid().split("|")
            column = list(holdings_plot.COLUMNS).index(category)
            x0 = column * (1 + holdings_plot.GAP)
            out.setdefault(panel, {}).setdefault((int(rank.split()[1]), category), []).append(
                (p.get_x() - x0, p.get_x() - x0 + p.get_width(), status, extent))
    return out


def held(fig, total: int) -> dict[str, dict[tuple[int, str], list[tuple[int, int, str]]]]:
    """Panel title -> (rank, category) -> [(start, end, status)] in elements, read back from
    the rectangles' geometry (and checked against their gids)."""
    out = {}
    for panel, by_cell in cells(fig).items():
        number, _, label = panel.partition(". ")
        panel = label if number.isdigit() else panel  # "3. after ..." -> "after ..."
        out[panel] = {}
        for key, segs in by_cell.items():
            rows = []
            for a, b, status, extent in segs:
                start, end = round(a * total), round(b * total)
                assert extent == f"{start}-{end}"  # the gid agrees with the geometry
                rows.append((start, end, status))
            out[panel][key] = sorted(rows)
    return out


def stage(ranks, name: str) -> list:
    return [r["holdings"][name] for r in ranks]


def total_of(h) -> int:
    return sum(b.padded_numel for b in h.buckets)


def test_zero2_holds_only_its_gradient_shard_after_the_reduce_scatter(ranks):
    per_rank = stage(ranks, "zero2")
    fig = plots.holdings_over_step(per_rank)
    drawn = held(fig, total_of(per_rank[0]))
    labels = [m.label for m in per_rank[0].moments]
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_visible()]
    assert titles == [f"{i}. {m}" for i, m in enumerate(labels, 1)]  # in the step's order
    after_rs = next(m for m in labels if m.startswith("after reduce_scatter zero2/bwd"))
    before_rs = next(m for m in labels if m.startswith("before reduce_scatter zero2/bwd"))
    (bucket,) = per_rank[0].buckets
    everything = (bucket.start, bucket.start + bucket.numel)
    for r in range(N):
        assert drawn[before_rs][(r, "grads")] == [(*everything, "this rank's own")]
        assert drawn[after_rs][(r, "grads")] == [(*shard(bucket, r), "averaged over the ranks")]
        assert drawn[after_rs][(r, "optimizer")] == [(*shard(bucket, r), "Adam's m and v")]
        assert drawn[after_rs][(r, "params")] == [(*everything, "before the update")]
    # After the optimizer step a rank has updated its own shard only; the all-gather spreads it.
    step, gather = labels.index("after the optimizer step"), labels[-1]
    assert gather.startswith("after all_gather zero2/step")
    for r in range(N):
        mine = shard(bucket, r)
        assert (*mine, "updated") in drawn[labels[step]][(r, "params")]
        assert all(s == "before the update" for a, b, s in drawn[labels[step]][(r, "params")]
                   if (a, b) != mine)
        assert drawn[gather][(r, "params")] == [(*everything, "updated")]


def test_ddp_holds_everything_and_zero1_only_its_optimizer_shard(ranks):
    ddp, zero1 = stage(ranks, "ddp"), stage(ranks, "zero1")
    (bucket,) = ddp[0].buckets
    everything = (0, bucket.numel)
    drawn = held(plots.holdings_over_step(ddp), total_of(ddp[0]))
    after_ar = next(m.label for m in ddp[0].moments if m.label.startswith("after all_reduce"))
    for by_cell in drawn.values():
        for r in range(N):
            assert [(a, b) for a, b, _ in by_cell[(r, "params")]] == [everything]
            assert by_cell[(r, "optimizer")] == [(*everything, "Adam's m and v")]
    assert all(drawn[after_ar][(r, "grads")] == [(*everything, "averaged over the ranks")]
               for r in range(N))
    drawn = held(plots.holdings_over_step(zero1), total_of(zero1[0]))
    after_rs = next(m.label for m in zero1[0].moments if m.label.startswith("after reduce"))
    for r in range(N):
        mine = shard(zero1[0].buckets[0], r)
        assert all(by_cell[(r, "optimizer")] == [(*mine, "Adam's m and v")]
                   for by_cell in drawn.values())
        # ZeRO-1 keeps the full gradient buffer: only its own shard of it is averaged.
        grads = drawn[after_rs][(r, "grads")]
        assert (*mine, "averaged over the ranks") in grads
        assert sum(b - a for a, b, _ in grads) == bucket.numel


def test_zero3_gathers_whole_units_and_keeps_shards_at_rest(ranks):
    per_rank = stage(ranks, "zero3")
    labels = [m.label for m in per_rank[0].moments]
    assert labels == ["at rest", "after all_gather zero3/fwd/root", "after reshard root (fwd)",
                      "after all_gather zero3/bwd/root", "before reduce_scatter zero3/bwd/root",
                      "after reduce_scatter zero3/bwd/root", "after reshard root (bwd)",
                      "after the optimizer step"]
    (bucket,) = per_rank[0].buckets
    drawn = held(plots.holdings_over_step(per_rank), total_of(per_rank[0]))
    for r in range(N):
        mine = shard(bucket, r)
        assert drawn["at rest"][(r, "params")] == [(*mine, "before the update")]
        for gathered in ("after all_gather zero3/fwd/root", "after all_gather zero3/bwd/root"):
            assert drawn[gathered][(r, "params")] == [(0, bucket.numel, "before the update")]
        for freed in ("after reshard root (fwd)", "after reshard root (bwd)"):
            assert drawn[freed][(r, "params")] == [(*mine, "before the update")]
        assert drawn[labels[-1]][(r, "params")] == [(*mine, "updated")]
        assert drawn[labels[-1]][(r, "grads")] == [(*mine, "averaged over the ranks")]


def test_paper_figure_one_sets_the_stages_side_by_side(ranks):
    by_stage = {name: stage(ranks, name) for name in ("ddp", "zero1", "zero2", "zero3")}
    fig = plots.holdings_by_stage(by_stage)
    titles = [ax.get_title(loc="left") for ax in fig.axes if ax.get_visible()]
    assert [t.split(",")[0] for t in titles] == ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    drawn = held(fig, total_of(by_stage["ddp"][0]))
    for title, name in zip(titles, by_stage):
        bucket = by_stage[name][0].buckets[0]
        for r in range(N):
            mine = shard(bucket, r)
            optimizer = [(a, b) for a, b, _ in drawn[title][(r, "optimizer")]]
            assert optimizer == ([(0, bucket.numel)] if name == "ddp" else [mine])
            params = [(a, b) for a, b, _ in drawn[title][(r, "params")]]
            assert params == ([mine] if name == "zero3" else [(0, bucket.numel)])
    same = plots.holdings_by_stage([r["holdings"] for r in ranks])  # as launch returns it
    assert [ax.get_title(loc="left") for ax in same.axes if ax.get_visible()] == titles
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "gradients: averaged over the ranks" in legend and "not held" in legend


def test_holdings_refuse_ranks_of_different_stages(ranks):
    with pytest.raises(ValueError, match="moments differ"):
        plots.holdings_over_step([ranks[0]["holdings"]["ddp"], ranks[1]["holdings"]["zero3"]])
    with pytest.raises(ValueError, match="no moment"):
        plots.holdings_over_step(stage(ranks, "ddp"), moments=["after lunch"])


# ---- 3. DDP: hook -> bucket -> all-reduce -------------------------------------------------------


def test_ddp_buckets_follow_the_hooks(ranks):
    run = ranks[0]["ddp"]
    assert len(run.buckets) > 1 and sorted(run.hooks) == sorted(
        p for ps in run.buckets.values() for p in ps)
    reduces = {e.tag.rsplit("/", 1)[1]: e for e in run.log.events if e.op == "all_reduce"}
    backward = next(s for s in run.log.spans if s.name == "backward")
    for b, params in run.buckets.items():
        assert run.ready[b] >= max(run.hooks[p] for p in params)  # ready at its last hook
        assert run.ready[b] <= reduces[b].start <= backward.end  # issued during backward
    fig = plots.ddp_buckets(run)
    drawn = gids(fig)
    for p, t in run.hooks.items():
        assert drawn[f"hook|{p}"].get_xdata()[0] == pytest.approx(t * 1e3)
    for b, e in reduces.items():
        bar = drawn[f"all_reduce|{b}"]
        assert bar.get_x() == pytest.approx(e.start * 1e3)
        assert bar.get_width() == pytest.approx((e.end - e.start) * 1e3)
        segments = drawn[f"ready|{b}"].get_segments()
        assert segments[0][0][0] == pytest.approx(run.ready[b] * 1e3)
    # Top down: the phases, then the parameters in the order their hooks fired, each bucket's
    # all-reduce row closing its parameters' rows.
    ax = fig.axes[0]
    rows = [t.get_text() for _, t in sorted(zip(ax.get_yticks(), ax.get_yticklabels()),
                                            key=lambda pair: -pair[0])]
    expected = [row for b in sorted(run.buckets, key=run.ready.get)
                for row in sorted(run.buckets[b], key=run.hooks.get) + [f"{b}: all_reduce"]]
    assert rows == ["rank's phases", *expected]


# ---- 4. ZeRO-3's units --------------------------------------------------------------------------


def test_zero3_units_are_gathered_used_and_freed(ranks):
    run = ranks[0]["zero3"]
    assert run.units == ["blocks.0", "blocks.1", "root"] and run.prefetch
    by = {(s.unit, s.state): [] for s in run.stretches}
    for s in run.stretches:
        by[(s.unit, s.state)].append(s)
    gathers = {e.tag: e for e in run.log.events if e.op == "all_gather"}
    for u in ("blocks.0", "blocks.1"):
        fwd, bwd = by[(u, "unsharded")]  # full parameters twice: forward, then backward
        (forward,), (backward,) = by[(u, "forward")], by[(u, "backward")]
        assert forward.start <= fwd.start <= fwd.end <= forward.end
        assert backward.start <= bwd.start <= bwd.end
        assert gathers[f"zero3/fwd/{u}"].start <= fwd.start
        assert gathers[f"zero3/bwd/{u}"].start <= bwd.start
    # Prefetch: blocks.1's gather was issued before blocks.0 finished its forward.
    assert gathers["zero3/fwd/blocks.1"].start < by[("blocks.0", "forward")][0].end
    fig = plots.zero3_lifecycle(run)
    drawn = gids(fig)
    for s in run.stretches:
        bar = drawn[f"{s.state}|{s.unit}|{s.start:.6f}"]
        assert bar.get_x() == pytest.approx(s.start * 1e3)
        assert bar.get_width() == pytest.approx((s.end - s.start) * 1e3)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    for e in run.log.events:
        if e.op in ("all_gather", "reduce_scatter"):
            bar = drawn[f"{e.op}|{e.tag}|{e.start:.6f}"]
            assert bar.get_x() == pytest.approx(e.start * 1e3)
            unit = e.tag.rsplit("/", 1)[1]
            y = fig.axes[0].get_yticks()[ticks.index(unit)]
            assert abs(bar.get_y() + bar.get_height() / 2 - y) < 0.5  # on its unit's row


# ---- 5. the HSDP mesh ---------------------------------------------------------------------------


def test_mesh_draws_the_groups_make_nodes_made(ranks):
    meshes = [r["mesh"] for r in ranks]
    nodes = {m.node for m in meshes}
    replicas = {m.replicas for m in meshes}
    assert nodes == {(0, 1), (2, 3)} and replicas == {(0, 2), (1, 3)}  # consecutive ranks
    for m in meshes:
        assert m.ops[m.node] == ["all_gather", "reduce_scatter"]
        assert m.ops[m.replicas] == ["all_reduce"]
    fig = plots.hsdp_mesh(meshes)
    drawn = gids(fig)
    assert {tuple(map(int, g.split("|")[1].split(","))) for g in drawn
            if g.startswith("node|")} == nodes
    assert {tuple(map(int, g.split("|")[1].split(","))) for g in drawn
            if g.startswith("replicas|")} == replicas
    for m in meshes:  # each rank's circle sits in its node's box and on its replica line
        circle = drawn[f"rank {m.rank}"]
        assert isinstance(circle, Circle)
        x, y = circle.center
        box = drawn[f"node|{','.join(map(str, m.node))}"]
        assert isinstance(box, FancyBboxPatch)
        assert box.get_x() < x < box.get_x() + box.get_width()
        assert box.get_y() < y < box.get_y() + box.get_height()
        line = drawn[f"replicas|{','.join(map(str, m.replicas))}"]
        assert (x, y) in set(zip(line.get_xdata(), line.get_ydata()))


# ---- 6. the flat padded layout ------------------------------------------------------------------


def test_flat_layout_shows_each_ranks_local_shard_and_the_padding(ranks):
    runs = [r["flat"] for r in ranks]
    buckets = runs[0].buckets
    assert [b.padded_numel - b.numel for b in buckets] == [1, 3, 3]  # see LAYOUT_MODEL
    for r in runs:
        for b in r.buckets:
            size = b.padded_numel // N
            assert b.shard == (r.rank * size, (r.rank + 1) * size)  # measured = arithmetic
    fig = plots.flat_layout(runs)
    drawn = gids(fig)
    for b in buckets:
        boxes = [g for g in drawn if g.startswith(f"{b.name}|") and "rank" not in g]
        padding = [g for g in boxes if "|padding|" in g]
        assert len(boxes) == b.padded_numel and len(padding) == b.padded_numel - b.numel
        for p in b.params:
            xs = sorted(drawn[f"{b.name}|{p.name}|{e}"].get_x()
                        for e in range(p.offset, p.offset + p.numel))
            assert xs == list(range(p.offset, p.offset + p.numel))
        for r in runs:
            start, end = next(x.shard for x in r.buckets if x.name == b.name)
            line = drawn[f"{b.name}|rank {r.rank}"]
            assert line.get_xdata()[0] == pytest.approx(start + 0.08)
            assert line.get_xdata()[1] == pytest.approx(end - 0.08)
    assert fig.axes[0].get_title().startswith("ZeRO-1's flat buckets on 4 ranks")
