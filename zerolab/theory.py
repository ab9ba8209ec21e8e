"""The formulas of the course: what each rank holds and sends, before anything is measured.

Every number the notebooks measure on live processes has a formula here to be checked against.
Pure Python on purpose (no torch): the calculator and the plots can use it anywhere.

Notation, as in the ZeRO paper (Rajbhandari et al., 2020): Ψ = number of parameters,
N = data-parallel world size, K = optimizer-state bytes per parameter.

Model states per rank, fp32 training with Adam (4 B params, 4 B grads, K = 8 for m and v):

    DDP     16Ψ          ZeRO-1  8Ψ + 8Ψ/N      ZeRO-2  4Ψ + 12Ψ/N      ZeRO-3  16Ψ/N

Mixed precision (paper): 16-bit params and grads (2Ψ + 2Ψ) and K = 12 for Adam, because the
optimizer keeps an fp32 master copy of the weights next to m and v (4 + 4 + 4):

    DDP  (4+K)Ψ     ZeRO-1  4Ψ + KΨ/N      ZeRO-2  2Ψ + (2+K)Ψ/N     ZeRO-3  (4+K)Ψ/N

Sizes in decimal GB (1e9 bytes), as the paper and the article series use them.
"""

from __future__ import annotations

from dataclasses import dataclass

# --- units -----------------------------------------------------------------------------------

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12  # decimal: what papers and GPU spec sheets quote
KiB, MiB, GiB, TiB = 2.0**10, 2.0**20, 2.0**30, 2.0**40  # binary: what allocators report

_DECIMAL_UNITS = [("B", 1.0), ("kB", KB), ("MB", MB), ("GB", GB), ("TB", TB)]
_BINARY_UNITS = [("B", 1.0), ("KiB", KiB), ("MiB", MiB), ("GiB", GiB), ("TiB", TiB)]


def to_gb(nbytes: float) -> float:
    """Bytes to decimal gigabytes (1 GB = 1e9 bytes)."""
    return nbytes / GB


def format_bytes(nbytes: float, decimal: bool = False, digits: int = 3) -> str:
    """A byte count as a short string: '38.5 GB' (decimal=True) or '1.5 MiB' (binary, default).

    `digits` significant digits, so 31.40625e9 bytes prints as the paper's '31.4 GB'.
    """
    units = _DECIMAL_UNITS if decimal else _BINARY_UNITS
    name, scale = units[0]
    for unit_name, unit_scale in units:
        if abs(nbytes) >= unit_scale:
            name, scale = unit_name, unit_scale
    value = nbytes / scale
    if name == "B":
        return f"{value:.0f} B"
    # `g` would switch to exponent notation for 1000..1023 KiB; print those as integers.
    text = f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:.0f}"
    return f"{text} {name}"


# --- stages, precisions, optimizers -------------------------------------------------------------

STAGES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
# The article's ZeRO-1 (zerolab.zero1.ZeRO1AllReduce): all-reduce, keep your shard, all-gather.
ALL_REDUCE_ZERO1 = "ZeRO-1 (all-reduce)"

_STAGE_ALIASES = {
    "ddp": "DDP", "0": "DDP", "zero0": "DDP", "zero1": "ZeRO-1", "1": "ZeRO-1",
    "zero2": "ZeRO-2", "2": "ZeRO-2", "zero3": "ZeRO-3", "3": "ZeRO-3", "fsdp": "ZeRO-3",
    "zero1allreduce": ALL_REDUCE_ZERO1, "zero1(allreduce)": ALL_REDUCE_ZERO1}


def stage_name(stage: str | int) -> str:
    """Canonical stage name: 'zero2', 'ZeRO-2', 2 -> 'ZeRO-2'; 'ddp', 0 -> 'DDP'."""
    key = str(stage).lower().replace("-", "").replace("_", "").replace(" ", "")
    if key not in _STAGE_ALIASES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES} or "
                         f"{ALL_REDUCE_ZERO1!r}")
    return _STAGE_ALIASES[key]


# bytes per parameter and per gradient held for forward/backward, and whether the optimizer
# keeps its own fp32 master copy of the weights (mixed precision does: the update needs fp32).
PRECISIONS = {
    "fp32": {"param_bytes": 4, "grad_bytes": 4, "master_copy": False},
    "mixed": {"param_bytes": 2, "grad_bytes": 2, "master_copy": True},  # bf16 or fp16
}
_PRECISION_ALIASES = {"fp32": "fp32", "float32": "fp32", "mixed": "mixed", "bf16": "mixed",
                      "fp16": "mixed", "amp": "mixed"}

# fp32 state tensors per parameter each optimizer keeps (Adam: m and v; SGD: the momentum buffer).
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}


def precision_name(precision: str) -> str:
    """'bf16', 'fp16', 'amp', 'mixed' -> 'mixed'; 'fp32', 'float32' -> 'fp32'."""
    key = precision.lower()
    if key not in _PRECISION_ALIASES:
        raise ValueError(f"unknown precision {precision!r}; expected 'fp32' or 'mixed'")
    return _PRECISION_ALIASES[key]


def optimizer_multiplier(optimizer: str = "adam", precision: str = "fp32") -> int:
    """K, the optimizer-state bytes per parameter: 4 B per fp32 state, + 4 B master copy if mixed.

    adam/adamw: fp32 8, mixed 12 (the paper's K = 12). sgd_momentum: 4 / 8. sgd: 0 / 4.
    """
    key = optimizer.lower().replace("-", "_").replace(" ", "_")
    if key not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected {list(OPTIMIZER_STATES)}")
    master = 4 if PRECISIONS[precision_name(precision)]["master_copy"] else 0
    return 4 * OPTIMIZER_STATES[key] + master


# --- model-state memory -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds, per category (the keys engines report)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer

    def as_dict(self) -> dict[str, float]:
        """{'params': .., 'grads': .., 'optimizer': ..}: the shape `plots.memory_bars` takes."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


def model_state_memory(num_params: float, world_size: int = 1, stage: str | int = "DDP", *,
                       precision: str = "fp32", optimizer: str = "adam", k: float | None = None,
                       param_bytes: float | None = None, grad_bytes: float | None = None,
                       fp32_grad_accum: bool = False) -> ModelStates:
    """Model-state bytes per rank (params, grads, optimizer) for one stage.

    Each stage shards one more category over the N ranks; the rest stay replicated:
    ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters.

    `precision` ('fp32' or 'mixed') and `optimizer` pick the bytes per parameter, gradient and
    K; `param_bytes`, `grad_bytes` and `k` override them. `fp32_grad_accum` adds the optional
    fp32 gradient-accumulation buffer of mixed precision (4Ψ), counted with the gradients and
    therefore sharded with them in ZeRO-2/3. Activations are not model states (see
    `activation_bytes_estimate`).
    """
    stage = stage_name(stage)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    prec = PRECISIONS[precision_name(precision)]
    p = prec["param_bytes"] if param_bytes is None else param_bytes
    g = prec["grad_bytes"] if grad_bytes is None else grad_bytes
    if fp32_grad_accum:
        if precision_name(precision) == "fp32":
            raise ValueError("fp32 training already keeps fp32 gradients; no extra buffer")
        g += 4
    k = optimizer_multiplier(optimizer, precision) if k is None else k

    n = world_size
    shard_opt = stage != "DDP"  # every ZeRO stage, ZeRO-1 by all-reduce included
    shard_grads = stage in ("ZeRO-2", "ZeRO-3")
    shard_params = stage == "ZeRO-3"
    return ModelStates(
        params=p * num_params / (n if shard_params else 1),
        grads=g * num_params / (n if shard_grads else 1),
        optimizer=k * num_params / (n if shard_opt else 1),
    )


def memory_formula(stage: str | int, **kwargs) -> str:
    """The per-rank formula as text, e.g. 'ZeRO-2' -> '4Ψ + 12Ψ/N' (fp32 Adam). Takes
    `model_state_memory`'s keyword arguments (precision, optimizer, k, ...)."""
    # Bytes per parameter at N=1 and N=2 give the replicated part R and the sharded part S of
    # R + S/N: m1 = R + S and m2 = R + S/2.
    m1 = model_state_memory(1, 1, stage, **kwargs).total
    m2 = model_state_memory(1, 2, stage, **kwargs).total
    sharded = 2 * (m1 - m2)
    replicated = m1 - sharded
    terms = [text for text, x in ((f"{replicated:g}Ψ", replicated), (f"{sharded:g}Ψ/N", sharded))
             if x]
    return " + ".join(terms) or "0"


def all_stages(num_params: float, world_size: int = 1, **kwargs) -> dict[str, ModelStates]:
    """`model_state_memory` for DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (same keyword arguments)."""
    return {s: model_state_memory(num_params, world_size, s, **kwargs) for s in STAGES}


def deepspeed_zero2_bytes(num_params: float, world_size: int) -> float:
    """DeepSpeed's ZeRO-2 estimate per GPU without offload: 2Ψ + 18Ψ/N.

    A documented variant of our mixed-precision ZeRO-2 (2Ψ + 14Ψ/N): DeepSpeed also keeps an
    fp32 gradient partition, so the sharded part is 2 (fp16 grads) + 4 (fp32 grads) + 12
    (fp32 params, m, v) = 18. It equals `model_state_memory(.., 'ZeRO-2', precision='mixed',
    fp32_grad_accum=True).total`. (Source: `estimate_zero2_model_states_mem_needs` in
    deepspeed/runtime/zero/stage_1_and_2.py; older releases used 4Ψ + 16Ψ/N.)
    """
    return 2 * num_params + 18 * num_params / world_size


def deepspeed_zero3_bytes(num_params: float, world_size: int,
                          largest_layer_params: float = 0) -> float:
    """DeepSpeed's ZeRO-3 estimate per GPU without offload: 4·L + 18Ψ/N. L is the largest
    layer's parameter count: ZeRO-3 must gather one layer whole to run it, so that much must
    stay free on top of the 18 bytes per parameter shard."""
    return 4 * largest_layer_params + 18 * num_params / world_size


# --- communication ------------------------------------------------------------------------------

_RING_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1}


def _op_name(op: str) -> str:
    key = op.lower().replace("-", "_").replace(" ", "_")
    key = {"allreduce": "all_reduce", "reducescatter": "reduce_scatter",
           "allgather": "all_gather", "alltoall": "all_to_all"}.get(key, key)
    if key not in _RING_FACTOR:
        raise ValueError(f"unknown collective {op!r}; expected one of {list(_RING_FACTOR)}")
    return key


def ring_sent_bytes(op: str, nbytes: float, world_size: int) -> float:
    """Bytes one rank sends for a collective on a tensor of `nbytes` (S) with a ring algorithm.

    all_reduce: 2(N-1)/N·S (a reduce-scatter then an all-gather); reduce_scatter and
    all_gather: (N-1)/N·S (each rank passes on N-1 chunks of S/N); all_to_all: (N-1)/N·S, S its
    input (no ring: chunk j goes straight to rank j, all but its own). One rank sends nothing.
    """
    n = world_size
    return _RING_FACTOR[_op_name(op)] * (n - 1) / n * nbytes


def rank_sent_bytes(op: str, nbytes: int, world_size: int, rank: int = 0, src: int = 0) -> int:
    """Bytes rank `rank` sends for one collective over S=nbytes under the ring model: what
    zerolab.comm records as each event's ring_bytes (a broadcast's depend on the rank)."""
    n = world_size
    if op in _RING_FACTOR:
        return round(ring_sent_bytes(op, nbytes, n))
    if op == "broadcast":  # pipelined ring from src: every rank but the last one forwards S
        return 0 if n == 1 or rank == (src - 1) % n else nbytes
    if op in ("send", "recv", "barrier"):
        return nbytes if op == "send" and n > 1 else 0
    raise ValueError(f"unknown op {op!r}")


# The collectives of one training step, each over the whole model (Ψ elements).
STEP_COLLECTIVES = {
    "DDP": ("all_reduce",),                                  # gradients
    "ZeRO-1": ("reduce_scatter", "all_gather"),              # grads -> shards, params <- shards
    ALL_REDUCE_ZERO1: ("all_reduce", "all_gather"),          # article: full grads, then gather
    "ZeRO-2": ("reduce_scatter", "all_gather"),              # same traffic as ZeRO-1
    "ZeRO-3": ("all_gather", "all_gather", "reduce_scatter"),  # params in fwd, again in bwd
}


@dataclass(frozen=True)
class CommVolume:
    """Communication of one training step, per rank."""

    stage: str
    collectives: tuple[str, ...]  # each over the whole model: S = Ψ (ZeRO-3's 2nd: Ψ - root)
    elements: float  # the paper's volume: an all-reduce counts 2Ψ, the others Ψ
    bytes: float  # elements × bytes per element
    ring_sent_bytes: float  # what one rank sends with ring algorithms: bytes × (N-1)/N


def comm_volume(num_params: float, world_size: int, stage: str | int,
                bytes_per_element: float = 4, root_numel: float = 0) -> CommVolume:
    """Per-step communication of a stage: DDP, ZeRO-1, ZeRO-2 2Ψ; ZeRO-3, ZeRO-1 by all-reduce 3Ψ.
    `bytes_per_element`: 4 for fp32, 2 for bf16/fp16. `root_numel`: ZeRO-3's root unit, kept
    from forward to backward (zerolab, FSDP2), not gathered again: 3Ψ - root (0: the paper's)."""
    stage = stage_name(stage)
    if root_numel and stage != "ZeRO-3":
        raise ValueError(f"root_numel is ZeRO-3's (its backward all-gather); {stage} has none")
    ops = STEP_COLLECTIVES[stage]  # ZeRO-3's second all-gather, backward's, leaves out the root
    sizes = [num_params - root_numel * (i == 1) for i in range(len(ops))]
    elements = sum(_RING_FACTOR[op] * size for op, size in zip(ops, sizes))
    return CommVolume(stage, ops, elements, elements * bytes_per_element, sum(
        ring_sent_bytes(op, size * bytes_per_element, world_size) for op, size in zip(ops, sizes)))


# --- model sizes --------------------------------------------------------------------------------

MODEL_PRESETS = {"125M": 125_000_000, "1.3B": 1_300_000_000, "7B": 7_000_000_000,
                 "70B": 70_000_000_000}


def gpt_param_count(vocab_size: int, hidden: int, num_layers: int, seq_len: int,
                    tied_embeddings: bool = True) -> int:
    """Parameters of a nanoGPT-style decoder (biases everywhere, LayerNorm with weight and bias).

        embeddings  V·h (tokens) + s·h (positions)
        per block   12h² + 13h:  ln1 2h, qkv h·3h+3h, proj h·h+h, ln2 2h,
                                 mlp h·4h+4h and 4h·h+h
        final LN    2h
        lm_head     0 when tied to the token embedding, else V·h (no bias)

    GPT-2 small (V=50257, h=768, 12 layers, s=1024, tied) has 124,439,808.
    """
    h = hidden
    embeddings = vocab_size * h + seq_len * h
    blocks = num_layers * (12 * h * h + 13 * h)
    head = 0 if tied_embeddings else vocab_size * h
    return embeddings + blocks + 2 * h + head


def activation_bytes_estimate(seq_len: int, batch_size: int, hidden: int, num_heads: int,
                              num_layers: int = 1) -> float:
    """ESTIMATE of activation memory kept for backward: s·b·h·(34 + 5·a·s/h) bytes per layer.

    From Korthikanti et al. (2022), "Reducing Activation Recomputation in Large Transformer
    Models", for a standard transformer block with 16-bit activations and 1-byte dropout masks,
    no recomputation and no tensor/sequence parallelism. The 5·a·s/h term is the attention
    scores (quadratic in s). Excludes embeddings and the output logits. An order of magnitude
    to compare with model states, not a measurement: ZeRO does not shard activations.
    """
    s, b, h, a = seq_len, batch_size, hidden, num_heads
    return num_layers * s * b * h * (34 + 5 * a * s / h)


# --- activations: what each rank keeps for backward, and ZeRO does not shard ----------------------
# Derived from the course GPT's Block.forward (zerolab/models.py), op by op: what each op's
# backward needs, each storage once, parameters left out. s = sequence length, b = micro-batch
# (sequences per rank), h = hidden size, a = heads, e = bytes per activation element (4 fp32,
# 2 bf16/fp16). Statistics (LayerNorm's mean and rstd, the logsumexp) are fp32 even in 16-bit
# training. No dropout (the course GPT has none).

ATTENTIONS = ("sdpa", "explicit")  # fused attention, or softmax(QK^T)V written out
CHECKPOINTS = ("none", "block", "attention")  # GPTConfig.checkpoint's names
_CHECKPOINT_ALIASES = {"full": "block", "selective": "attention", **{c: c for c in CHECKPOINTS}}
STAT_BYTES, TOKEN_BYTES = 4, 8  # fp32 statistics; int64 token ids and positions


def checkpoint_name(checkpoint: str) -> str:
    """'full' -> 'block' (recompute each block), 'selective' -> 'attention'; 'none' stays."""
    if checkpoint not in _CHECKPOINT_ALIASES:
        raise ValueError(f"unknown checkpointing {checkpoint!r}; expected one of "
                         f"{sorted(_CHECKPOINT_ALIASES)}")
    return _CHECKPOINT_ALIASES[checkpoint]


def activation_terms(seq_len: int, batch_size: int, hidden: int, num_heads: int, *,
                     attention: str = "sdpa", checkpoint: str = "none",
                     bytes_per_element: float = 4) -> dict[str, float]:
    """Bytes one transformer block keeps for backward, term by term (one rank, one micro-batch).

    Without checkpointing, per token: 16h elements (the two LayerNorms' inputs and outputs, q,
    k and v, the attention output, the GELU's input and output of 4h each) and 4 fp32
    statistics; then the attention core: "sdpa" keeps a logsumexp per head and token (linear
    in s); "explicit" keeps the softmax probabilities (b, a, s, s) and the causal mask (s, s)
    (quadratic in s). checkpoint="block": the block's input only; "attention": the core is
    recomputed in backward, so its own terms go (16h + 4 for either attention).
    """
    s, b, h, a, e = seq_len, batch_size, hidden, num_heads, bytes_per_element
    sbh, checkpoint = s * b * h, checkpoint_name(checkpoint)
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if checkpoint == "block":
        return {"block input (kept for the recompute)": e * sbh}
    explicit = attention == "explicit" and checkpoint == "none"
    terms = {
        "LayerNorm inputs: x, x + attention": 2 * e * sbh,
        "LayerNorm outputs: qkv's and fc's inputs": 2 * e * sbh,
        "LayerNorm mean and rstd (fp32)": 2 * 2 * STAT_BYTES * s * b,
        # explicit: bmm needs contiguous q, k, v, and the reshape before proj copies its input
        ("q, k, v: copies for the matmuls" if explicit else "q, k, v: qkv's output"): 3 * e * sbh,
        ("attention output, reshaped copy" if explicit else "attention output"): e * sbh,
    }
    if checkpoint == "none" and attention == "sdpa":
        terms["logsumexp (fp32)"] = STAT_BYTES * a * s * b
    elif explicit:
        terms["softmax(QK^T) probabilities (b, a, s, s)"] = e * a * s * s * b
        terms["causal mask (s, s), 1 byte each"] = s * s
    terms["fc output: GELU's input (4h)"] = 4 * e * sbh
    terms["GELU output: fc_out's input (4h)"] = 4 * e * sbh
    return terms


def activation_bytes(seq_len: int, batch_size: int, hidden: int, num_heads: int,
                     num_layers: int = 1, **kwargs) -> float:
    """Bytes `num_layers` blocks keep for backward at the end of forward (`activation_terms`
    summed; same keywords). In fp32 without checkpointing, per block:

        sdpa      4·s·b·(16h + 4 + a)
        explicit  4·s·b·(16h + 4) + 4·a·s²·b + s²
    """
    return num_layers * sum(activation_terms(seq_len, batch_size, hidden, num_heads,
                                             **kwargs).values())


def recompute_bytes(seq_len: int, batch_size: int, hidden: int, num_heads: int, *,
                    attention: str = "sdpa", checkpoint: str = "none",
                    bytes_per_element: float = 4) -> float:
    """What one recompute in backward saves again, for a moment: a whole block ("block", its
    input already kept), or one attention core ("attention": sdpa its output and logsumexp;
    explicit the q, k, v copies, the probabilities and the mask). 0 without checkpointing."""
    s, b, h, a, e = seq_len, batch_size, hidden, num_heads, bytes_per_element
    checkpoint, shape = checkpoint_name(checkpoint), (s, b, h, a)
    if checkpoint == "block":
        full = activation_bytes(*shape, attention=attention, bytes_per_element=e)
        return full - e * s * b * h
    if checkpoint == "none":
        return 0.0
    if attention == "sdpa":
        return e * s * b * h + STAT_BYTES * a * s * b
    return 3 * e * s * b * h + e * a * s * s * b + s * s


def head_activation_bytes(seq_len: int, batch_size: int, hidden: int, vocab_size: int,
                          bytes_per_element: float = 4) -> float:
    """What the model keeps for backward outside its blocks: token ids, positions and targets
    (int64), the final LayerNorm's input, statistics and output, the logits' log-softmax."""
    s, b, h, v, e = seq_len, batch_size, hidden, vocab_size, bytes_per_element
    return TOKEN_BYTES * (2 * s * b + s) + e * s * b * (2 * h + v) + 2 * STAT_BYTES * s * b


@dataclass(frozen=True)
class ModelShape:
    """What activations depend on: the shape, not just Ψ. GPT-style blocks (4h MLP)."""

    hidden: int
    num_layers: int
    num_heads: int
    vocab_size: int
    tied_embeddings: bool = True

    @property
    def num_params(self) -> int:
        """Ψ without position embeddings (rotary positions have none)."""
        return gpt_param_count(self.vocab_size, self.hidden, self.num_layers, 0,
                               self.tied_embeddings)


# Shapes for the calculator's presets (GPT-2 small, GPT-3 XL, Llama-2 7B and 70B widths), and
# "8B": Llama-3-8B's width, depth, heads and vocabulary, with the course's GPT block.
MODEL_SHAPES = {
    "125M": ModelShape(768, 12, 12, 50257),
    "1.3B": ModelShape(2048, 24, 16, 50257),
    "7B": ModelShape(4096, 32, 32, 32000, tied_embeddings=False),
    "8B": ModelShape(4096, 32, 32, 128256, tied_embeddings=False),
    "70B": ModelShape(8192, 80, 64, 32000, tied_embeddings=False),
}


def model_activation_bytes(shape: ModelShape, seq_len: int, batch_size: int = 1, *,
                           peak: bool = True, **kwargs) -> float:
    """One rank's activations for a step: every block and the head, at the end of forward.

    peak=True: or, if more, what the first recompute of backward holds: the blocks' kept
    bytes and one recompute (`recompute_bytes`), the head's already freed (for selective
    checkpointing a little more than that: the last block's MLP is freed by then). Gradients
    in flight come on top. kwargs: attention, checkpoint, bytes_per_element.
    """
    args = (seq_len, batch_size, shape.hidden, shape.num_heads)
    blocks = activation_bytes(*args, shape.num_layers, **kwargs)
    e = kwargs.get("bytes_per_element", 4)
    kept = blocks + head_activation_bytes(seq_len, batch_size, shape.hidden, shape.vocab_size, e)
    return max(kept, blocks + recompute_bytes(*args, **kwargs)) if peak else kept


def longest_sequence(shape: ModelShape, memory_bytes: float, state_bytes: float,
                     batch_size: int = 1, *, limit: int = 2**24, **kwargs) -> int:
    """The longest sequence whose activations (`model_activation_bytes`, same kwargs) fit next
    to `state_bytes` in `memory_bytes`: 0 if not one token does, at most `limit`."""
    def fits(s: int) -> bool:
        return state_bytes + model_activation_bytes(shape, s, batch_size, **kwargs) <= memory_bytes

    lo, hi = 0, limit + 1  # fits(lo) (nothing at all) and not fits(hi), by convention
    while hi - lo > 1:  # activations grow with s: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# --- ZeRO++ (notebook 09): quantised collectives ----------------------------------------------


def quantized_bytes(numel: int, bits: int = 8, block: int = 256) -> int:
    """`numel` values at `bits` (8 or 4) each, in whole bytes, plus an fp32 scale per block.
    qwZ's int8 (`int8_bytes`): a quarter of fp32, and 4/block of that again for the scales."""
    return -(-numel * bits // 8) + 4 * -(-numel // block)


def int8_bytes(numel: int, block: int = 256) -> int:
    """ZeRO++'s qwZ: `numel` values as int8 with an fp32 scale per block of `block`."""
    return quantized_bytes(numel, 8, block)


def qgz_sent_bytes(numel: int, world_size: int, node_size: int, bits: int = 8,
                   block: int = 256) -> tuple[int, int]:
    """ZeRO++'s qgZ: bytes one rank sends (inside its node, to other nodes) to reduce-scatter
    `numel` gradients over N ranks in R nodes of k (c = numel/N each; q = quantized_bytes).
    Hop 1, inside the node: to each of its k-1 peers the R chunks that peer carries across
    nodes, (k-1)·q(R·c). Hop 2, across: the node's sum of each other node's chunk, (R-1)·q(c).
    ZeRO-3's fp32 reduce-scatter sends (N-k)·4c = (R-1)·k·4c across: qgZ is q(c)/(4kc) of it,
    about (bits/8 + 4/block)/(4k): 0.127 for int8 with k = 2."""
    k, r = node_size, world_size // node_size
    chunk = numel // world_size
    return (k - 1) * quantized_bytes(r * chunk, bits, block), (r - 1) * quantized_bytes(
        chunk, bits, block)
