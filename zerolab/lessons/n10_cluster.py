"""Notebook 10's cluster: the link model with published figures, set beside published runs.

A MODEL, not a measurement: the formulas of zerolab.cost (alpha per message, beta per byte,
the messages of NCCL's rings), with link bandwidths and compute rates as their sources publish
them. Every figure below carries its source; `ALPHA` is the one assumption.

The link. Inside a node of 8 GPUs a ring runs over NVLink. Across nodes NCCL lays one ring per
network card (a GPU's own NIC): each ring crosses nodes through its own card, so a card carries
1/8 of the bytes and a GPU's share of the network is 8 cards' worth, unless NVLink is slower:
beta = max(1 / NVLink, 1 / (8 · NIC)). A ring still runs N - 1 (or 2(N - 1)) steps across all
N GPUs, each costing ALPHA.

A step. Each stage's collectives (zerolab.theory.STEP_COLLECTIVES) move the whole model:
parameters gathered in bf16 (2 bytes each), gradients reduced in fp32 (4 bytes: the
mixed-precision default of FSDP in torchtitan), in L pieces: ZeRO-3 gathers and reduces one
layer at a time, and the other stages' buckets are taken a layer each (torch DDP's default of
25 MiB would mean a thousand buckets for a 7B model, each paying every ring step). Compute is
the published tokens per GPU of one step over the published rate at 8 GPUs. Two bounds:
nothing hides (compute + communication) and everything hides (the larger of the two).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zerolab import cost, theory, threshold
from zerolab.wire.messages import messages

ALPHA = 10e-6  # seconds per ring step across the network: an assumed round figure, no source
HBM = 80e9  # bytes per H100 80GB / A100 80GB

NVIDIA_A100 = "https://www.nvidia.com/en-us/data-center/a100/"
NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/"
FOUNDRY = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/"
           "README.md")
TITAN = "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
PLAYBOOK = "https://huggingface.co/spaces/nanotron/ultrascale-playbook"
ETHERNET = "https://en.wikipedia.org/wiki/100_Gigabit_Ethernet"


@dataclass(frozen=True)
class Cluster:
    """Links of one published cluster, per GPU and per direction, bytes per second."""

    name: str
    nvlink: float  # inside a node
    nic: float  # each GPU's network card
    gpus_per_node: int = 8

    def link(self, world_size: int) -> cost.Link:
        """The ring's link on `world_size` GPUs: NVLink in one node, else NVLink or 8 NICs."""
        bandwidth = self.nvlink if world_size <= self.gpus_per_node else min(
            self.nvlink, self.gpus_per_node * self.nic)
        return cost.Link.from_figures(ALPHA, bandwidth, backend="nccl")


# NVLink: 600 GB/s (A100) and 900 GB/s (H100) per GPU in both directions together [NVIDIA]:
# 300 and 450 GB/s each way. NICs: MosaicML's A100s, 1600 Gb/s per node of 8 [FOUNDRY]: 25 GB/s
# a GPU; torchtitan's H100s, 400 Gb/s per GPU [TITAN]: 50 GB/s. MosaicML's H100 network is not
# in [FOUNDRY]: the H100 runs below use torchtitan's cluster. Ethernet: 100 Gb/s per node.
A100 = Cluster("A100, NVLink 3 + 200 Gb/s RoCE per GPU", 300e9, 25e9)
H100 = Cluster("H100, NVLink 4 + 400 Gb/s InfiniBand per GPU", 450e9, 50e9)
H100_ETHERNET = Cluster("H100, NVLink 4 + 100 Gb/s Ethernet per node", 450e9, 12.5e9 / 8)


@dataclass(frozen=True)
class Workload:
    """A published training run: model, tokens per GPU per step, throughput at 8 GPUs."""

    name: str
    params: float  # Ψ
    layers: int  # ZeRO-3's units, and the buckets of the other stages
    tokens_per_gpu: int  # per optimizer step (micro-batch x accumulation x sequence)
    rate: float  # published tokens per second per GPU, 8 GPUs
    cluster: Cluster
    source: str


WORKLOADS = (
    # MPT-125M (GPT-2 small's size), A100 80GB, 8 GPUs, FULL_SHARD, 2048 tokens, micro-batch
    # 40, 2 accumulation steps: 142,830 tokens/s/GPU [FOUNDRY]
    Workload("GPT-2 small (MPT-125M)", 125_311_488, 12, 40 * 2 * 2048, 142_830, A100, FOUNDRY),
    # MPT-7B, H100 80GB, 8 GPUs, FULL_SHARD, 2048 tokens, micro-batch 6: 10,643 [FOUNDRY]
    Workload("7B (MPT-7B)", 6_658_859_008, 32, 6 * 2048, 10_643, H100, FOUNDRY),
    # Llama 3.1 8B, torchtitan FSDP, 8 H100s, local batch 2 of 8192 tokens: 5,762 [TITAN]
    Workload("8B (Llama 3.1 8B)", 8_030_261_248, 32, 2 * 8192, 5_762, H100, TITAN),
)

# Published tokens/s/GPU at more GPUs, all ZeRO-3 (FSDP FULL_SHARD), same per-GPU batch.
PUBLISHED = {
    ("7B (MPT-7B)", 128): (10_475, FOUNDRY), ("7B (MPT-7B)", 256): (10_119, FOUNDRY),
    ("7B (MPT-7B)", 512): (9_670, FOUNDRY), ("8B (Llama 3.1 8B)", 128): (5_605, TITAN),
}

# The Playbook's all-reduce of 256 MB on its H100 cluster, bus bandwidth (GB/s) by nodes of 8
# GPUs (median of its runs; "Pipeline Parallelism" section) [PLAYBOOK]
PLAYBOOK_BUSBW = {1: 436.0, 2: 361.7, 4: 160.1, 8: 99.6, 16: 84.7, 32: 64.9, 64: 32.9}
PLAYBOOK_BYTES = 256e6


def all_reduce_seconds(link: cost.Link, nbytes: float, world_size: int) -> float:
    """NCCL's all-reduce, as its tuner picks: the faster of a ring, alpha·2(N-1) + beta·2(N-1)/N·S,
    and a tree (reduce up, broadcast down), alpha·2·ceil(log2 N) + the same bytes."""
    n = world_size
    ring = link.predict("all_reduce", nbytes, n)
    tree = ring - link.alpha * 2 * (n - 1) + link.alpha * 2 * math.ceil(math.log2(n))
    return min(ring, tree)


def all_reduce_busbw(cluster: Cluster, nbytes: float, world_size: int) -> float:
    """The model's bus bandwidth (bytes/s) of one all-reduce of `nbytes` on `world_size` GPUs."""
    seconds = all_reduce_seconds(cluster.link(world_size), nbytes, world_size)
    return cost.busbw("all_reduce", nbytes, seconds, world_size)


_BYTES = {"all_gather": 2, "reduce_scatter": 4, "all_reduce": 4}  # bf16 params, fp32 grads


@dataclass(frozen=True)
class StepModel:
    """One stage of one workload on N GPUs, by the model (seconds, tokens/s/GPU)."""

    workload: str
    stage: str
    world_size: int
    state_bytes: float  # model states per GPU (mixed precision, Adam)
    compute: float  # tokens per GPU / published rate at 8 GPUs
    latency: float  # the alpha terms of the step's collectives
    transfer: float  # the beta terms

    @property
    def fits(self) -> bool:
        return self.state_bytes <= HBM

    @property
    def comm(self) -> float:
        return self.latency + self.transfer

    def tokens_per_s(self, tokens: int, overlap: bool) -> float:
        """Throughput if everything hides (overlap=True) or nothing does."""
        step = max(self.compute, self.comm) if overlap else self.compute + self.comm
        return tokens / step


def step_model(w: Workload, stage: str, world_size: int) -> StepModel:
    """The step of `w` with `stage` on `world_size` GPUs (see the module's docstring)."""
    n, link = world_size, w.cluster.link(world_size)
    latency = transfer = 0.0
    for op in theory.STEP_COLLECTIVES[stage]:
        total = _BYTES[op] * w.params  # the whole model in this collective's dtype
        pieces = w.layers  # one unit (ZeRO-3) or bucket (the others) per layer
        m = messages(op, total / pieces, n, "nccl")
        transfer += pieces * m.nbytes * link.beta
        if op == "all_reduce":  # ring or tree, whichever is faster (all_reduce_seconds)
            latency += pieces * (all_reduce_seconds(link, total / pieces, n)
                                 - m.nbytes * link.beta)
        else:
            latency += pieces * m.count * link.alpha
    states = theory.model_state_memory(w.params, n, stage, precision="mixed").total
    return StepModel(w.name, stage, n, states, w.tokens_per_gpu / w.rate, latency, transfer)


def threshold_tokens(w: Workload, world_size: int) -> float:
    """T* of one of `w`'s layers as a ZeRO-3 unit on `world_size` GPUs: its bf16 gather against
    its forward at the run's own FLOP/s, C = 6Ψ · its tokens/s at 8 GPUs (zerolab.threshold)."""
    return threshold.tokens_to_hide("ZeRO-3", 6 * w.params * w.rate, w.cluster.link(world_size),
                                    round(w.params / w.layers), world_size, bytes_per_param=2)


def format_predicted() -> str:
    """Each published run at more GPUs, predicted: past T*, the communication hides (perfect
    overlap), so a GPU keeps its rate at 8 GPUs unless the step's communication outgrows its
    compute: tokens / max(compute, communication). The published figure, and the miss."""
    lines = [f"{'':20}{'N':>4}{'tokens/GPU':>11}{'T*':>7}{'predicted':>11}{'published':>11}"
             f"{'miss':>7}   (tokens/s/GPU; ZeRO-3)"]
    for (name, n), (published, _) in PUBLISHED.items():
        w = next(w for w in WORKLOADS if w.name == name)
        r = step_model(w, "ZeRO-3", n)
        predicted = r.tokens_per_s(w.tokens_per_gpu, overlap=True)
        lines.append(f"{name:20}{n:>4}{w.tokens_per_gpu:>11,}{threshold_tokens(w, n):>7,.0f}"
                     f"{predicted:>11,.0f}{published:>11,}{predicted / published - 1:>+7.1%}")
    return "\n".join(lines)
