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


def test_a_block_ends_when_its_bytes_have_left_the_send_queues():
    """A write returns once its bytes are queued: wait_sent waits until every TCP socket of
    the process has sent them (and says so), so that the counters read after it hold them."""
    import socket
    import threading

    from zerolab.wire import peers

    server = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(server.getsockname())
    receiver, _ = server.accept()
    try:
        sender.setblocking(False)
        queued = 0
        try:  # more than the receiver's buffer takes: the rest waits in the sender's queue
            while True:
                queued += sender.send(b"x" * 65536)
        except BlockingIOError:
            pass
        assert not peers.wait_sent(timeout=0.2)  # nobody reads: still queued
        got = 0

        def drain():
            nonlocal got
            while got < queued:
                got += len(receiver.recv(1 << 20))

        reader = threading.Thread(target=drain)
        reader.start()
        assert peers.wait_sent(timeout=10)
        reader.join(10)
        assert got == queued, (got, queued)
        sent = peers.connections()[(sender.getsockname()[:2], sender.getpeername()[:2])]
        assert sent == queued
    finally:
        for s in (sender, receiver, server):
            s.close()
