"""What `python -m zerolab.bench` runs: the engines, their torch counterparts, the targets,
the sizes (the course's GPT, GPT-2 small) and how they run (side by side, or in pairs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from zerolab import engines, harness
from zerolab.models import GPT, GPTConfig

# What runs: zerolab's four stages, then torch's three (their labels, counterparts and formula
# stages come from the registry, zerolab.engines). zerolab's are labelled "zerolab ..." here, to
# tell them from torch's in one table.
BENCHED = (*engines.STAGE_ENGINES, "torch_ddp", "torch_ddp_zero", "torch_fsdp2")
REFERENCE = "torch_ddp"  # whose final parameters every engine is compared with
COUNTERPARTS = {k: engines.ENGINES[k].counterpart for k in engines.STAGE_ENGINES}
# The largest acceptable ratio of overheads, each stage against its counterpart. An engine's
# overhead is what its step takes above the floor: the same model's forward and backward alone
# (no collective, no optimizer step), timed in the same round. On a CPU the forward and
# backward are most of a step and the same in every engine; what an engine adds is the rest.
# Checked on the median of the per-round ratios (both ran in every round, seconds apart).
OVERHEAD_TARGETS = {"ddp": 0.7, "zero1": 0.7, "zero2": 0.7, "zero3": 0.7}
MEMORY_TARGETS = {"zero3": 1.0}  # peak bytes per rank vs the counterpart's
TRACKER_LIMIT = 2.0  # a step under the comm recorder and the memory tracker / a plain step


def label(key: str) -> str:
    """How the bench's table names an engine: "zerolab ZeRO-2", "torch FSDP2 (fully_shard)"."""
    return engines.label(key, beside_torch=True)


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark. The defaults are the full run (>= 10M parameters, world size 2)."""

    world_size: int = 2  # ranks (spawned processes)
    vocab_size: int = 8192  # GPT vocabulary (with tied embeddings: vocab * n_embd parameters)
    block_size: int = 64  # longest sequence (position embeddings: block_size * n_embd params)
    seq_len: int | None = None  # tokens per training sequence (None: block_size)
    n_layer: int = 6  # transformer blocks (ZeRO-3 / FSDP2 units)
    n_head: int = 6  # attention heads
    n_embd: int = 384  # hidden size
    global_batch: int = 8  # sequences per step over all ranks (must divide by world_size)
    warmup: int = 2  # rounds run first and not timed (allocations, DDP's bucket rebuild)
    steps: int = 10  # timed rounds: one step of every engine each
    lr: float = 1e-3  # AdamW learning rate, the same for every engine
    weight_decay: float = 0.01  # AdamW weight decay
    bucket_mb: float = 25.0  # gradient bucket size for zerolab DDP/ZeRO-1/2 and torch DDP (MiB)
    engines: tuple[str, ...] = BENCHED  # which to run (side by side, torch_ddp always)
    measure: bool = True  # run the memory/traffic pass
    measure_rounds: int = 2  # in it, rounds of a plain, a recorded and a tracked step each
    tolerance: float = 0.05  # "matches": max |param - reference| <= tolerance * lr
    seed: int = 0  # initial weights and batches
    timeout: float = 1800.0  # seconds before the launch gives up on a stuck rank
    pairs: bool = False  # one launch per zerolab stage and its torch counterpart (big models)

    @property
    def atol(self) -> float:
        """Largest |param - reference param| that still matches: a fraction of one step.

        An AdamW step moves an element by about lr at most, so 0.05 * lr means no element is
        off by more than 5% of one step. At world size 2 every engine here is bitwise equal
        to torch DDP (a sum of two numbers is exact in any order); at 3 or more ranks the
        reduction order differs and Adam turns rounding into differences around 1e-3 * lr.
        """
        return self.tolerance * self.lr

    @property
    def tokens(self) -> int:
        """Tokens per training sequence."""
        return self.block_size if self.seq_len is None else self.seq_len

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab_size, block_size=self.block_size,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         seed=self.seed)

    def check(self) -> None:
        unknown = set(self.engines) - set(BENCHED)
        if unknown:
            raise ValueError(f"unknown engines {sorted(unknown)}; choose from {BENCHED}")
        if self.global_batch % self.world_size:
            raise ValueError(f"global_batch={self.global_batch} must divide by "
                             f"world_size={self.world_size}")
        if self.steps < 1 or self.warmup < 0 or self.measure_rounds < 1:
            raise ValueError("need steps >= 1, warmup >= 0 and measure_rounds >= 1")
        if not 1 <= self.tokens <= self.block_size:
            raise ValueError(f"seq_len={self.seq_len} must be in 1..block_size={self.block_size}")

        if self.pairs and not set(self.engines) & set(COUNTERPARTS):
            raise ValueError(f"pairs need at least one zerolab stage of {list(COUNTERPARTS)}")

    def groups(self) -> list[tuple[tuple[str, ...], str]]:
        """[(engines that share a launch, the one they are compared with)].

        Side by side: all of them in one launch, compared with torch DDP. In pairs: each
        zerolab stage with its torch counterpart (the pair's reference), one launch per pair,
        so that only two models live on each rank at once.
        """
        if not self.pairs:
            return [(tuple(k for k in BENCHED if k in self.engines or k == REFERENCE),
                     REFERENCE)]
        return [((k, COUNTERPARTS[k]), COUNTERPARTS[k]) for k in COUNTERPARTS
                if k in self.engines]


QUICK = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
         "global_batch": 4, "warmup": 1, "steps": 2, "bucket_mb": 0.002,
         "measure_rounds": 1}  # --quick: CI
# --gpt2: GPT-2 small's shape (124,439,808 parameters, head tied to the token embedding, random
# weights), trained on 64-token sequences so that a step takes seconds on a CPU. Seven
# engines at 16 bytes a parameter on 2 ranks would need ~28 GB: it runs in pairs.
GPT2 = {"vocab_size": 50257, "block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768,
        "seq_len": 64, "global_batch": 2, "warmup": 2, "steps": 8, "pairs": True}


def make_engine(key: str, config: BenchConfig, device: torch.device) -> Any:
    """The engine `key` on a fresh GPT (same seed on every rank: same weights)."""
    model = GPT(config.gpt_config()).to(device)
    kwargs: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    if key not in ("zero3", "torch_fsdp2"):  # those reduce per unit (a block), not per bucket
        kwargs["bucket_bytes"] = int(config.bucket_mb * 2**20)
    if key in ("zero1", "zero2"):  # the loop reads no parameter between steps: overlap opted
        kwargs["prefetch"] = True  # into (by default step() waits for the gathers: ~5% here)
    return engines.make_engine(key, model, torch.optim.AdamW, **kwargs)


def bench_batch(config: BenchConfig, model: GPT, round_index: int, rank: int,
                device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's rows of round `round_index`'s global batch, every engine's the same:
    (x, y), each (batch / world_size, tokens)."""
    rows = harness.local_batch(model.make_batch, config.global_batch,
                               config.seed * 100_003 + round_index, rank, config.world_size)
    return tuple(t[:, :config.tokens].to(device) for t in rows)


def forward_backward(model: GPT, x: torch.Tensor, y: torch.Tensor) -> None:
    """What every engine computes in a step, and nothing else (the floor): forward and backward
    on this rank's batch, with no collective and no optimizer step. No engine can be faster."""
    model.loss(model(x), y).backward()
    model.zero_grad(set_to_none=False)  # as the engines do: the next backward adds into zeros


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after the call that launched them
    returns): a timer or a profile read after this holds the work. Nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
