"""ZeRO++ (zerolab/zeropp.py) past one node, on one machine: 4 ranks as 2 "nodes" of 2
consecutive ranks. qwZ (int8 weights in the forward all-gather) and hpZ (a secondary shard
inside the node for backward): how they train, what they hold, and the bytes each rank sends to
the other node, measured per TCP connection (zerolab.wire.peers).

The ranks' results come from a launch shared with test_hsdp.py and test_peers.py (conftest.py:
nodes_at_4).
"""

from __future__ import annotations

from workers import nodes as W
from workers.nodes import YARDSTICK_MULTIPLE

from zerolab.harness import max_diff
from zerolab.models import GPT, num_params

PSI = num_params(GPT(W.CONFIG))  # 117,024: every shard size here divides it


def test_hpz_trains_like_ddp(nodes_at_4, nodes_reference):
    yardstick = max_diff(nodes_at_4[0]["torch_ddp"], nodes_reference)  # torch DDP's distance
    for res in nodes_at_4:
        assert max_diff(res["hpz"]["sgd_state"], nodes_reference) <= YARDSTICK_MULTIPLE * max(
            yardstick, 1e-7)


def test_qwz_trains_close_to_but_not_exactly_like_ddp(nodes_at_4, nodes_reference):
    """int8 weights in the forward: the loss surface moves a little, training does not break."""
    exact = max_diff(nodes_at_4[0]["zero3"]["sgd_state"], nodes_reference)
    quantized = max_diff(nodes_at_4[0]["qwz"]["sgd_state"], nodes_reference)
    assert quantized > 10 * max(exact, 1e-7)  # the quantisation shows
    assert quantized < 1e-2  # and stays small: a few steps, lr 1e-2


def test_hpz_keeps_a_secondary_shard_between_forward_and_backward(nodes_at_4):
    """Its cost: up to Ψ/k more parameter bytes, held from a unit's forward to its backward."""
    for res in nodes_at_4:
        extra = res["hpz"]["max"]["params"] - res["zero3"]["max"]["params"]
        assert 0 < extra <= 4 * PSI // W.NODE + 4096


def test_qwz_sends_a_quarter_of_the_forward_gather(nodes_at_4):
    def forward_gather_wire(log):
        return sum(e.wire_bytes for e in log.events if e.op == "all_gather" and "/fwd/" in e.tag)
    for res in nodes_at_4:
        ratio = forward_gather_wire(res["qwz"]["log"]) / forward_gather_wire(res["zero3"]["log"])
        assert 0.25 <= ratio <= 0.30, ratio  # int8 values + one fp32 scale per 256


def test_hpz_gathers_backward_inside_the_node(nodes_at_4):
    for res in nodes_at_4:
        rank = res["hpz"]["peers"].rank
        node = tuple(range(rank // W.NODE * W.NODE, (rank // W.NODE + 1) * W.NODE))
        backward = [e for e in res["hpz"]["log"].events
                    if e.op == "all_gather" and "/bwd/" in e.tag]
        assert backward and all(e.group_ranks == node for e in backward)


def test_every_zeropp_option_cuts_the_inter_node_bytes(nodes_at_4):
    across = {v: sum(res[v]["peers"].across(W.NODE) for res in nodes_at_4) for v in W.MEASURED}
    assert across["hsdp"] < across["qwz+hpz"] < across["hpz"] < across["zero3"]
    assert across["qwz+hpz"] < across["qwz"] < across["zero3"]
