"""Small deterministic models for the lessons and the tests.

- `MLP`: a few Linear layers, with the awkward cases a sharding scheme must survive built in: a
  frozen parameter, a parameter smaller than any world size (numel 1), a buffer, and optionally
  a layer applied twice in one forward.
- `GPT`: a tiny nanoGPT-style transformer (token + position embeddings, pre-LayerNorm blocks of
  causal self-attention and MLP, final LayerNorm), with the output head tied to the token
  embedding by default.

Both are built from a typed config and a seed, and know how to make a batch and a loss, so that
every engine and the single-process reference train on exactly the same thing.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class MLPConfig:
    dims: tuple[int, ...] = (16, 32, 32, 8)  # layer widths, input first, output last
    freeze_first_bias: bool = True  # a frozen parameter: no gradient, no optimizer state
    reuse_hidden: bool = False  # apply the middle Linear twice (needs equal widths around it)
    seed: int = 0  # initial weights and the buffer come from this seed


class MLP(nn.Module):
    def __init__(self, config: MLPConfig = MLPConfig()):
        super().__init__()
        self.config = config
        gen = torch.Generator().manual_seed(config.seed)
        dims = config.dims
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        # numel 1: smaller than the world size, so some ranks' shards of it are pure padding.
        self.gain = nn.Parameter(torch.ones(1))
        # A buffer (not a parameter): must be broadcast from rank 0 like the weights.
        self.register_buffer("input_shift", torch.randn(dims[0], generator=gen) * 0.1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.numel() ** -0.25 * 0.3)
            self.gain.fill_(1.0)
        if config.freeze_first_bias:
            self.layers[0].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, dims[0]) -> (batch, dims[-1])
        x = x - self.input_shift
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if self.config.reuse_hidden and i == 1:
                x = layer(F.gelu(x))  # the same module twice: its gradient sums both uses
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x * self.gain

    def make_batch(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, self.config.dims[0], generator=gen)
        y = torch.randn(batch_size, self.config.dims[-1], generator=gen)
        return x, y

    @staticmethod
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64  # tokens
    block_size: int = 16  # longest sequence (position embeddings)
    n_layer: int = 2  # transformer blocks
    n_head: int = 2  # attention heads; n_embd must divide by it
    n_embd: int = 32  # hidden size h
    tie_weights: bool = True  # output head shares the token embedding matrix
    seed: int = 0  # initial weights come from this seed
    attention: str = "sdpa"  # "sdpa": fused (keeps no (seq, seq) scores); "explicit": softmax(QK^T)
    checkpoint: str = "none"  # "none"; "block": recompute each block in backward;
    #                           "attention": recompute only softmax(QK^T)V (selective)

    def __post_init__(self) -> None:
        if self.attention not in ("sdpa", "explicit"):
            raise ValueError(f"attention must be 'sdpa' or 'explicit', got {self.attention!r}")
        if self.checkpoint not in ("none", "block", "attention"):
            raise ValueError(f"checkpoint must be 'none', 'block' or 'attention', "
                             f"got {self.checkpoint!r}")


# Sizes beyond the course's: GPT-2 small's (124,439,808 parameters, tied head), and a 7B with
# Llama-2-7B's width, depth, heads and vocabulary in this GPT's blocks (a GELU MLP of 4h,
# biases, learned positions, untied head: 6,723,084,288 parameters; theory.MODEL_SHAPES["7B"]).
# The 7B is built on the meta device only (zerolab.predict), never for real.
GPT2_124M = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
GPT_7B = GPTConfig(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
                   tie_weights=False)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.n_embd
        self.n_head = config.n_head
        self.attention = config.attention
        self.recompute_attention = config.checkpoint == "attention"
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc_out = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, seq, h) -> same
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        # (batch, heads, seq, head_dim)
        q, k, v = (z.view(b, t, self.n_head, h // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.recompute_attention:  # keep only q, k, v; recompute the rest in backward
            y = checkpoint(self.attend, q, k, v, use_reentrant=False)
        else:
            y = self.attend(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, h))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention. q, k, v: (batch, heads, seq, head_dim) -> the same shape."""
        if self.attention == "sdpa":  # fused: the (seq, seq) scores never exist in memory
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        t = q.shape[-2]
        scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5  # (batch, heads, seq, seq)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


class GPT(nn.Module):
    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # one Parameter, used first and last
        for name, p in self.named_parameters():
            if not p.is_meta:  # on the meta device, an engine calls init_tensor unit by unit
                self.init_tensor(name, p)

    def init_tensor(self, name: str, t: torch.Tensor) -> None:
        """Fill parameter `name` with its initial value, in place.

        Each parameter draws from a generator seeded by the model's seed and its own name, so
        the same model comes out whatever the world size, the engine, and whether it was built
        in full or on the meta device and materialised one unit at a time.
        """
        with torch.no_grad():
            if name.endswith("bias"):
                t.zero_()
            elif t.dim() == 1:  # LayerNorm gains
                t.fill_(1.0)
            else:
                key = zlib.crc32(f"{self.config.seed}/{name}".encode())
                gen = torch.Generator().manual_seed(key)  # on the CPU: the same on a GPU
                values = t if t.device.type == "cpu" else torch.empty(t.shape)
                values.normal_(0.0, 0.02, generator=gen)  # in place: no temporary copy
                if values is not t:
                    t.copy_(values)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (batch, seq) -> (batch, seq, vocab)
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.config.checkpoint == "block":  # keep only the block's input for backward
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def make_batch(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random token sequences; the target is the input shifted by one (next-token)."""
        gen = torch.Generator().manual_seed(seed)
        c = self.config
        tokens = torch.randint(0, c.vocab_size, (batch_size, c.block_size + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model: nn.Module, trainable_only: bool = False) -> int:
    """Ψ: distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
