"""The figures, drawn headless: titles, labels with units, bars, lines, lanes, legends."""

from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from zerolab import plots, theory  # noqa: E402

MiB = 2**20


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def legend_texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


@pytest.mark.parametrize(
    ("nbytes", "decimal", "unit"),
    [(10, False, "B"), (5000, False, "KiB"), (3 * MiB, False, "MiB"), (5 * 2**30, False, "GiB"),
     (112e9, True, "GB"), (1.12e12, True, "GB"), (2e6, True, "MB")],
)
def test_pick_unit(nbytes, decimal, unit):
    assert plots.pick_unit(nbytes, decimal)[0] == unit


# --- memory_bars ---------------------------------------------------------------------------------


def test_memory_bars_stacks_categories_per_rank():
    per_rank = [{"params": 2 * MiB, "grads": MiB, "optimizer": 4 * MiB} for _ in range(3)]
    fig = plots.memory_bars(per_rank, expected=7 * MiB, title="ZeRO-1")
    ax = fig.axes[0]
    assert isinstance(fig, Figure)
    assert ax.get_title() == "ZeRO-1"
    assert ax.get_ylabel() == "bytes held (MiB)"
    assert ax.get_xlabel() == "rank"
    assert len(ax.patches) == 3 * 3  # 3 ranks x 3 categories
    assert [t.get_text() for t in ax.get_xticklabels()] == ["rank 0", "rank 1", "rank 2"]
    # top of each stack = the total, in MiB
    tops = sorted({round(p.get_y() + p.get_height(), 6) for p in ax.patches})
    assert tops == [2, 3, 7]
    assert legend_texts(fig) == ["optimizer", "grads", "params", "formula (7 MiB)"]
    dashed = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(dashed) == 3  # one formula segment per rank


def test_memory_bars_category_colours_are_fixed_and_extras_allowed():
    fig = plots.memory_bars([{"optimizer": 10, "other": 5, "buffers": 3}, {"params": 4}])
    ax = fig.axes[0]
    assert legend_texts(fig) == ["buffers", "other", "optimizer", "params"]
    legend = ax.get_legend()
    colours = {t.get_text(): h.get_facecolor()
               for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)}
    assert matplotlib.colors.to_hex(colours["params"]) == plots.CATEGORY_COLORS["params"]
    assert matplotlib.colors.to_hex(colours["other"]) == plots.CATEGORY_COLORS["other"]
    assert ax.get_ylabel() == "bytes held (B)"


def test_memory_bars_expected_per_category_and_labels():
    stages = theory.all_stages(7e9, 8)
    per_stage = [m.as_dict() for m in stages.values()]
    fig = plots.memory_bars(per_stage, expected=per_stage, labels=list(stages), xlabel="stage",
                            decimal=True, title="7B")
    ax = fig.axes[0]
    assert ax.get_ylabel() == "bytes held (GB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == list(theory.STAGES)
    assert "formula" in legend_texts(fig)
    assert len([c for c in ax.collections if isinstance(c, LineCollection)]) == 4 * 3
    totals = [t.get_text() for t in ax.texts]
    assert totals == ["112", "63", "38.5", "14"]


# --- memory_timeline -----------------------------------------------------------------------------


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


def test_memory_timeline_takes_objects_with_samples():
    trace = SimpleNamespace(samples=samples(0.0))  # like zerolab.MemoryTrace
    fig = plots.memory_timeline([trace, trace])
    assert len(fig.axes[0].lines) == 2


def test_memory_timeline_category():
    fig = plots.memory_timeline([samples(0.0)], category="other")
    ax = fig.axes[0]
    assert len(ax.lines) == 1
    assert ax.get_ylabel() == "other memory (MiB)"


def test_memory_timeline_single_rank_stacks_categories():
    fig = plots.memory_timeline([samples(0.0)])
    ax = fig.axes[0]
    assert len([c for c in ax.collections if isinstance(c, PolyCollection)]) == 2
    assert sorted(legend_texts(fig)) == ["other", "params"]
    assert ax.get_ylabel() == "total memory (MiB)"


# --- timeline ------------------------------------------------------------------------------------


def fake_log(rank: int, t: float):
    """Shaped like zerolab.comm.CommLog: .rank, .events, .spans, times in seconds."""
    span = SimpleNamespace
    spans = [span(name="forward", start=t, end=t + 0.010),
             span(name="backward", start=t + 0.010, end=t + 0.030),
             span(name="step", start=t + 0.030, end=t + 0.032)]

    def event(op, tag, start, end):
        return SimpleNamespace(op=op, tag=tag, nbytes=8, sent_bytes=4, start=start, end=end)

    events = [
        event("all_gather", "zero3/fwd/blocks.0", t, t + 0.008),
        event("reduce_scatter", "zero3/bwd/blocks.0", t + 0.020, t + 0.021),
        event("broadcast", "init", t + 0.031, None),  # never waited on: no end
    ]
    return SimpleNamespace(rank=rank, events=events, spans=spans)


def test_timeline_lanes_per_rank():
    logs = [fake_log(1, 5.001), fake_log(0, 5.0)]  # any order; sorted by rank
    fig = plots.timeline(logs, title="one step")
    ax = fig.axes[0]
    assert ax.get_title() == "one step"
    assert ax.get_xlabel() == "time since first event (ms)"
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "rank 0 compute", "rank 0 comm", "rank 1 compute", "rank 1 comm"]
    assert len(ax.patches) == 2 * (3 + 3)  # spans + events, both ranks
    assert legend_texts(fig) == ["forward", "backward", "step", "all_gather", "reduce_scatter",
                                 "broadcast"]
    assert min(p.get_x() for p in ax.patches) == pytest.approx(0)  # ms from the earliest start
    labels = {t.get_text() for t in ax.texts}
    assert {"forward", "backward", "blocks.0"} <= labels  # wide bars carry their name


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
    log.events.append(comm.CommEvent(op="all_reduce", tag="ddp/grads", nbytes=4, sent_bytes=0,
                                     start=0.0, end=0.002))
    log.spans.append(comm.Span(name="backward", start=0.0, end=0.003))
    fig = plots.timeline([log])
    assert legend_texts(fig) == ["backward", "all_reduce"]


# --- bytes_per_rank ------------------------------------------------------------------------------


def test_bytes_per_rank_grouped_bars():
    n, psi = 2, 1000
    data = {s: [theory.comm_volume(psi, n, s).ring_sent_bytes] * n
            for s in ("DDP", "ZeRO-2", "ZeRO-3")}
    expected = {s: v[0] for s, v in data.items()}
    fig = plots.bytes_per_rank(data, expected, title="comm")
    ax = fig.axes[0]
    assert ax.get_title() == "comm"
    assert ax.get_ylabel() == "bytes sent per rank (KiB)"
    assert ax.get_xlabel() == "stage"
    assert len(ax.patches) == 3 * 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["DDP", "ZeRO-2", "ZeRO-3"]
    assert legend_texts(fig) == ["rank 0", "rank 1", "formula"]
    assert len([c for c in ax.collections if isinstance(c, LineCollection)]) == 3


# --- memory_vs_world_size ------------------------------------------------------------------------


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
    assert len(ax.lines) == 4  # a curve and a set of markers per stage
    assert legend_texts(fig) == ["DDP formula", "DDP measured", "ZeRO-3 formula",
                                 "ZeRO-3 measured"]
    curve = ax.lines[2]
    assert curve.get_xdata()[0] == 1 and curve.get_xdata()[-1] == 4
    assert list(ax.get_xticks()) == [1, 2, 4]
    assert ax.get_xscale() == "linear"


def test_memory_vs_world_size_single_series_and_log_axis():
    f = lambda n: 16e9 / n  # noqa: E731
    fig = plots.memory_vs_world_size({1: 16e9, 64: 0.25e9}, f, decimal=True)
    ax = fig.axes[0]
    assert len(ax.lines) == 2
    assert legend_texts(fig) == ["formula", "measured"]
    assert ax.get_xscale() == "log"
    assert ax.get_ylabel() == "bytes per rank (GB)"


def test_memory_vs_world_size_formula_only():
    fig = plots.memory_vs_world_size({}, {"ZeRO-3": lambda n: 1e9 / n}, max_world_size=8)
    ax = fig.axes[0]
    assert len(ax.lines) == 1
    assert ax.lines[0].get_xdata()[-1] == 8
    assert legend_texts(fig) == ["ZeRO-3 formula"]


def test_plots_never_show(monkeypatch):
    monkeypatch.setattr(plt, "show", lambda *a, **k: pytest.fail("plt.show() called"))
    plots.memory_bars([{"params": 1}])
    plots.memory_timeline([samples(0.0)])
    plots.timeline([fake_log(0, 0.0)])
    plots.bytes_per_rank({"DDP": [1, 2]})
    plots.memory_vs_world_size({1: 2.0}, lambda n: 2.0 / n)
