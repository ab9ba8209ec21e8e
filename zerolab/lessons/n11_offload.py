"""Notebook 11, section 3: ZeRO-Offload's arithmetic, with this machine's AdamW.

ZeRO-Offload (Ren et al., 2021, https://arxiv.org/abs/2101.06840) keeps the fp32 parameters
and Adam's moments in CPU memory and steps them there; the GPU keeps fp16 parameters, computes
forward and backward, and each step moves 2Ψ bytes of fp16 gradients down the PCIe link and 2Ψ
bytes of fp16 parameters back up (the paper's 4M). With its one-step delayed parameter update
(DPU) the CPU's step runs while the GPU computes the next step, so offloading costs no step
time when

    max(Ψ / r, 2Ψ / B) <= T / τ

with r the CPU's AdamW rate (parameters per second, measured here), B the link's bytes per
second each way (published), T the tokens a GPU computes per step and τ its tokens per second
(published runs, notebook 10). Both sides grow with Ψ (τ falls as Ψ grows), so the break-even
batch hardly depends on the model's size: T* = τ · Ψ · max(1/r, 2/B).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from zerolab.lessons.n10_cluster import NVIDIA_A100, NVIDIA_H100, WORKLOADS, Workload
from zerolab.parts.tiles import CPU_TILE_NUMEL, OptimizerTiles

NUMEL = 1 << 23  # parameters stepped in each timing: 32 MiB in fp32, beyond any cache
PAPER = "https://arxiv.org/abs/2101.06840"
# PCIe per GPU, each direction: half of the vendors' both-directions figures, "PCIe Gen4:
# 64 GB/s" (A100) and "PCIe Gen5: 128 GB/s" (H100) [NVIDIA_A100, NVIDIA_H100]
PCIE = {"PCIe Gen4 x16 (A100)": (32e9, NVIDIA_A100), "PCIe Gen5 x16 (H100)": (64e9, NVIDIA_H100)}
WAYS = ("torch AdamW, for-loop (foreach=False)", "torch AdamW, foreach=True",
        "torch AdamW, fused=True", "zerolab tiles of 2^18, for-loop")
BYTES_PER_PARAM = 28  # AdamW reads p, g, m, v (16 B) and writes p, m, v (12 B), fp32


def _optimizer(way: str, flat: torch.nn.Parameter) -> torch.optim.Optimizer:
    if way == WAYS[3]:
        tiles = OptimizerTiles([flat], CPU_TILE_NUMEL)
        opt = torch.optim.AdamW(tiles.params(), lr=1e-3, foreach=False)
        tiles.attach(opt, keep_grads=True)
        return opt
    kwargs = {WAYS[0]: {"foreach": False}, WAYS[1]: {"foreach": True},
              WAYS[2]: {"fused": True}}[way]
    return torch.optim.AdamW([flat], lr=1e-3, **kwargs)


def adamw_seconds(way: str, numel: int = NUMEL, repeats: int = 5) -> float:
    """Median seconds of one AdamW step over one flat fp32 tensor of `numel` parameters (what
    a ZeRO rank steps: its flat shard), after a first step that creates the moments."""
    flat = torch.nn.Parameter(torch.zeros(numel))
    flat.grad = torch.full_like(flat, 1e-3)
    opt = _optimizer(way, flat)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def throughput(numel: int = NUMEL, repeats: int = 3) -> dict[str, float | str]:
    """Each way's median step seconds, or what refused to run (a str)."""
    out: dict[str, float | str] = {}
    for way in WAYS:
        try:
            out[way] = adamw_seconds(way, numel, repeats)
        except (RuntimeError, ValueError) as e:
            out[way] = f"does not run here: {str(e).splitlines()[0]}"
    return out


def offload_bytes(psi: float) -> dict[str, float]:
    """Bytes each step crosses the PCIe link, each way (ZeRO-Offload: fp16 both ways)."""
    return {"gradients, GPU to CPU (fp16)": 2 * psi, "parameters, CPU to GPU (fp16)": 2 * psi}


@dataclass(frozen=True)
class BreakEven:
    """One published workload with the optimizer offloaded to a CPU stepping r params/s."""

    workload: Workload
    cpu_step: float  # Ψ / r, seconds
    pcie: float  # 2Ψ / B, seconds each way
    tokens: float  # T*: tokens per GPU per step at which the GPU's compute covers both

    @property
    def published_compute(self) -> float:
        """Seconds of the published run's step on the GPU: T / τ."""
        return self.workload.tokens_per_gpu / self.workload.rate


def pcie_of(w: Workload) -> float:
    """The PCIe link of the workload's GPU, bytes per second each way."""
    return PCIE["PCIe Gen4 x16 (A100)" if w.cluster.name.startswith("A100")
                else "PCIe Gen5 x16 (H100)"][0]


def break_even(rate: float, workloads: tuple[Workload, ...] = WORKLOADS) -> list[BreakEven]:
    """For each workload: the CPU's step, its GPU's PCIe transfer, and T* = τ·max(Ψ/r, 2Ψ/B)."""
    out = []
    for w in workloads:
        cpu, link = w.params / rate, 2 * w.params / pcie_of(w)
        out.append(BreakEven(w, cpu, link, w.rate * max(cpu, link)))
    return out


def format_break_even(rows: list[BreakEven]) -> str:
    lines = [f"{'':26}{'CPU step':>9}{'PCIe':>7}{'GPU step':>9}{'T*, tokens':>12}"
             f"{'published T':>13}{'  T*/T':>7}"]
    for b in rows:
        w = b.workload
        ratio = b.tokens / w.tokens_per_gpu
        lines.append(f"{w.name:26}{b.cpu_step:>8.2f}s{b.pcie:>6.2f}s{b.published_compute:>8.2f}s"
                     f"{b.tokens:>12,.0f}{w.tokens_per_gpu:>13,}{ratio:>7.1f}")
    return "\n".join(lines)
