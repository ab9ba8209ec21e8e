"""Bytes per peer (zerolab/wire/peers.py), measured per TCP connection, against the bytes the
process wrote (zerolab/wire/written.py): DDP, ZeRO-3, HSDP and ZeRO++ on 4 ranks as 2 "nodes" of 2.

The ranks' results come from a launch shared with test_hsdp.py and test_zeropp.py (conftest.py:
nodes_at_4).
"""

from __future__ import annotations

import pytest
from workers import nodes as W


def test_peer_bytes_add_up_to_the_wire_bytes(nodes_at_4):
    """Per connection (TCP_INFO) and per process (the write counter): the same bytes."""
    for res in nodes_at_4:
        for variant in W.MEASURED:
            peers, log = res[variant]["peers"], res[variant]["log"]
            assert sum(peers.to.values()) == pytest.approx(log.total_wire_bytes(), rel=0.03)
