"""Bytes this rank sent to each other rank: which link the traffic crossed, measured.

    with zerolab.wire.peers.record_peer_bytes() as sent:     # collective: every rank enters
        ...                                             # a training step
    sent.to                                             # {peer rank: bytes}
    sent.across(node_size=2)                            # bytes that left this rank's "node"

`record_comm` measures what a rank wrote in all (the kernel's per-process counter); it cannot say
to whom. gloo keeps one TCP connection per pair of ranks (per process group), and the kernel
keeps, per connection, how many bytes it has sent (`tcpi_bytes_sent` in TCP_INFO, less
`tcpi_bytes_retrans`: a segment sent again counts once, as the process wrote it once; a busy
machine's loopback drops and resends a few). Reading those
counters before and after a block, and knowing which rank owns the other end of each
connection, gives the bytes sent to each peer: on one machine pretending to be several nodes,
the bytes that would have crossed the network.

Which rank owns a connection's far end: at entry, every rank lists the local addresses of its
own TCP sockets and the ranks exchange the lists. A connection opened inside the block (a
process group created there) or to the rendezvous store counts as `unmatched`. Linux only; None
elsewhere, and with NCCL (whose bytes do not go through sockets).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist

_TCP_INFO_BYTES_SENT = 200  # offset of tcpi_bytes_sent (u64) in struct tcp_info (Linux >= 4.19)
_TCP_INFO_BYTES_RETRANS = 208  # tcpi_bytes_retrans (u64): the part of it that was sent again
_TCP_INFO_BYTES_ACKED = 120  # tcpi_bytes_acked, for older kernels

Address = tuple[str, int]


@dataclass
class PeerBytes:
    """What one rank sent inside one `record_peer_bytes()` block."""

    rank: int
    to: dict[int, int] = field(default_factory=dict)  # peer rank -> bytes sent to it
    unmatched: int = 0  # bytes on connections whose far end is no rank's (store, new groups)

    def across(self, node_size: int) -> int:
        """Bytes sent to ranks outside this rank's node (nodes: node_size consecutive ranks)."""
        return sum(b for peer, b in self.to.items() if peer // node_size != self.rank // node_size)

    def within(self, node_size: int) -> int:
        """Bytes sent to the other ranks of this rank's node."""
        return sum(b for peer, b in self.to.items() if peer // node_size == self.rank // node_size)


def _tcp_sockets() -> Iterator[socket.socket]:
    """This process's connected TCP sockets, each as a second handle (closing it keeps the fd)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with s:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                yield s


def connections() -> dict[tuple[Address, Address], int] | None:
    """{(local address, peer address): bytes sent so far} for this process's TCP connections."""
    if not hasattr(socket, "TCP_INFO") or not os.path.isdir("/proc/self/fd"):
        return None
    out = {}
    for s in _tcp_sockets():
        try:
            peer, local = s.getpeername()[:2], s.getsockname()[:2]
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except OSError:  # a listening socket has no peer
            continue
        if len(info) >= _TCP_INFO_BYTES_RETRANS + 8:
            sent, resent = struct.unpack_from("QQ", info, _TCP_INFO_BYTES_SENT)
            out[(local, peer)] = sent - resent
        else:
            out[(local, peer)] = struct.unpack_from("Q", info, _TCP_INFO_BYTES_ACKED)[0]
    return out


def wait_sent(timeout: float = 5.0) -> bool:
    """Wait until every byte this process has written to its TCP sockets has left them (each
    send queue empty: SIOCOUTQ, bytes the peer has not yet acknowledged); whether it did
    within `timeout` seconds. A write returns once its bytes are queued, and the connection's
    counter grows as they are sent: on a busy machine the last bytes of a block can still be
    queued when it ends, and read then, they would be missed."""
    import fcntl  # Unix only, as the counters are
    import termios

    deadline = time.monotonic() + timeout
    while True:
        queued = 0
        for s in _tcp_sockets():
            try:
                queued += struct.unpack("i", fcntl.ioctl(s.fileno(), termios.TIOCOUTQ,
                                                         b"\0" * 4))[0]
            except OSError:  # a listening socket
                continue
        if not queued:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


@contextlib.contextmanager
def record_peer_bytes() -> Iterator[PeerBytes | None]:
    """Measure the bytes this rank sends to each rank inside the block (None: unavailable).

    Collective over the whole job: every rank must enter (the ranks exchange which socket
    addresses are theirs).
    """
    rank = dist.get_rank()
    before = connections()
    mine = sorted({local for local, _ in before}) if before is not None else []
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # before `before` is taken again: not counted
    owner = {address: r for r, addresses in enumerate(everyone) for address in addresses or ()}
    before = connections()
    sent = PeerBytes(rank) if before is not None and dist.get_backend() == "gloo" else None
    yield sent
    if sent is not None:
        wait_sent()
    after = connections()
    if sent is None or after is None:
        return
    for (local, peer), total in after.items():
        delta = total - before.get((local, peer), 0)
        if delta and peer in owner and owner[peer] != rank:
            sent.to[owner[peer]] = sent.to.get(owner[peer], 0) + delta
        elif delta:
            sent.unmatched += delta
