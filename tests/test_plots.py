"""The figures, drawn headless: titles, labels with units, bars, lines, lanes, legends."""

import pathlib
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import zerolab  # noqa: E402
from zerolab import plots, theory  # noqa: E402
from zerolab.plots import activations as activation_plots  # noqa: E402

MiB = 2**20


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def legend_texts(fig: Figure, ax: int = 0) -> list[str]:
    return [t.get_text() for t in fig.axes[ax].get_legend().get_texts()]


def legend_colours(fig: Figure) -> dict[str, str]:
    legend = fig.axes[0].get_legend()
    return {t.get_text(): matplotlib.colors.to_hex(h.get_facecolor())
            for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
            if h.get_visible()}


# --- 1. units: binary for measurements, decimal GB for model scale ------------------------------


@pytest.mark.parametrize(
    ("nbytes", "decimal", "unit"),
    [(10, False, "B"), (5000, False, "KiB"), (3 * MiB, False, "MiB"), (5 * 2**30, False, "GiB"),
     (112e9, True, "GB"), (1.12e12, True, "GB"), (2e6, True, "MB")],
)
def test_pick_unit(nbytes, decimal, unit):
    assert plots.pick_unit(nbytes, decimal)[0] == unit


def test_units_follow_one_convention():
    assert "1 MiB = 2^20 B" in plots.UNIT_CONVENTION and "1 GB = 10^9 B" in plots.UNIT_CONVENTION
    assert plots.pick_unit(5000, unit="MiB") == ("MiB", 2**20)  # forced, e.g. to compare
    with pytest.raises(ValueError, match="decimal"):
        plots.pick_unit(5000, unit="MB")  # a decimal unit for measured bytes: refused
    with pytest.raises(ValueError, match="measured"):
        plots.pick_unit(5e9, decimal=True, unit="GiB")
    assert plots.format_bytes(448_512, plots.pick_unit(448_512)) == "438 KiB"
    assert plots.format_bytes(63e9, plots.pick_unit(63e9, decimal=True)) == "63 GB"


def test_every_bar_total_says_its_unit():
    stages = theory.all_stages(7e9, 8)
    per_stage = [m.as_dict() for m in stages.values()]
    fig = plots.memory_bars(per_stage, expected=per_stage, labels=list(stages), xlabel="stage",
                            decimal=True, title="7B")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bytes held (GB)" and fig.byte_unit == ("GB", 1e9)
    assert [t.get_text() for t in ax.get_xticklabels()] == list(theory.STAGES)
    assert [t.get_text() for t in ax.texts] == ["112 GB", "63 GB", "38.5 GB", "14 GB"]
    assert len([c for c in ax.collections if isinstance(c, LineCollection)]) == 4 * 3
    sent = plots.bytes_per_rank({"DDP": [3 * MiB, 3 * MiB]})
    assert [t.get_text() for t in sent.axes[0].texts] == ["3 MiB"]


# --- 2. categories: one colour and one legend entry each, "other" is what is left ---------------


def test_categories_have_fixed_colours_and_order():
    per_rank = [{"other": MiB, "comm": MiB, "activations": MiB, "optimizer": MiB,
                 "grads": MiB, "params": 2 * MiB}]
    fig = plots.memory_bars(per_rank, labels=["peak"])
    # Stacked bottom up params .. other; the legend reads top-down, each category once.
    assert legend_texts(fig) == ["other (temporaries)", "comm (buffers in flight)",
                                 "activations", "optimizer", "grads", "params"]
    colours = legend_colours(fig)
    assert colours["comm (buffers in flight)"] == plots.CATEGORY_COLORS["comm"]
    assert colours["activations"] == plots.CATEGORY_COLORS["activations"]
    assert len(set(plots.CATEGORY_COLORS.values())) == len(plots.CATEGORY_COLORS)


def test_other_says_what_it_holds_and_extras_get_colours_of_their_own():
    fig = plots.memory_bars([{"optimizer": 10, "other": 5, "buffers": 3}, {"params": 4}])
    # No "activations" category (a trace without activations=True): they are in "other".
    assert legend_texts(fig) == ["buffers", "other\n(activations, temporaries)", "optimizer",
                                 "params"]
    colours = legend_colours(fig)
    assert colours["params"] == plots.CATEGORY_COLORS["params"]
    assert colours["buffers"] not in plots.CATEGORY_COLORS.values()
    assert fig.axes[0].get_ylabel() == "bytes held (B)"


def test_categories_empty_everywhere_are_left_out():
    fig = plots.memory_bars([{"params": MiB, "comm": 0}, {"params": 2 * MiB, "comm": 0}])
    assert legend_texts(fig) == ["params"]
    assert len(fig.axes[0].patches) == 2


# --- 3. equal ranks: one bar --------------------------------------------------------------------


def test_memory_bars_equal_ranks_are_one_bar_with_a_note_and_the_formula():
    per_rank = [{"params": 2 * MiB, "grads": MiB, "optimizer": 4 * MiB} for _ in range(3)]
    fig = plots.memory_bars(per_rank, expected=7 * MiB, title="ZeRO-1")
    ax = fig.axes[0]
    assert ax.get_title() == "ZeRO-1" and ax.get_ylabel() == "bytes held (MiB)"
    assert len(ax.patches) == 3  # one bar, 3 categories
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ranks 0–2"]
    texts = [t.get_text() for t in ax.texts]
    assert "7 MiB" in texts
    assert "same on all 3 ranks\nmeasured 7 MiB\nformula 7 MiB" in texts
    assert legend_texts(fig) == ["optimizer", "grads", "params", "formula (7 MiB)"]


def test_memory_bars_per_rank_where_ranks_differ_or_when_asked():
    same = [{"params": 2 * MiB, "grads": MiB, "optimizer": 4 * MiB} for _ in range(3)]
    fig = plots.memory_bars(same, expected=7 * MiB, each_rank=True)
    ax = fig.axes[0]
    assert len(ax.patches) == 3 * 3  # 3 ranks x 3 categories
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1", "rank 2"]
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches})
    assert tops == [2, 3, 7]
    assert len([c for c in ax.collections if isinstance(c, LineCollection)]) == 3
    differ = plots.memory_bars([{"params": MiB}, {"params": 2 * MiB}])
    assert [t.get_text() for t in differ.axes[0].get_xticklabels()] == ["rank 0", "rank 1"]


def test_memory_bars_groups_merge_their_equal_ranks():
    a, b = {"params": MiB, "grads": MiB}, {"params": MiB, "grads": 2 * MiB}
    fig = plots.memory_bars({"DDP": [a, a], "ZeRO-1": [a, b]},
                            expected={"DDP": 2 * MiB, "ZeRO-1": 2.5 * MiB})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["DDP", "ZeRO-1\nrank 0",
                                                            "ZeRO-1\nrank 1"]
    assert legend_texts(fig)[-1] == "DDP: same on all 2 ranks"
    levels = sorted(round(seg[0][1], 6) for c in ax.collections for seg in c.get_segments())
    assert levels == [2, 2.5, 2.5]


def test_bytes_per_rank_equal_ranks_are_one_bar_per_stage():
    n, psi = 2, 1000
    data = {s: [theory.comm_volume(psi, n, s).ring_sent_bytes] * n
            for s in ("DDP", "ZeRO-2", "ZeRO-3")}
    expected = {s: v[0] for s, v in data.items()}
    fig = plots.bytes_per_rank(data, expected, title="comm")
    ax = fig.axes[0]
    assert ax.get_title() == "comm"
    assert ax.get_ylabel() == "bytes sent per rank (KiB)"
    assert ax.get_xlabel() == "stage"
    assert len(ax.patches) == 3
    assert [t.get_text() for t in ax.get_xticklabels()] == ["DDP", "ZeRO-2", "ZeRO-3"]
    assert legend_texts(fig) == ["same on all 2 ranks", "formula"]
    assert len([c for c in ax.collections if isinstance(c, LineCollection)]) == 3


def test_bytes_per_rank_draws_each_rank_where_they_differ():
    fig = plots.bytes_per_rank({"DDP": [4 * MiB, 4 * MiB], "torch ZeRO": [3 * MiB, 5 * MiB]})
    ax = fig.axes[0]
    assert len(ax.patches) == 1 + 2
    assert legend_texts(fig) == ["same on all 2 ranks", "rank 0", "rank 1"]
    forced = plots.bytes_per_rank({"DDP": [4 * MiB, 4 * MiB]}, each_rank=True)
    assert len(forced.axes[0].patches) == 2
    assert legend_texts(forced) == ["rank 0", "rank 1"]


# --- memory_timeline, and 5: a shared unit for figures that are compared ------------------------


def samples(offset: float, n: int = 5):
    return [(offset + 0.001 * i, {"params": MiB, "other": (i % 2) * MiB}) for i in range(n)]


def test_memory_timeline_one_line_per_rank():
    fig = plots.memory_timeline([samples(10.0), samples(10.002)], title="ZeRO-3")
    ax = fig.axes[0]
    assert ax.get_title() == "ZeRO-3"
    assert len(ax.lines) == 2
    assert legend_texts(fig) == ["rank 0", "rank 1"]
    assert ax.get_xlabel() == "time since first sample (ms)"
    assert ax.get_ylabel() == "total memory (MiB)"
    x0 = ax.lines[0].get_xdata()
    assert x0[0] == pytest.approx(0)
    assert x0[1] == pytest.approx(1)  # 1 ms between samples
    assert ax.lines[1].get_xdata()[0] == pytest.approx(2)
    assert max(ax.lines[0].get_ydata()) == pytest.approx(2)  # params + other, in MiB


def test_memory_timeline_takes_objects_with_samples_and_a_category():
    trace = SimpleNamespace(samples=samples(0.0))  # like zerolab.MemoryTrace
    assert len(plots.memory_timeline([trace, trace]).axes[0].lines) == 2
    fig = plots.memory_timeline([samples(0.0)], category="other")
    assert len(fig.axes[0].lines) == 1
    assert fig.axes[0].get_ylabel() == "other memory (MiB)"


def test_memory_timeline_single_rank_stacks_categories_once_each():
    data = [(0.001 * i, {"params": MiB, "grads": 0, "comm": i * MiB, "activations": MiB,
                         "other": MiB}) for i in range(3)]
    fig = plots.memory_timeline([data])
    ax = fig.axes[0]
    assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 4  # no grads
    assert legend_texts(fig) == ["other (temporaries)", "comm (buffers in flight)",
                                 "activations", "params"]
    assert ax.get_ylabel() == "total memory (MiB)"


def test_memory_timeline_marks_phases_and_levels():
    phases = [SimpleNamespace(name="forward", start=0.0, end=0.002),
              SimpleNamespace(name="backward", start=0.002, end=0.004)]
    fig = plots.memory_timeline([samples(0.0)], category="params", phases=phases,
                                levels={"shards": MiB / 2, "full model": 2 * MiB})
    ax = fig.axes[0]
    texts = {t.get_text(): t for t in ax.texts}
    assert set(texts) == {"forward", "backward", "shards", "full model"}
    assert texts["backward"].get_position()[0] == pytest.approx(3)  # mid-phase, in ms
    assert texts["full model"].get_position()[1] == pytest.approx(2)  # at its bytes, in MiB
    vertical = [ln for ln in ax.lines if ln.get_linestyle() == ":"]
    assert [ln.get_xdata()[0] for ln in vertical] == pytest.approx([0, 2])  # each start, ms
    assert len([ln for ln in ax.lines if ln.get_linestyle() == "--"]) == 2


def test_memory_timelines_compared_share_unit_and_limits():
    # Notebook 05's pair: peaks of 1.1 MiB and 900 KiB would each get a unit of their own.
    runs = [[(0.0, {"params": 0}), (0.001, {"params": peak})] for peak in (1.1 * MiB, 900 * 2**10)]
    alone = [plots.memory_timeline([r], category="params") for r in runs]
    assert [f.axes[0].get_ylabel() for f in alone] == ["params memory (MiB)",
                                                       "params memory (KiB)"]
    pair = [plots.memory_timeline([r], category="params", unit="MiB", ymax=1.5 * MiB)
            for r in runs]
    assert {f.axes[0].get_ylabel() for f in pair} == {"params memory (MiB)"}
    assert {f.axes[0].get_ylim() for f in pair} == {(0, 1.5)}
    assert {f.byte_unit for f in pair} == {("MiB", MiB)}
    with pytest.raises(ValueError):
        plots.memory_timeline([samples(0.0)], unit="MB")


# --- 4. timeline --------------------------------------------------------------------------------


def fake_log(rank: int, t: float, spans=("forward", "backward", "step")):
    """Shaped like zerolab.comm.CommLog: .rank, .events, .spans, times in seconds."""
    starts = (t, t + 0.010, t + 0.030, t + 0.032)
    spans = [SimpleNamespace(name=n, start=starts[i], end=starts[i + 1])
             for i, n in enumerate(spans)]

    def event(op, tag, start, end):
        return SimpleNamespace(op=op, tag=tag, nbytes=8, sent_bytes=4, start=start, end=end)

    events = [
        event("all_gather", "zero3/fwd/blocks.0", t, t + 0.008),
        event("reduce_scatter", "zero3/bwd/blocks.1", t + 0.020, t + 0.0202),  # too narrow
        event("broadcast", "init", t + 0.031, None),  # never waited on: no end
    ]
    return SimpleNamespace(rank=rank, events=events, spans=spans)


def test_timeline_lanes_say_what_they_hold():
    logs = [fake_log(1, 5.001), fake_log(0, 5.0)]  # any order; sorted by rank
    fig = plots.timeline(logs, title="one step")
    ax = fig.axes[0]
    assert ax.get_title() == "one step"
    assert ax.get_xlabel() == "time since first event (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 · compute\n(forward, backward, step)", "rank 0 · collectives",
        "rank 1 · compute\n(forward, backward, step)", "rank 1 · collectives"]
    assert len(ax.patches) == 2 * (3 + 3)  # spans + events, both ranks
    assert legend_texts(fig) == ["forward", "backward", "step", "all_gather", "reduce_scatter",
                                 "broadcast"]
    assert min(p.get_x() for p in ax.patches) == pytest.approx(0)  # ms from the earliest start


def test_timeline_labels_are_unit_names_or_nothing():
    fig = plots.timeline([fake_log(0, 0.0)])
    labels = [t.get_text() for t in fig.axes[0].texts]
    # Wide bars carry the whole unit name; the narrow reduce-scatter none (not '1', not '').
    assert sorted(labels) == ["backward", "blocks.0", "forward", "step"]
    assert plots.unit_name("zero3/fwd/blocks.2") == "blocks.2"
    assert plots.unit_name("ddp/bwd/bucket3") == "bucket3"


def test_timeline_overlapping_bars_get_no_label():
    log = fake_log(0, 0.0)
    log.events.append(SimpleNamespace(op="all_gather", tag="zero3/fwd/blocks.5", start=0.001,
                                      end=0.009))  # in flight together with blocks.0
    labels = [t.get_text() for t in plots.timeline([log]).axes[0].texts]
    assert "blocks.0" not in labels and "blocks.5" not in labels


def test_timeline_bars_in_flight_together_do_not_hide_each_other():
    log = fake_log(0, 0.0)
    log.events.append(SimpleNamespace(op="all_gather", tag="zero3/fwd/blocks.5", start=0.001,
                                      end=0.009))  # in flight together with blocks.0
    ax = plots.timeline([log]).axes[0]
    comm_y = ax.get_yticks()[1]
    bars = [p for p in ax.patches if abs(p.get_y() + p.get_height() / 2 - comm_y) < 0.4]
    assert len(bars) == 4  # blocks.0, blocks.1, init, blocks.5: all in rank 0's collectives lane
    for a in bars:  # two bars that share some time share no height
        for b in bars:
            if a is not b and a.get_x() < b.get_x() + b.get_width() and (
                    b.get_x() < a.get_x() + a.get_width()):
                assert (a.get_y() + a.get_height() <= b.get_y() + 1e-9
                        or b.get_y() + b.get_height() <= a.get_y() + 1e-9)
    assert max(p.get_height() for p in bars) == pytest.approx(0.35)  # two sub-rows


def test_timeline_lesson_spans_have_a_colour_and_entry_each():
    fig = plots.timeline([fake_log(0, 0.0, spans=("phase 1", "phase 2", "phase 3"))])
    colours = legend_colours(fig)
    assert list(colours)[:3] == ["phase 1", "phase 2", "phase 3"]
    assert len({colours[f"phase {i}"] for i in (1, 2, 3)}) == 3  # not one grey three times
    assert fig.axes[0].get_yticklabels()[0].get_text() == (
        "rank 0 · code regions\n(phase 1, phase 2, phase 3)")


def test_timeline_colours_per_op():
    fig = plots.timeline([fake_log(0, 0.0)])
    comm_y = fig.axes[0].get_yticks()[1]
    colours = {matplotlib.colors.to_hex(p.get_facecolor()) for p in fig.axes[0].patches
               if abs(p.get_y() + p.get_height() / 2 - comm_y) < 1e-9}
    assert colours == {plots.OP_COLORS[op] for op in ("all_gather", "reduce_scatter",
                                                      "broadcast")}


def test_timeline_accepts_zerolab_comm_logs():
    comm = pytest.importorskip("zerolab.comm")
    log = comm.CommLog(rank=0, world_size=1)
    log.events.append(comm.CommEvent(op="all_reduce", tag="ddp/grads", nbytes=4, ring_bytes=0,
                                     start=0.0, end=0.002))
    log.spans.append(comm.Span(name="backward", start=0.0, end=0.003))
    fig = plots.timeline([log])
    assert legend_texts(fig) == ["backward", "all_reduce"]


# --- 6. memory_vs_world_size: every series visible ----------------------------------------------


def test_memory_vs_world_size_several_stages():
    psi = 1e6
    measured = {s: {n: theory.model_state_memory(psi, n, s).total for n in (1, 2, 4)}
                for s in ("DDP", "ZeRO-3")}
    formula = {s: (lambda n, s=s: theory.model_state_memory(psi, n, s).total)
               for s in ("DDP", "ZeRO-3")}
    fig = plots.memory_vs_world_size(measured, formula, title="scaling")
    ax = fig.axes[0]
    assert ax.get_title() == "scaling"
    assert ax.get_xlabel() == "world size N (ranks)"
    assert ax.get_ylabel() == "bytes per rank (MiB)"
    assert len(ax.lines) == 2 and len(ax.collections) == 2  # a curve and markers per stage
    assert legend_texts(fig) == ["DDP", "ZeRO-3"]  # one entry each: its line and its marker
    assert ax.get_legend().get_title().get_text() == "line: formula, marker: measured"
    curve = ax.lines[1]
    assert curve.get_xdata()[0] == 1 and curve.get_xdata()[-1] == 4
    assert list(ax.get_xticks()) == [1, 2, 4]
    assert ax.get_xscale() == "linear"


def test_memory_vs_world_size_equal_series_stay_visible():
    psi = 1e6
    stages = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
    sent = {s: {n: theory.comm_volume(psi, n, s).ring_sent_bytes for n in (1, 2, 4)}
            for s in stages}
    formula = {s: (lambda n, s=s: theory.comm_volume(psi, n, s).ring_sent_bytes)
               for s in stages}
    fig = plots.memory_vs_world_size(sent, formula, max_world_size=16)
    ax = fig.axes[0]
    assert legend_texts(fig) == ["DDP", "ZeRO-1 (= DDP)", "ZeRO-2 (= DDP)", "ZeRO-3"]
    curves, markers = ax.lines, ax.collections
    # Equal curves: widest first, each next one narrower and dashed, so all three show.
    widths = [c.get_linewidth() for c in curves[:3]]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3
    assert len({c.get_linestyle() for c in curves[:3]}) == 3
    # Equal measurements at N = 2: all at N = 2 (never shifted sideways), widest first, so
    # that each marker shows around the ones drawn on top of it.
    assert [m.get_offsets()[1][0] for m in markers] == [2, 2, 2, 2]
    sizes_at_2 = [m.get_sizes()[1] for m in markers]
    assert sizes_at_2[0] > sizes_at_2[1] > sizes_at_2[2] == sizes_at_2[3]
    assert [m.get_zorder() for m in markers] == sorted(m.get_zorder() for m in markers)
    assert len({m.get_paths()[0].vertices.tobytes() for m in markers}) == 4  # four shapes


def test_memory_vs_world_size_single_series_and_log_axis():
    f = lambda n: 16e9 / n  # noqa: E731
    fig = plots.memory_vs_world_size({1: 16e9, 64: 0.25e9}, f, decimal=True)
    ax = fig.axes[0]
    assert len(ax.lines) == 1 and len(ax.collections) == 1
    assert legend_texts(fig) == ["formula", "measured"]
    assert ax.get_xscale() == "log"
    assert ax.get_ylabel() == "bytes per rank (GB)"


def test_memory_vs_world_size_formula_only():
    fig = plots.memory_vs_world_size({}, {"ZeRO-3": lambda n: 1e9 / n}, max_world_size=8)
    ax = fig.axes[0]
    assert len(ax.lines) == 1
    assert ax.lines[0].get_xdata()[-1] == 8
    assert legend_texts(fig) == ["ZeRO-3"]
    assert ax.get_legend().get_title().get_text() == ""


# --- activation_plots, and what every figure shares -----------------------------------------------


def test_stacked_panels_share_categories_and_units():
    fig = activation_plots.stacked_panels(
        {"a": {1: {"params": 2e9, "activations": 1e9}}, "b": {2: {"params": 1e9}}}, "t",
        capacity=80e9)
    assert fig.axes[0].get_ylabel() == "bytes per GPU (GB)"
    assert legend_texts(fig, -1) == ["activations", "params", "GPU memory"]


def test_plots_never_show(monkeypatch):
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("plt.show() called"))
    plots.memory_bars([{"params": 1}])
    plots.memory_timeline([samples(0.0)])
    plots.timeline([fake_log(0, 0.0)])
    plots.bytes_per_rank({"DDP": [1, 2]})
    plots.memory_vs_world_size({1: 2.0}, lambda n: 2.0 / n)
    assert np.isfinite(plots.pick_unit(1)[1])


def test_torch_zero_redundancy_optimizer_is_named_in_full():
    """'ZeRO-RO' is no name the course defines: torch's is ZeroRedundancyOptimizer."""
    package = pathlib.Path(zerolab.__file__).parent
    for path in package.rglob("*.py"):
        assert "ZeRO-RO" not in path.read_text(encoding="utf-8"), path


def test_grouped_bytes_counts_in_the_unit_it_is_given():
    data = {"ZeRO-3": {"paper": 3 * MiB, "measured": 1.75 * MiB}, "HSDP": {"measured": MiB / 2}}
    fig = plots.grouped_bytes(data, "across", xlabel="variant", ylabel="bytes per rank",
                              lines={"M": MiB}, unit=("M", MiB))
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bytes per rank (M)"
    heights = sorted(round(p.get_height(), 3) for p in ax.patches)
    assert heights == [0.5, 1.75, 3.0]  # in multiples of the unit, not of a byte unit
    assert legend_texts(fig) == ["M", "paper", "measured"]
    assert plots.grouped_bytes(data, "t", xlabel="x", ylabel="y").axes[0].get_ylabel() == "y (MiB)"
