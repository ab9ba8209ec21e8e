"""HSDP (zerolab/hsdp.py) past one node, on one machine: 4 ranks as 2 "nodes" of 2 consecutive
ranks. ZeRO-3 inside a node, replicas across nodes: it trains like DDP, holds 16Ψ/k, and sends
only the replicas' all-reduce to the other node, measured per TCP connection (zerolab.wire.peers).

The ranks' results come from a launch shared with test_zeropp.py and test_peers.py (conftest.py:
nodes_at_4); checkpoints moving between HSDP and other stages are in test_checkpoint.py.
"""

from __future__ import annotations

import pytest
from workers import nodes as W
from workers.nodes import YARDSTICK_MULTIPLE

import zerolab
from zerolab.harness import max_diff
from zerolab.models import GPT, num_params

PSI = num_params(GPT(W.CONFIG))  # 117,024: every shard size here divides it


def test_hsdp_trains_like_ddp(nodes_at_4, nodes_reference):
    yardstick = max_diff(nodes_at_4[0]["torch_ddp"], nodes_reference)  # torch DDP's distance
    for variant in ("ddp", "zero3", "hsdp"):
        for res in nodes_at_4:
            assert max_diff(res[variant]["sgd_state"], nodes_reference) <= YARDSTICK_MULTIPLE * max(
                yardstick, 1e-7), variant


def test_hsdp_holds_16_psi_over_k(nodes_at_4):
    k = W.NODE
    for res in nodes_at_4:
        assert res["hsdp"]["held"]["params"] == 4 * PSI // k
        assert res["hsdp"]["held"]["grads"] == 4 * PSI // k
        assert res["zero3"]["held"]["params"] == 4 * PSI // 4


def test_hsdp_sends_only_its_replica_all_reduce_across_nodes(nodes_at_4):
    for res in nodes_at_4:
        log, peers = res["hsdp"]["log"], res["hsdp"]["peers"]
        replicas = [e for e in log.events if e.tag.endswith(".replicas")]
        assert replicas and all(e.group_ranks[1] - e.group_ranks[0] == W.NODE for e in replicas)
        # The ring model of those all-reduces: 2 nodes, so each sends its S once; S = this
        # rank's gradient shards, 4Ψ/k. (gloo adds ~576 bytes per call of its own.)
        ring = sum(e.ring_bytes for e in replicas)
        assert ring == 4 * PSI // W.NODE
        assert peers.across(W.NODE) == pytest.approx(ring, rel=0.03)


def test_a_world_that_does_not_split_into_nodes_is_refused():
    messages = zerolab.launch(W.uneven_world, 3, args=(2,))
    assert all("3 ranks do not split into nodes of 2" in m for m in messages), messages
