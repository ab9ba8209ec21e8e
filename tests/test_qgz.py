"""ZeRO++'s qgZ: gradients block-quantised (int8, int4) and reduce-scattered in two all-to-alls,
inside each node then across nodes (zerolab.parts.qgz.quantized_reduce_scatter, the engine option
quantize_grads=True), on 4 ranks as 2 "nodes" of 2 and on 2 ranks as 1 node of 2 or 2 of 1.

Against: the fp32 reduce-scatter on the same input (within the rounding bound), the all-to-all's
byte formula, the bytes per peer across nodes (at most 1/3 of fp32's), ZeRO-3 bit for bit when
the option is off, and the loss of the course GPT trained with it (notebook 09's lesson).
"""

from __future__ import annotations

import pytest
import torch
from workers import qgz as W

import zerolab
from zerolab import comm, theory
from zerolab.harness import max_diff
from zerolab.lessons import n09_nodes
from zerolab.lessons import n09_qgz as lesson
from zerolab.parts.quantize import LEVELS, dequantize_rows, quantize_int8, quantize_rows

HEADERS = 256  # at most, gloo's own bytes per message on top of the payload (measured 144)
CURVE_STEPS = 40  # the lesson's loss curves, cut short (the notebook runs 80)


@pytest.fixture(scope="module")
def runs():
    return zerolab.launch(W.everything, 4, timeout=600)


@pytest.fixture(scope="module")
def at_two():
    return zerolab.launch(W.at_two, 2, timeout=300)


@pytest.fixture(scope="module")
def lessons():
    return zerolab.launch(lesson.qgz_lesson, 4, args=(CURVE_STEPS,), timeout=600)


# ---- quantisation alone ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, block", [(1, 256), (255, 256), (257, 256), (4097, 256), (1000, 64),
                                      (7, 5)])
def test_round_trip_is_within_half_a_step(bits, n, block):
    gen = torch.Generator().manual_seed(n + bits)
    x = torch.randn(3, n, generator=gen) * torch.logspace(-3, 1, n)[torch.randperm(n)]
    x[1, :] = 0.0  # a row of zeros comes back as zeros
    x[2, n // 2] = 50.0  # an outlier costs only its own block
    values, scales = quantize_rows(x, bits, block)
    restored = dequantize_rows(values, scales, n, bits, block)
    pad = torch.zeros(3, scales.shape[1] * block)
    pad[:, :n] = x.abs()
    half_step = (pad.view(3, -1, block).amax(2) / (2 * LEVELS[bits])).repeat_interleave(
        block, dim=1)[:, :n]  # (3, n): max|x in its block| / 2L
    error = (restored - x).abs()
    assert (error <= half_step * (1 + 1e-6)).all()
    assert torch.equal(restored[1], torch.zeros(n))
    if n >= 1000:  # rounding to nearest reaches its bound, not a fraction of it
        assert (error / half_step.clamp(min=1e-30)).max() > 0.9
    sent = values[0].numel() * values.element_size() + scales[0].numel() * 4
    assert sent == theory.quantized_bytes(n, bits, block)  # one row, as it travels


def test_int8_of_a_row_is_qwzs_int8():
    x = torch.randn(1000)
    q, scales = quantize_int8(x, 64)
    rows = quantize_rows(x.view(1, -1), 8, 64)
    assert torch.equal(q, rows[0][0]) and torch.equal(scales, rows[1][0])


def test_int4_packs_two_values_per_byte():
    values, _ = quantize_rows(torch.tensor([[-1.0, 1.0, 0.75]]), 4, 256)  # steps of 1/7
    assert values.dtype == torch.uint8 and values.shape == (1, 2)
    # -7 + 8 = 1 (low half), 7 + 8 = 15 (high half); round(5.25) + 8 = 13, then the pad
    assert values.tolist() == [[1 | 15 << 4, 13 | 0 << 4]]


# ---- the all-to-all and the reduce-scatter ----------------------------------------------------


def test_all_to_all_sends_chunk_j_to_rank_j(runs, at_two):
    for results in ([r["exchanges"] for r in runs], at_two):
        n = len(results)
        for rank, res in enumerate(results):  # chunk i came from rank i: its chunk `rank`
            expected = [3 * rank + e + 1000 * i for i in range(n) for e in range(3)]
            assert res["swapped"].tolist() == expected


def test_all_to_all_ring_model_is_every_chunk_but_ones_own():
    assert [theory.rank_sent_bytes("all_to_all", 120, n) for n in (1, 2, 3, 4)] == [0, 60, 80, 90]
    assert theory.ring_sent_bytes("alltoall", 120, 4) == 90


def test_all_to_all_on_one_process_copies():
    x, out = torch.arange(6.0), torch.empty(6)
    with zerolab.record_comm() as log:
        comm.all_to_all(out, x, tag="test/local")
    assert torch.equal(out, x)
    assert [(e.op, e.nbytes, e.ring_bytes, e.wire_bytes) for e in log.events] == [
        ("all_to_all", 24, 0, 0)]



def check_cases(results: list[dict], world_size: int) -> None:
    for (node_size, bits) in results[0]["cases"]:
        bound = lesson.rounding_bound(results[0]["largest"], bits, world_size, node_size)
        for rank, res in enumerate(results):
            error = res["cases"][(node_size, bits)]["error"]
            assert 0 < error <= bound, (world_size, node_size, bits, rank, error, bound)


def test_qgz_is_the_fp32_reduce_scatter_within_its_bound_at_4(runs):
    """2 x 2 (two hops), 4 nodes of 1 (across only), 1 node of 4 (inside only)."""
    check_cases([r["exchanges"] for r in runs], 4)


def test_qgz_is_the_fp32_reduce_scatter_within_its_bound_at_2(at_two):
    """1 node of 2: the inside hop only; 2 nodes of 1: the across hop only."""
    check_cases(at_two, 2)


def test_int4_rounds_coarser_than_int8(runs):
    cases = runs[0]["exchanges"]["cases"]
    assert cases[(2, 4)]["error"] > 5 * cases[(2, 8)]["error"]


def test_all_to_all_bytes_are_their_formula(runs, at_two):
    for results, n in (([r["exchanges"] for r in runs], 4), (at_two, 2)):
        for (k, bits), case in results[0]["cases"].items():
            r = n // k
            hops = {".node.": (k, r * W.CHUNK), ".across.": (r, W.CHUNK)}  # group, row length
            formula = dict(zip(hops, theory.qgz_sent_bytes(n * W.CHUNK, n, k, bits)))
            for hop, (size, row) in hops.items():
                events = [e for e in case["log"].events if hop in e.tag]
                assert (len(events) == 2) == (size > 1), (n, k, hop)  # values and scales
                if size == 1:
                    assert formula[hop] == 0
                    continue
                values, scales = events
                assert values.op == scales.op == "all_to_all"
                assert values.nbytes == size * -(-row * bits // 8)
                assert scales.nbytes == size * 4 * -(-row // 256)
                for e in events:
                    assert len(e.group_ranks) == size
                    assert e.ring_bytes == theory.rank_sent_bytes("all_to_all", e.nbytes, size)
                    assert e.ring_bytes == (size - 1) * e.nbytes // size
                ring = values.ring_bytes + scales.ring_bytes
                assert ring == formula[hop]
                wire = values.wire_bytes + scales.wire_bytes  # the two overlap: their sum
                assert ring <= wire <= ring + 2 * (size - 1) * HEADERS, (n, k, hop, wire, ring)


def test_bytes_across_nodes_are_a_third_of_fp32s_at_most(runs):
    numel = 4 * W.CHUNK
    fp32_formula = (4 - W.NODE) * 4 * W.CHUNK  # a chunk to each rank of the other node
    qgz_formula = theory.qgz_sent_bytes(numel, 4, W.NODE)[1]
    for rank, res in enumerate(r["peers"] for r in runs):
        across = {way: sum(b for peer, b in to.items() if peer // W.NODE != rank // W.NODE)
                  for way, to in res.items()}
        assert fp32_formula <= across["fp32"] <= fp32_formula + 2 * HEADERS, (rank, res)
        assert qgz_formula <= across["qgz"] <= qgz_formula + 2 * HEADERS, (rank, res)
        assert across["qgz"] <= across["fp32"] / 3, across
        peers = {p for p, b in res["qgz"].items() if b > 0}
        partner = rank + W.NODE if rank < W.NODE else rank - W.NODE  # its `across` group
        assert peers == {rank ^ 1, partner}, (rank, res)  # its node, and one rank across


# ---- the engine ------------------------------------------------------------------------------


def test_engines_are_zero3_bit_for_bit_when_qgz_is_off(runs):
    for res in runs:
        assert max_diff(res["zeropp_off"], res["engines"]["zero3"]["state"]) == 0.0


def test_quantize_grads_builds_zeropp_with_its_nodes(runs):
    for name in ("qgz", "qgz+hpz", "qgz int4"):
        assert runs[0]["engines"][name]["type"] == "ZeroPP"
        assert runs[0]["engines"][name]["node_size"] == W.NODE


def test_engine_gradients_are_zero3s_within_the_bound(runs):
    for res in runs:
        exact = res["engines"]["zero3"]["grads"]
        for name, bits in (("qgz", 8), ("qgz+hpz", 8), ("qgz int4", 4)):
            got = res["engines"][name]
            bound = lesson.rounding_bound(got["largest"], bits)
            assert 0 < (got["grads"] - exact).abs().max() <= bound, name
        # two micro-batches, each reduced on its own, added in grad_shard: twice the bound
        acc = res["accumulated"]
        bound = 2 * lesson.rounding_bound(acc["qgz"]["largest"], 8)
        assert 0 < (acc["qgz"]["grads"] - acc["zero3"]["grads"]).abs().max() <= bound


def test_what_makes_no_sense_is_refused(runs):
    refused = runs[0]["refused"]
    assert refused["no nodes"].startswith("ValueError: qgZ reduces inside each node")
    assert "node_size=k" in refused["no nodes"]
    assert "secondary_shard_size=4 and node_size=2 name different nodes" in refused["two nodes"]
    assert refused["uneven"] == "ValueError: 4 ranks do not split into nodes of node_size=3"
    assert refused["hsdp"] == ("TypeError: HSDP takes no quantize_grads: ZeRO++'s options build "
                               "zerolab.ZeroPP(model, optimizer_cls, quantize_grads=..., ...)")


def test_refused_before_any_process_group():
    model = zerolab.models.GPT(W.CONFIG)
    with pytest.raises(TypeError, match="node_size=2 says where qgZ's nodes are, and qgZ is "
                                        "off: pass quantize_grads=True"):
        zerolab.ZeroPP(model, torch.optim.AdamW, node_size=2)
    with pytest.raises(ValueError, match=r"quantize_grads='fp8': expected True \(int8\), "
                                         "'int8' or 'int4'"):
        zerolab.ZeroPP(model, torch.optim.AdamW, quantize_grads="fp8", node_size=2)
    with pytest.raises(ValueError, match="qgZ needs a process group"):
        zerolab.ZeroPP(model, torch.optim.AdamW, quantize_grads=True, node_size=1)
    # ZeRO++'s options on plain ZeRO-3 (the old spelling) name the class that takes them.
    with pytest.raises(TypeError, match=r"ZeRO3 takes no node_size, quantize_grads: ZeRO\+\+'s "
                                        r"options build zerolab.ZeroPP\(model, optimizer_cls, "
                                        r"node_size=\.\.\., \.\.\.\)"):
        zerolab.ZeRO3(model, torch.optim.AdamW, quantize_grads=True, node_size=2)


# ---- notebook 09's lesson: bytes and loss ------------------------------------------------------


def test_lesson_bytes_across_are_their_formula(lessons):
    units = len(n09_nodes.unit_numels())
    for way in lesson.WAYS:
        formula = lesson.formula_across(way)
        messages = 2 * units  # per unit, fp32: to 2 ranks across; qgZ: values and scales
        for run in lessons:
            assert formula <= run.gradients.across[way] <= formula + messages * HEADERS, way
    mean = {way: sum(r.gradients.across[way] for r in lessons) / 4 for way in lesson.WAYS}
    assert mean["qgZ int8"] <= mean["fp32"] / 3
    assert mean["qgZ int4"] < mean["qgZ int8"]
    assert len(lesson.bytes_table(lessons)) == 1 + len(lesson.WAYS)


def test_lesson_zeropp_steps_send_their_formula_across(lessons):
    """A whole training step, qgZ alone and ZeRO++ whole: n09_nodes.formula, as for the others
    (gloo's headers on top: at most 1024 B per collective that crosses, as test_lessons_09)."""
    numels = n09_nodes.unit_numels()
    for variant in n09_nodes.QGZ_VARIANTS:
        formula = sum(n09_nodes.formula(variant, numels).values())
        crossing = sum(1 for e in lessons[0].traffic[variant].log.events
                       if len({r // W.NODE for r in e.group_ranks}) > 1)
        measured = n09_nodes.across_mean(lessons, variant)
        assert formula <= measured <= formula + 1024 * crossing, variant
    zero3 = sum(n09_nodes.formula("ZeRO-3", numels).values())  # the paper: 3 M -> 0.75 M
    assert n09_nodes.across_mean(lessons, "ZeRO++ (qwZ+hpZ+qgZ)") <= zero3 / 4


def test_lesson_gradients_land_within_the_bound(lessons):
    for run in lessons:
        g = run.gradients
        assert g.error["fp32"] == 0.0
        for way in ("qgZ int8", "qgZ int4"):
            assert 0 < g.error[way] <= g.bound[way], way


def test_loss_with_qgz_stays_within_2_percent_of_fp32(lessons):
    """Short curves here (the notebook's 200 steps: the report's table); the final loss is
    the mean over the last steps of the loss on the global batch."""
    final = lesson.final_losses(lessons, last=10)
    for way in ("qgZ int8", "qgZ int4"):
        assert abs(final[way] - final["fp32"]) <= 0.02 * final["fp32"], final
        assert lessons[0].curves[way] != lessons[0].curves["fp32"]  # the rounding is there
    assert final["fp32"] < lessons[0].curves["fp32"][0] - 0.5  # and training went somewhere
    rows = lesson.drift_table(lessons, last=10)
    assert rows[1].split()[:2] == ["fp32", str(CURVE_STEPS)] and rows[1].endswith("+0.00%")


# ---- notebook 09's tables and its one launch -------------------------------------------------


def test_lesson_bytes_inside_the_node_are_their_formula(lessons):
    """fp32: a chunk to the other rank of the node; qgZ: the hop inside (theory.qgz_sent_bytes),
    values and scales per unit. peer_table prints these, and what each peer got."""
    units = len(n09_nodes.unit_numels())
    for way in lesson.WAYS:
        formula = lesson.formula_inside(way)
        for rank, run in enumerate(lessons):
            inside = run.gradients.to[way][rank ^ 1]  # the other rank of its node
            assert formula <= inside <= formula + 2 * units * HEADERS, (way, rank)
    assert lesson.formula_inside("qgZ int8") < lesson.formula_inside("fp32") / 1.9  # R = 2 chunks
    rows = lesson.peer_table(lessons)
    assert len(rows) == 1 + len(lesson.WAYS)
    qgz_row = rows[2].split()  # "qgZ int8", to 1, to 2, to 3 (0: rank 0 sends rank 3 nothing)
    assert qgz_row[:2] == ["qgZ", "int8"] and qgz_row[4] == "0"
    assert qgz_row[3] == f"{lessons[0].gradients.across['qgZ int8']:,}"


def test_traffic_table_takes_the_qgz_steps(lessons):
    """n09_nodes.traffic_table over qgZ's steps: each row's measured share is across_mean / M;
    its default (nodes_lesson's runs) is unchanged: the ZeRO++ row says qgZ was not measured."""
    rows = n09_nodes.traffic_table(lessons, list(n09_nodes.QGZ_VARIANTS), lesson.PAPER_STEPS)
    m = 4 * sum(n09_nodes.unit_numels().values())
    for row, variant in zip(rows[2:], n09_nodes.QGZ_VARIANTS):
        assert row.startswith(variant)
        assert row.split("|")[2].split()[0] == f"{n09_nodes.across_mean(lessons, variant) / m:.3f}"
    assert rows[2].split("|")[0].split()[-1] == "2.25"  # the paper's: 1 + 1 + 0.25
    stand_in = n09_nodes.NodesLesson({v: lessons[0].traffic["qgZ"] for v in n09_nodes.VARIANTS},
                                     {}, 0.0, 0.0, {})  # any step: only the last row counts
    assert "(qgZ not built)" in n09_nodes.traffic_table([stand_in] * 4)[-1]


def test_curve_drift_is_against_the_first_curve():
    rows = lesson.curve_drift({"a": [4.0, 2.0, 2.0], "b": [4.0, 3.0, 2.2]}, last=2)
    assert rows[1].split() == ["a", "3", "2.00", "+0.0%", "0.00"]
    assert rows[2].split() == ["b", "3", "2.60", "+30.0%", "1.00"]


def test_the_shared_fp32_curve_is_the_same_run_in_every_launch(lessons):
    """notebook_lesson trains ZeRO-3's fp32 curve once for nodes_lesson and qgz_lesson: a
    separate launch of it gives the same losses, bit for bit."""
    again = zerolab.launch(n09_nodes.loss_curve, 4, args=(False, 3), timeout=300)
    assert [r for r in again] == [run.curves["fp32"][:3] for run in lessons]
