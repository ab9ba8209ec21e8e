"""Past one node, on one machine: 4 ranks as 2 "nodes" of 2 consecutive ranks.

HSDP (ZeRO-3 inside a node, replicas across nodes), ZeRO++'s qwZ (int8 weights in the forward
all-gather) and hpZ (a secondary shard inside the node for backward), and the bytes each rank
sends to each other rank, measured per TCP connection (zerolab.wire.peers).
"""

from __future__ import annotations

import pytest
from workers import nodes as W

import zerolab
from zerolab.harness import max_diff
from zerolab.models import GPT, num_params

PSI = num_params(GPT(W.CONFIG))  # 117,024: every shard size here divides it
YARDSTICK_MULTIPLE = 5


@pytest.fixture(scope="module")
def runs():
    return zerolab.launch(W.everything, 4, timeout=900)


@pytest.fixture(scope="module")
def reference():
    return W.reference()


def test_hsdp_and_hpz_train_like_ddp(runs, reference):
    yardstick = max_diff(runs[0]["torch_ddp"], reference)  # torch's own distance at 4 ranks
    for variant in ("ddp", "zero3", "hsdp", "hpz"):
        for res in runs:
            assert max_diff(res[variant]["sgd_state"], reference) <= YARDSTICK_MULTIPLE * max(
                yardstick, 1e-7), variant


def test_qwz_trains_close_to_but_not_exactly_like_ddp(runs, reference):
    """int8 weights in the forward: the loss surface moves a little, training does not break."""
    exact = max_diff(runs[0]["zero3"]["sgd_state"], reference)
    quantized = max_diff(runs[0]["qwz"]["sgd_state"], reference)
    assert quantized > 10 * max(exact, 1e-7)  # the quantisation shows
    assert quantized < 1e-2  # and stays small: a few steps, lr 1e-2


def test_hsdp_holds_16_psi_over_k(runs):
    k = W.NODE
    for res in runs:
        assert res["hsdp"]["held"]["params"] == 4 * PSI // k
        assert res["hsdp"]["held"]["grads"] == 4 * PSI // k
        assert res["zero3"]["held"]["params"] == 4 * PSI // 4


def test_hpz_keeps_a_secondary_shard_between_forward_and_backward(runs):
    """Its cost: up to Ψ/k more parameter bytes, held from a unit's forward to its backward."""
    for res in runs:
        extra = res["hpz"]["max"]["params"] - res["zero3"]["max"]["params"]
        assert 0 < extra <= 4 * PSI // W.NODE + 4096


def test_qwz_sends_a_quarter_of_the_forward_gather(runs):
    def forward_gather_wire(log):
        return sum(e.wire_bytes for e in log.events if e.op == "all_gather" and "/fwd/" in e.tag)
    for res in runs:
        ratio = forward_gather_wire(res["qwz"]["log"]) / forward_gather_wire(res["zero3"]["log"])
        assert 0.25 <= ratio <= 0.30, ratio  # int8 values + one fp32 scale per 256


def test_hsdp_sends_only_its_replica_all_reduce_across_nodes(runs):
    for res in runs:
        log, peers = res["hsdp"]["log"], res["hsdp"]["peers"]
        replicas = [e for e in log.events if e.tag.endswith(".replicas")]
        assert replicas and all(e.group_ranks[1] - e.group_ranks[0] == W.NODE for e in replicas)
        # The ring model of those all-reduces: 2 nodes, so each sends its S once; S = this
        # rank's gradient shards, 4Ψ/k. (gloo adds ~576 bytes per call of its own.)
        ring = sum(e.ring_bytes for e in replicas)
        assert ring == 4 * PSI // W.NODE
        assert peers.across(W.NODE) == pytest.approx(ring, rel=0.03)


def test_hpz_gathers_backward_inside_the_node(runs):
    for res in runs:
        rank = res["hpz"]["peers"].rank
        node = tuple(range(rank // W.NODE * W.NODE, (rank // W.NODE + 1) * W.NODE))
        backward = [e for e in res["hpz"]["log"].events
                    if e.op == "all_gather" and "/bwd/" in e.tag]
        assert backward and all(e.group_ranks == node for e in backward)


def test_every_zeropp_option_cuts_the_inter_node_bytes(runs):
    across = {v: sum(res[v]["peers"].across(W.NODE) for res in runs) for v in W.MEASURED}
    assert across["hsdp"] < across["qwz+hpz"] < across["hpz"] < across["zero3"]
    assert across["qwz+hpz"] < across["qwz"] < across["zero3"]


def test_peer_bytes_add_up_to_the_wire_bytes(runs):
    """Per connection (TCP_INFO) and per process (the write counter): the same bytes."""
    for res in runs:
        for variant in W.MEASURED:
            peers, log = res[variant]["peers"], res[variant]["log"]
            assert sum(peers.to.values()) == pytest.approx(log.total_wire_bytes(), rel=0.03)


def test_a_world_that_does_not_split_into_nodes_is_refused():
    messages = zerolab.launch(W.uneven_world, 3, args=(2,))
    assert all("3 ranks do not split into nodes of 2" in m for m in messages), messages


def test_checkpoints_move_between_world_sizes_and_stages(tmp_path):
    """Save at 4 ranks (ZeRO-3, HSDP); resume at 2 with ZeRO-2 and at 3 with HSDP: the run
    continues as if nothing happened."""
    straight = zerolab.launch(W.save_at_4, 4, args=(str(tmp_path),), timeout=600)[0]
    resumed = {
        "zero3 at 4 -> zero2 at 2": zerolab.launch(W.resume, 2, args=(
            "zero2", f"{tmp_path}/zero3"), timeout=600),
        "zero3 at 4 -> hsdp (3 per node) at 3": zerolab.launch(W.resume_hsdp, 3, args=(
            f"{tmp_path}/zero3", 3), timeout=600),
        "hsdp at 4 -> zero3 at 2": zerolab.launch(W.resume, 2, args=(
            "zero3", f"{tmp_path}/hsdp"), timeout=600),
    }
    for what, states in resumed.items():
        for state in states:
            assert max_diff(state, straight) < 1e-5, what
