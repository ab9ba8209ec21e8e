"""Schematic figures: what moves where, drawn from what real ranks recorded.

The data comes from `zerolab.lessons.schematics` (each function there says what it records);
these functions only draw it, duck-typed like the other figures. Every shape a test checks has a
gid that names what it stands for ("step2|chunk1|0->1", "rank 3", "bucket0|rank 2"), so that a
test reads the figure back against the data. The ZeRO paper's Figure 1 (who holds what) is in
holdings.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyArrowPatch, FancyBboxPatch, Patch, Rectangle

from zerolab.plots import base
from zerolab.plots.base import CATEGORY_COLORS, OP_COLORS, SPAN_COLORS, CourseFigure
from zerolab.plots.comm import Lane

EDGE = "#999999"  # outlines of boxes that hold nothing in particular


def _bare(ax: Any) -> None:
    """An axes that is a drawing, not a plot: no frame, no ticks, equal units."""
    ax.set_axis_off()
    ax.set_aspect("equal")


# ---- 1. the ring all-reduce ---------------------------------------------------------------------

_CHUNK_GAP = 1.4  # between two ranks' groups of chunks, in chunk widths
_CHUNK = 0.82  # a chunk's width: the rest of its slot is the gap to the next chunk
_STEP_GAP = 0.9  # between two steps' rows, in chunk heights


def ring_all_reduce(story: Any, title: str | None = None) -> Figure:
    """The ring all-reduce step by step: a row per step (the inputs first), a group of N chunks
    per rank. A chunk is split into N stripes, stripe k filled in rank k's colour when the
    chunk sums rank k's input: the sums fill up over the reduce-scatter and are copied around
    over the all-gather. Arrows: the chunk each rank sent to the next at that step, as recorded
    (a rank's send matched with its neighbour's recv); the arrow out of the last rank re-enters
    on the left, at rank 0.

    story: `zerolab.lessons.schematics.ring_story(...)` (.world_size, .phases, .sums[step][rank]
    [chunk] = ranks summed, .transfers with .step, .chunk, .src, .dst).
    """
    n = story.world_size
    steps = len(story.sums)
    group = n + _CHUNK_GAP  # one rank's chunks and the gap after them
    row = 1 + _STEP_GAP
    fig = CourseFigure(figsize=(2.0 + 1.9 * n, 1.4 + 0.72 * steps), layout="constrained")
    ax = fig.subplots()
    _bare(ax)

    def box(step: int, rank: int, chunk: int) -> tuple[float, float]:  # lower-left corner
        return rank * group + chunk, -step * row

    received = {(t.step, t.dst, t.chunk) for t in story.transfers}
    for s in range(steps):
        for r in range(n):
            for c in range(n):
                x, y = box(s, r, c)
                for k in sorted(story.sums[s][r][c]):
                    ax.add_patch(Rectangle((x + k * _CHUNK / n, y), _CHUNK / n, 1,
                                           color=base.rank_color(k), linewidth=0,
                                           gid=f"step{s}|rank{r}|chunk{c}|from{k}"))
                thick = (s, r, c) in received
                ax.add_patch(Rectangle((x, y), _CHUNK, 1, fill=False, zorder=3,
                                       edgecolor="black" if thick else EDGE,
                                       linewidth=1.8 if thick else 0.6))
        phase = "inputs" if s == 0 else f"step {s}: {story.phases[s - 1]}"
        ax.text(-0.4, -s * row + 0.5, phase, ha="right", va="center", fontsize=8)
    for r in range(n):
        ax.text(r * group + n / 2, 1.25, f"rank {r}", ha="center", va="bottom", fontsize=9)
        for c in range(n):
            ax.text(r * group + c + _CHUNK / 2, 1.05, str(c), ha="center", va="bottom", fontsize=6,
                    color="#555555")
    for t in story.transfers:
        x0, y0 = box(t.step - 1, t.src, t.chunk)
        x1, y1 = box(t.step, t.dst, t.chunk)
        style = {"arrowstyle": "-|>", "mutation_scale": 9, "color": base.rank_color(t.src),
                 "linewidth": 1.2, "zorder": 4, "shrinkA": 1, "shrinkB": 1}
        gid = f"step{t.step}|chunk{t.chunk}|{t.src}->{t.dst}"
        if t.dst > t.src:  # to the next group on the right
            ax.add_patch(FancyArrowPatch((x0 + _CHUNK / 2, y0), (x1 + _CHUNK / 2, y1 + 1),
                                         gid=gid, **style))
        else:  # round the ring: out on the right, in again on the left
            edge = n * group - _CHUNK_GAP / 2
            mid = y0 - _STEP_GAP / 2
            ax.add_patch(FancyArrowPatch((x0 + _CHUNK / 2, y0), (edge, mid), gid=gid, **style))
            ax.add_patch(FancyArrowPatch((-_CHUNK_GAP / 2, mid), (x1 + _CHUNK / 2, y1 + 1),
                                         gid=gid + "|in", **style))
    ax.set_xlim(-_CHUNK_GAP, n * group)
    ax.set_ylim(-(steps - 1) * row - 0.3, 1.9)
    handles = [Patch(color=base.rank_color(k), label=f"rank {k}'s input") for k in range(n)]
    handles.append(Rectangle((0, 0), 1, 1, fill=False, edgecolor="black", linewidth=1.8,
                             label="the chunk received at this step"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(n + 1, 5), fontsize=8,
               frameon=False)
    ax.set_title(title or f"Ring all-reduce on {n} ranks: {n - 1} steps of reduce-scatter, then "
                          f"{n - 1} of all-gather (chunk numbers above)", fontsize=10)
    return fig


# ---- 3. DDP: hook -> bucket -> all-reduce -------------------------------------------------------


def ddp_buckets(run: Any, title: str | None = None) -> Figure:
    """One backward of DDP on one rank: a row per parameter, in the order its gradient hook
    fired (a dot), grouped by bucket; the bucket is ready at its last hook (a bar across its
    rows), and its all-reduce is issued then (a bar on the bucket's own row, until step()
    waited for it). The forward / backward / step spans on top.

    run: `zerolab.lessons.schematics.ddp_backward()`'s result (.buckets {bucket: [param]},
    .hooks {param: s}, .ready {bucket: s}, .log with the all-reduces and the spans).
    """
    reduces = {base_name(e.tag): e for e in run.log.events if e.op == "all_reduce"}
    rows: list[tuple[str, str]] = []  # ("span", ""), ("param", name), ("bucket", name)
    order = sorted(run.buckets, key=lambda b: run.ready.get(b, float("inf")))
    for b in order:
        rows += [("param", p) for p in sorted(run.buckets[b], key=lambda p: run.hooks[p])]
        rows.append(("bucket", b))
    ms = 1e3
    end = max([e.end or e.start for e in reduces.values()] + [s.end for s in run.log.spans])
    fig = CourseFigure(figsize=(base.FIGSIZE[0] + 1.5, 1.6 + 0.16 * (len(rows) + 2)),
                       layout="constrained")
    ax = fig.subplots()
    y_of = {key: len(rows) - i for i, key in enumerate(rows)}
    top = len(rows) + 1.2
    lane = _phase_lane(ax, run.log.spans, top, 0.9)
    for i, b in enumerate(order):
        ys = [y_of[("param", p)] for p in run.buckets[b]] + [y_of[("bucket", b)]]
        if i % 2 == 0:  # alternate bands, so that the buckets read apart
            ax.axhspan(min(ys) - 0.5, max(ys) + 0.5, color="#f2f2f2", zorder=0)
        for p in run.buckets[b]:
            ax.plot(run.hooks[p] * ms, y_of[("param", p)], "o", markersize=3.5,
                    color=CATEGORY_COLORS["grads"], zorder=3, gid=f"hook|{p}")
        if b in run.ready:
            ax.vlines(run.ready[b] * ms, min(ys) - 0.4, max(ys) + 0.4, color="black",
                      linewidth=1.2, zorder=4, gid=f"ready|{b}")
        if b in reduces:
            e = reduces[b]
            ax.barh(y_of[("bucket", b)], ((e.end or e.start) - e.start) * ms, left=e.start * ms,
                    height=0.7, color=OP_COLORS["all_reduce"], zorder=2, gid=f"all_reduce|{b}")
    labels = {key: (key[1] if key[0] == "param" else f"{key[1]}: all_reduce") for key in rows}
    ax.set_yticks([y_of[k] for k in rows] + [top], [labels[k] for k in rows] + ["rank's phases"],
                  fontsize=6.5)
    for tick, key in zip(ax.get_yticklabels(), rows):
        if key[0] == "bucket":
            tick.set_fontweight("bold")
    ax.set_ylim(0.3, top + 0.7)
    ax.set_xlim(0, end * ms * 1.02)
    ax.set_xlabel("time since the step began (ms)")
    handles = [
        ax.plot([], [], "o", markersize=3.5, color=CATEGORY_COLORS["grads"],
                label="gradient hook fired (gradient complete)")[0],
        ax.plot([], [], "|", markersize=10, markeredgewidth=1.2, color="black",
                label="bucket ready: its last hook")[0],
        Patch(color=OP_COLORS["all_reduce"], label="all_reduce: issued, then waited for\n"
                                                   "in step() (gloo runs it meanwhile)")]
    base.legend_outside(ax, handles=handles, fontsize=8)
    ax.set_title(title or f"DDP on rank {run.rank}: gradient hooks fill buckets, each bucket's "
                          "all-reduce starts while backward goes on", fontsize=10)
    _label_lanes(fig, ax, [lane])
    return fig


def base_name(tag: str) -> str:
    """A tag's bucket or unit: its last part ('ddp/bwd/bucket3' -> 'bucket3')."""
    return tag.rsplit("/", 1)[-1]


# ---- 4. ZeRO-3: each unit over one step ---------------------------------------------------------

_LIFE_COLORS = {"unsharded": CATEGORY_COLORS["params"], "forward": SPAN_COLORS["forward"],
                "backward": SPAN_COLORS["backward"]}
_UNSHARDED_ALPHA = 0.45  # lighter than an all-gather's bar, which has the same blue
# A unit's row, from the top: its hooks (forward, backward), its full parameters, its
# collectives. (offset from the row's centre, height)
_LANES = {"hooks": (0.26, 0.22), "held": (0.0, 0.22), "comm": (-0.26, 0.22)}


def _phase_lane(ax: Any, spans: Sequence[Any], y: float, height: float) -> Any:
    """The rank's forward / backward / step spans as a lane at y; returns it for labelling."""
    lane = Lane(y)
    for s in spans:
        ax.barh(y, (s.end - s.start) * 1e3, left=s.start * 1e3, height=height,
                color=SPAN_COLORS.get(s.name, EDGE), gid=f"span|{s.name}")
        lane.add(s.start * 1e3, (s.end - s.start) * 1e3, s.name)
    return lane


def _label_lanes(fig: Figure, ax: Any, lanes: Sequence[Any]) -> None:
    """Write each lane's labels where they fit (once the figure is laid out)."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw_without_rendering()
    for lane in lanes:
        lane.label(ax, renderer)


def zero3_lifecycle(run: Any, title: str | None = None) -> Figure:
    """ZeRO-3's units over one step, on one rank: a row per unit (root last: it is gathered
    for the whole forward), each in three lanes: its forward and backward (pre -> post hook),
    when its full parameters were held (unshard -> reshard; elsewhere a line: sharded, 1/N of
    it held), and its collectives (all-gather issued -> waited for; the reduce-scatter of its
    gradients). With prefetch, a unit's all-gather starts while the unit before it computes.

    run: `zerolab.lessons.schematics.zero3_lifecycle()`'s result (.units, .stretches with
    .unit, .state, .start, .end, .log with the collectives and spans).
    """
    ms = 1e3
    units = list(run.units)
    fig = CourseFigure(figsize=(base.FIGSIZE[0] + 2.2, 1.6 + 0.8 * (len(units) + 0.6)),
                       layout="constrained")
    ax = fig.subplots()
    y_of = {u: len(units) - i for i, u in enumerate(units)}
    top = len(units) + 0.85
    lane = _phase_lane(ax, run.log.spans, top, 0.3)
    end = max(s.end for s in run.log.spans) * ms
    for i, u in enumerate(units):
        if i % 2 == 0:
            ax.axhspan(y_of[u] - 0.45, y_of[u] + 0.45, color="#f2f2f2", zorder=0)
        ax.plot([0, end], [y_of[u]] * 2, color=EDGE, linewidth=0.8, zorder=1)  # sharded
    for st in run.stretches:
        dy, h = _LANES["held" if st.state == "unsharded" else "hooks"]
        ax.barh(y_of[st.unit] + dy, (st.end - st.start) * ms, left=st.start * ms, height=h,
                color=_LIFE_COLORS[st.state], zorder=2,
                alpha=_UNSHARDED_ALPHA if st.state == "unsharded" else 1.0,
                gid=f"{st.state}|{st.unit}|{st.start:.6f}")
    dy, h = _LANES["comm"]
    for e in run.log.events:
        unit = base_name(e.tag)
        if unit in y_of and e.op in ("all_gather", "reduce_scatter"):
            ax.barh(y_of[unit] + dy, ((e.end or e.start) - e.start) * ms, left=e.start * ms,
                    height=h, color=OP_COLORS[e.op], zorder=2, edgecolor="white",
                    linewidth=0.5, gid=f"{e.op}|{e.tag}|{e.start:.6f}")
    ax.set_yticks([y_of[u] for u in units] + [top], units + ["rank's phases"], fontsize=8)
    ax.set_ylim(0.45, top + 0.3)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("time since the step began (ms)")
    handles = [Patch(color=_LIFE_COLORS["forward"], label="forward (pre_forward → post_forward)"),
               Patch(color=_LIFE_COLORS["backward"],
                     label="backward (pre_backward → post_backward)"),
               Patch(color=_LIFE_COLORS["unsharded"], alpha=_UNSHARDED_ALPHA,
                     label="unsharded: full parameters held"),
               ax.plot([], [], color=EDGE, label="sharded: 1/N of it held")[0],
               Patch(color=OP_COLORS["all_gather"], label="all_gather: issued → waited for"),
               Patch(color=OP_COLORS["reduce_scatter"],
                     label="reduce_scatter of its gradients")]
    base.legend_outside(ax, handles=handles, fontsize=8)
    mode = "with prefetch" if run.prefetch else "without prefetch"
    ax.set_title(title or f"ZeRO-3 on rank {run.rank}, {mode}: each unit gathered, used and "
                          "freed, forward then backward", fontsize=10)
    _label_lanes(fig, ax, [lane])
    return fig


# ---- 5. the HSDP mesh ---------------------------------------------------------------------------


def hsdp_mesh(meshes: Sequence[Any], title: str | None = None) -> Figure:
    """N ranks as nodes x shards: a row per shard group (a node: parameters sharded inside it),
    a column per replica group (the ranks holding the same shard in every node). Each group is
    drawn from the ranks torch reports for it, with the collectives one HSDP step ran in it.

    meshes: `zerolab.lessons.schematics.hsdp_mesh()` from every rank (.rank, .node,
    .replicas, .ops {group: [op]}).
    """
    meshes = sorted(meshes, key=lambda m: m.rank)
    nodes = sorted({m.node for m in meshes})
    replicas = sorted({m.replicas for m in meshes})
    ops: dict[tuple[int, ...], list[str]] = {}
    for m in meshes:
        for g, names in m.ops.items():
            ops.setdefault(g, [])
            ops[g] += [o for o in names if o not in ops[g]]
    dx = 1.5  # between two ranks of a node
    where = {}  # rank -> (x, y): its place in its node, its node
    for i, node in enumerate(nodes):
        for j, rank in enumerate(node):
            where[rank] = (j * dx, -i)
    columns = max(len(node) for node in nodes)
    fig = CourseFigure(figsize=(3.4 + 1.8 * columns, 1.5 + 1.1 * len(nodes)),
                       layout="constrained")
    ax = fig.subplots()
    _bare(ax)
    node_color, replica_color = OP_COLORS["all_gather"], OP_COLORS["all_reduce"]
    for i, node in enumerate(nodes):
        xs = [where[r][0] for r in node]
        ax.add_patch(FancyBboxPatch((min(xs) - 0.5, -i - 0.38), max(xs) - min(xs) + 1.0, 0.76,
                                    boxstyle="round,pad=0.02,rounding_size=0.15",
                                    facecolor=node_color, alpha=0.18, edgecolor=node_color,
                                    linewidth=1.5, gid=f"node|{','.join(map(str, node))}"))
        ax.text(min(xs) - 0.65, -i, f"node {i}\nshard group {list(node)}\n"
                f"{', '.join(ops.get(node, [])) or 'no collective'}",
                ha="right", va="center", fontsize=8, color="black")
    for group in replicas:
        xs = [where[r][0] for r in group]
        ys = [where[r][1] for r in group]
        ax.plot(xs, ys, color=replica_color, linewidth=6, alpha=0.45, solid_capstyle="round",
                zorder=1, gid=f"replicas|{','.join(map(str, group))}")
        ax.text(xs[-1], min(ys) - 0.48, f"replica group {list(group)}\n"
                f"{', '.join(ops.get(group, [])) or 'no collective'}",
                ha="center", va="top", fontsize=8)
    for node in nodes:
        for j, rank in enumerate(node):
            x, y = where[rank]
            ax.add_patch(Circle((x, y), 0.3, facecolor="white", edgecolor="black", zorder=3,
                                gid=f"rank {rank}"))
            ax.text(x, y, f"rank {rank}\nshard {j}", ha="center", va="center", fontsize=8,
                    zorder=4)
    ax.set_xlim(-2.7, (columns - 1) * dx + 0.7)
    ax.set_ylim(-len(nodes) - 0.25, 0.55)
    handles = [Patch(facecolor=node_color, alpha=0.3, edgecolor=node_color,
                     label="shard group (a node): all-gather and reduce-scatter stay inside"),
               Patch(color=replica_color, alpha=0.45,
                     label="replica group: the same shard in each node, its gradient "
                           "all-reduced across nodes")]
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, frameon=False)
    n, k = len(where), columns
    ax.set_title(title or f"HSDP on {n} ranks: {len(nodes)} nodes x {k} shards, the groups "
                          "torch made", fontsize=10)
    return fig


# ---- 6. the flat padded layout ------------------------------------------------------------------


def flat_layout(runs: Sequence[Any], title: str | None = None) -> Figure:
    """ZeRO's flat buckets, element by element: each bucket's parameters laid end to end (one
    box per element, a shade per parameter), the padding that rounds it up to a multiple of N
    (hatched), and below, the shard each rank owns, as read from where the rank's local_shard
    sits in its flat_param.

    runs: `zerolab.lessons.schematics.flat_layout()` from every rank (.rank, .world_size,
    .stage, .buckets with .name, .params (.name, .offset, .numel), .numel, .padded_numel, .shard).
    """
    runs = sorted(runs, key=lambda r: r.rank)
    buckets = runs[0].buckets
    n = runs[0].world_size
    widest = max(b.padded_numel for b in buckets)
    height = 1.5 + 0.35 * n  # one bucket's row: names, boxes, a bracket per rank
    fig = CourseFigure(figsize=(2.5 + 0.55 * widest, 1.0 + 0.45 * height * len(buckets)),
                       layout="constrained")
    ax = fig.subplots()
    _bare(ax)
    shades = [CATEGORY_COLORS["params"], "#8fa9d6"]  # the params colour, two tones in turn
    for i, b in enumerate(buckets):
        y = -i * height
        for j, p in enumerate(b.params):
            for e in range(p.offset, p.offset + p.numel):
                ax.add_patch(Rectangle((e, y), 1, 1, facecolor=shades[j % 2], edgecolor="white",
                                       linewidth=1.0, gid=f"{b.name}|{p.name}|{e}"))
            ax.text(p.offset + p.numel / 2, y + 1.12, p.name, ha="center", va="bottom",
                    fontsize=7.5)
        for e in range(b.numel, b.padded_numel):
            ax.add_patch(Rectangle((e, y), 1, 1, facecolor="white", edgecolor=EDGE,
                                   hatch="///", linewidth=0.8, gid=f"{b.name}|padding|{e}"))
        plural = "s" if b.numel != 1 else ""
        ax.text(-0.3, y + 0.5, f"{b.name}\n{b.numel} element{plural},\n"
                f"padded to {b.padded_numel}",
                ha="right", va="center", fontsize=8)
        for r in runs:
            start, end = next(x.shard for x in r.buckets if x.name == b.name)
            yr = y - 0.3 - 0.35 * r.rank
            ax.plot([start + 0.08, end - 0.08], [yr, yr], color=base.rank_color(r.rank),
                    linewidth=3, solid_capstyle="butt", gid=f"{b.name}|rank {r.rank}")
            ax.text(end - 0.02, yr, f" rank {r.rank}", ha="left", va="center", fontsize=7,
                    color=base.rank_color(r.rank))
    ax.set_xlim(-3.2, widest + 1.5)
    ax.set_ylim(-(len(buckets) - 1) * height - 0.5 - 0.35 * n, 1.8)
    handles = [Patch(color=shades[0], label="a parameter's elements (shades alternate)"),
               Patch(facecolor="white", edgecolor=EDGE, hatch="///", label="padding"),
               ax.plot([], [], color="black", linewidth=3,
                       label="the shard a rank owns (its local_shard)")[0]]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8, frameon=False)
    ax.set_title(title or f"{runs[0].stage}'s flat buckets on {n} ranks: parameters end to end, "
                          f"padded to a multiple of {n}, one equal shard per rank", fontsize=10)
    return fig
