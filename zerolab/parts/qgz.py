"""qgZ's reduce-scatter (ZeRO++, Wang et al., 2023): quantised chunks, inside each node, then
across nodes. ZeroPP (zeropp.py) reduces its gradients with it when quantize_grads is on.

    quantized_reduce_scatter(out, full, nodes, tag="zeropp/bwd/blocks.0", bits=8).wait()
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerolab import comm
from zerolab.memory import InFlight
from zerolab.parts.mesh import Nodes
from zerolab.parts.quantize import dequantize_rows, quantize_rows
from zerolab.wire.backends import Joined

# Note: qgZ's reduce-scatter, on N = R·k ranks: R nodes of k consecutive ranks. Rank r = n·k + j
# (node n, place j) owns chunk r of the flat gradient, as in ZeRO-3; view the gradient as
# (R, k, c), c = 1/N of it per chunk, so that chunk m·k + j is [m, j].
# - Hop 1, inside the node: rank j of the node must end with the node's sum of the chunks it
#   will carry across, [m, j] for every node m. So each rank sends [:, j] (R·c values) to the
#   node's rank j: the gradient is reordered to (k, R·c) first (the paper's "tensor slice
#   reordering"), quantised row by row, exchanged in one all-to-all, dequantised and summed.
# - Hop 2, across nodes, between the ranks at place j of every node: the node's sum [m, j] is
#   re-quantised and sent to node m's rank j, who owns chunk m·k + j. Summed and divided by N:
#   this rank's averaged chunk, where ZeRO-3's reduce-scatter puts it.
# A ring reduce-scatter would have to quantise again at every one of its N-1 steps; here each
# value is rounded twice at most. Only hop 2 crosses nodes, and each rank carries 1/k of its
# node's share: of a gradient of P values, ZeRO-3's fp32 reduce-scatter sends (R-1)/R·P values
# of 4 bytes across, qgZ (R-1)/R·P/k of about 1 byte (theory.qgz_sent_bytes). A hop over one
# rank (nodes of one, or one node) sends nothing and rounds nothing.


def quantized_reduce_scatter(output: torch.Tensor, input: torch.Tensor, nodes: Nodes, *,
                             tag: str, bits: int = 8, in_flight: InFlight | None = None) -> Joined:
    """output (c,) <- the average over every rank of its input's (N·c,) chunk r, r this rank's
    place among the ranks of `nodes`: ZeRO-3's averaging reduce-scatter, with quantised chunks
    on the wire (see the Note). Hop 1 is issued now; wait() finishes it and runs hop 2 (with
    nodes of one rank, hop 2 is all there is, and wait() runs it)."""
    k, r, c = nodes.size, nodes.count, output.numel()
    rows = input.view(r, k, c).transpose(0, 1).reshape(k, r * c)  # (k, R·c): row j to rank j
    inside = _Hop(rows, bits, nodes.node, f"{tag}.node", in_flight)

    def across() -> None:
        node_sum = inside.received().sum(0).view(r, c)  # (R, c): [m] is chunk m·k + j's
        hop = _Hop(node_sum, bits, nodes.across, f"{tag}.across", in_flight)
        output.copy_(hop.received().sum(0).div_(k * r))  # (c,) every rank's chunk r, averaged

    return Joined(inside.handles, across)


class _Hop:
    """One all-to-all of quantised rows: row j of `rows` (group size, m) to the group's rank j."""

    def __init__(self, rows: torch.Tensor, bits: int, group: dist.ProcessGroup, tag: str,
                 in_flight: InFlight | None):
        self.bits, self.numel, self.handles = bits, rows.shape[1], []
        if dist.get_world_size(group) == 1:  # nothing leaves this rank: nothing to round
            self.local = rows
            return
        self.sent = quantize_rows(rows, bits)  # values (size, bytes per row), scales (size, b)
        self.q, self.scales = (torch.empty_like(t) for t in self.sent)  # row i: from rank i
        if in_flight is not None:
            in_flight.add(*self.sent, self.q, self.scales)
        self.handles = [
            comm.all_to_all(self.q, self.sent[0], tag=f"{tag}.int{bits}", group=group,
                            async_op=True),
            comm.all_to_all(self.scales, self.sent[1], tag=f"{tag}.scales", group=group,
                            async_op=True)]

    def received(self) -> torch.Tensor:
        """(group size, m) fp32: row i as rank i sent it, dequantised."""
        if not self.handles:
            return self.local
        for handle in self.handles:
            handle.wait()
        return dequantize_rows(self.q, self.scales, self.numel, self.bits)
