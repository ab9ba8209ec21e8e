"""Workers for tests/test_qgz.py: ZeRO++'s qgZ, gradients quantised and reduced in two hops."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zerolab
from zerolab import comm, engines, harness, models
from zerolab.parts.mesh import make_nodes
from zerolab.parts.qgz import quantized_reduce_scatter
from zerolab.wire.peers import record_peer_bytes
from zerolab.zeropp import ZeroPP

CHUNK = 5000  # elements each rank owns: rows of R·CHUNK, not a multiple of the 256-block
CONFIG = models.GPTConfig(n_layer=2, n_embd=32, n_head=2)
GLOBAL_BATCH = 8
NODE = 2
REPEATS = 5  # per-peer bytes: the fewest over identical runs (a loopback resend only adds)


def _largest(x: torch.Tensor) -> float:
    """max |x| over every rank."""
    m = x.abs().max().clone()
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    return m.item()


def rank_input(rank: int, world_size: int) -> torch.Tensor:
    """(world_size * CHUNK,): magnitudes from 0.01 to 1 along the tensor, times rank + 1, so
    that blocks differ in scale and so do ranks."""
    gen = torch.Generator().manual_seed(100 + rank)
    n = world_size * CHUNK
    scale = torch.logspace(-2, 0, n)[torch.randperm(n, generator=gen)]
    return torch.randn(n, generator=gen) * scale * (rank + 1)


def exchanges(cases: list[tuple[int, int]]) -> dict:
    """Per (ranks per node, bits): qgZ's reduce-scatter against the fp32 one on the same
    input, and its comm log."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x = rank_input(rank, world_size)
    exact = torch.empty(CHUNK)
    comm.reduce_scatter(exact, x, op="avg", tag="test/fp32")
    coded = torch.arange(3 * world_size) + 1000 * rank  # chunk j: 3 values, for rank j
    swapped = torch.empty_like(coded)
    comm.all_to_all(swapped, coded, tag="test/all_to_all")
    out = {"largest": _largest(x), "cases": {}, "swapped": swapped}
    for node_size, bits in cases:
        nodes = make_nodes(node_size)
        got = torch.empty(CHUNK)
        with zerolab.record_comm() as log:
            quantized_reduce_scatter(got, x, nodes, tag=f"test/{node_size}/int{bits}",
                                     bits=bits).wait()
        out["cases"][(node_size, bits)] = {"error": (got - exact).abs().max().item(),
                                          "log": log}
    return out


def peer_bytes() -> dict[str, dict[int, int]]:
    """Bytes to each peer: ZeRO-3's fp32 reduce-scatter, and qgZ int8 on nodes of NODE.

    Each block ends with a barrier: every rank has then received all it was sent, so no byte
    still queued in a socket is left to the next block. The barrier's own bytes, measured
    alone, are taken off."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, nodes = rank_input(rank, world_size), make_nodes(NODE)
    calls = {"fp32": lambda out: comm.reduce_scatter(out, x, op="avg", tag="test/fp32"),
             "qgz": lambda out: quantized_reduce_scatter(out, x, nodes, tag="test/qgz").wait(),
             "barrier": lambda out: None}
    runs: dict[str, list[dict[int, int]]] = {way: [] for way in calls}
    for _ in range(REPEATS):
        for way, call in calls.items():
            with record_peer_bytes() as sent:
                call(torch.empty(CHUNK))
                dist.barrier()
            runs[way].append(sent.to)
    fewest = {way: {peer: min(m.get(peer, 0) for m in measured) for peer in range(world_size)
                    if peer != rank} for way, measured in runs.items()}
    return {way: {peer: b - fewest["barrier"][peer] for peer, b in fewest[way].items()}
            for way in ("fp32", "qgz")}


ENGINES = {  # name -> keyword arguments of zerolab.ZeroPP (none: plain zerolab.ZeRO3)
    "zero3": {},
    "qgz": {"quantize_grads": True, "node_size": NODE},
    "qgz+hpz": {"quantize_grads": True, "secondary_shard_size": NODE},
    "qgz int4": {"quantize_grads": "int4", "node_size": NODE},
}


def _batch(model, step: int):
    return harness.local_batch(model.make_batch, GLOBAL_BATCH, 200 + step, dist.get_rank(),
                               dist.get_world_size())


def train(kwargs: dict, steps: int = 3, micro_batches: int = 1) -> dict:
    """zerolab.ZeroPP(..., **kwargs) (ZeRO3 without kwargs): the averaged gradient shards of
    the first step, the weights after `steps`, and the largest gradient value any rank
    computed (for the bound)."""
    model = models.GPT(CONFIG)
    engine = (zerolab.ZeroPP if kwargs else zerolab.ZeRO3)(model, torch.optim.AdamW, lr=1e-2,
                                                          **kwargs)
    plain = models.GPT(CONFIG)  # this rank's own gradients: what qgZ rounds
    x, y = _batch(plain, 0)
    plain.loss(plain(x), y).backward()
    largest = _largest(torch.cat([p.grad.flatten() for p in plain.parameters()]))
    grads = None
    for step in range(steps):
        harness.train_step(engine, *_batch(model, step), zero_grad=False,
                           micro_batches=micro_batches, no_sync=False)
        if step == 0:
            grads = torch.cat([b.grad_shard.clone() for b in engine.buckets])
        engine.zero_grad()
    return {"type": type(engine).__name__, "grads": grads, "state": engine.full_state_dict(),
            "largest": largest, "node_size": getattr(engine.nodes, "size", None)
            if isinstance(engine, ZeroPP) else None}


def everything() -> dict:
    """The 4-rank launch: exchanges at 2 x 2, 4 x 1, 1 x 4; per-peer bytes; the engines."""
    out = {"exchanges": exchanges([(2, 8), (2, 4), (1, 8), (4, 8)]), "peers": peer_bytes()}
    out["engines"] = {name: train(kwargs) for name, kwargs in ENGINES.items()}
    out["accumulated"] = {name: train(ENGINES[name], steps=1, micro_batches=2)
                          for name in ("zero3", "qgz")}
    out["zeropp_off"] = _zeropp_off()
    out["refused"] = refusals()
    return out


def _zeropp_off() -> dict[str, torch.Tensor]:
    """ZeroPP itself with every option off: ZeRO-3, bit for bit."""
    model = models.GPT(CONFIG)
    engine = ZeroPP(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        harness.train_step(engine, *_batch(model, step))
    return engine.full_state_dict()


def refusals() -> dict[str, str]:
    """What the engines say to qgZ arguments that make no sense (on 4 ranks)."""
    cases = {
        "no nodes": lambda: zerolab.ZeroPP(models.GPT(CONFIG), torch.optim.AdamW,
                                           quantize_grads=True),
        "two nodes": lambda: zerolab.ZeroPP(models.GPT(CONFIG), torch.optim.AdamW,
                                            quantize_grads=True, node_size=2,
                                            secondary_shard_size=4),
        "uneven": lambda: zerolab.ZeroPP(models.GPT(CONFIG), torch.optim.AdamW,
                                         quantize_grads=True, node_size=3),
        "hsdp": lambda: engines.make_engine("hsdp", models.GPT(CONFIG), torch.optim.AdamW,
                                            shard_size=2, quantize_grads=True),
    }
    out = {}
    for name, build in cases.items():
        try:
            build()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def at_two() -> dict:
    """N = 2: one node of 2 (inside only) and two nodes of 1 (across only), int8 and int4."""
    return exchanges([(2, 8), (1, 8), (2, 4), (1, 4)])
