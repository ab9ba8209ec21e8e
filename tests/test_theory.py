"""The course's formulas, pinned to the figures of the seeds and of the ZeRO paper."""

import subprocess
import sys
from pathlib import Path

import pytest

from zerolab import theory
from zerolab.theory import GB, STAGES

SEVEN_B = 7e9


# --- the seeds' and the paper's numbers ------------------------------------------------------


@pytest.mark.parametrize(
    ("stage", "params", "grads", "optimizer", "total"),
    [
        ("DDP", 28, 28, 56, 112),
        ("ZeRO-1", 28, 28, 7, 63),
        ("ZeRO-2", 28, 3.5, 7, 38.5),
        ("ZeRO-3", 3.5, 3.5, 7, 14),
    ],
)
def test_seeds_7b_fp32_adam_on_8_gpus(stage, params, grads, optimizer, total):
    m = theory.model_state_memory(SEVEN_B, 8, stage)
    assert m.params / GB == pytest.approx(params)
    assert m.grads / GB == pytest.approx(grads)
    assert m.optimizer / GB == pytest.approx(optimizer)
    assert m.total / GB == pytest.approx(total)


@pytest.mark.parametrize(
    ("stage", "paper_gb", "text"),
    [("DDP", 120, "120 GB"), ("ZeRO-1", 31.4, "31.4 GB"), ("ZeRO-2", 16.6, "16.6 GB"),
     ("ZeRO-3", 1.88, "1.88 GB")],
)
def test_paper_table1_row_psi_7_5b_k12_n64(stage, paper_gb, text):
    m = theory.model_state_memory(7.5e9, 64, stage, precision="mixed", k=12)
    # The paper rounds to 3 significant digits: 31.40625 -> 31.4, 1.875 -> 1.88.
    decimals = 2 if paper_gb < 10 else 1
    assert m.total / GB == pytest.approx(paper_gb, abs=0.5 * 10**-decimals)
    assert theory.format_bytes(m.total, decimal=True) == text


def test_paper_exact_values():
    totals = {s: m.total / GB for s, m in theory.all_stages(7.5e9, 64, precision="mixed").items()}
    assert totals == pytest.approx(
        {"DDP": 120, "ZeRO-1": 31.40625, "ZeRO-2": 16.640625, "ZeRO-3": 1.875})


# --- the general formulas ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 64])
def test_fp32_adam_formulas(n):
    psi = 1000.0
    got = {s: theory.model_state_memory(psi, n, s).total for s in STAGES}
    assert got == pytest.approx({
        "DDP": 16 * psi,
        "ZeRO-1": 8 * psi + 8 * psi / n,
        "ZeRO-2": 4 * psi + 12 * psi / n,
        "ZeRO-3": 16 * psi / n,
    })


@pytest.mark.parametrize("n", [1, 2, 5, 64])
@pytest.mark.parametrize("k", [12, 8, 4])
def test_mixed_precision_formulas(n, k):
    psi = 1000.0
    got = {s: theory.model_state_memory(psi, n, s, precision="bf16", k=k).total for s in STAGES}
    assert got == pytest.approx({
        "DDP": (4 + k) * psi,
        "ZeRO-1": 4 * psi + k * psi / n,
        "ZeRO-2": 2 * psi + (2 + k) * psi / n,
        "ZeRO-3": (4 + k) * psi / n,
    })


def test_mixed_precision_categories():
    m = theory.model_state_memory(100, 4, "ZeRO-2", precision="mixed")
    assert m.as_dict() == {"params": 200, "grads": 50, "optimizer": 300}


def test_world_size_one_is_ddp_for_every_stage():
    totals = {theory.model_state_memory(123, 1, s).total for s in STAGES}
    assert totals == {16 * 123}


def test_fp32_grad_accumulation_buffer_shards_with_gradients():
    psi, n = 1000.0, 8
    m = {s: theory.model_state_memory(psi, n, s, precision="mixed", fp32_grad_accum=True)
         for s in STAGES}
    assert m["DDP"].total == pytest.approx(20 * psi)
    assert m["ZeRO-1"].total == pytest.approx(8 * psi + 12 * psi / n)  # grads still replicated
    assert m["ZeRO-2"].total == pytest.approx(2 * psi + 18 * psi / n)
    assert m["ZeRO-3"].total == pytest.approx(20 * psi / n)
    assert m["ZeRO-2"].grads == pytest.approx(6 * psi / n)
    with pytest.raises(ValueError):
        theory.model_state_memory(psi, n, "DDP", precision="fp32", fp32_grad_accum=True)


def test_deepspeed_zero2_variant_is_2psi_plus_18psi_over_n():
    psi, n = 7.5e9, 64
    assert theory.deepspeed_zero2_bytes(psi, n) == pytest.approx(2 * psi + 18 * psi / n)
    same = theory.model_state_memory(psi, n, "ZeRO-2", precision="mixed", fp32_grad_accum=True)
    assert theory.deepspeed_zero2_bytes(psi, n) == pytest.approx(same.total)
    assert theory.deepspeed_zero2_bytes(psi, n) / GB == pytest.approx(17.109375)


def test_deepspeed_zero3_estimate():
    assert theory.deepspeed_zero3_bytes(1e9, 8) == pytest.approx(18e9 / 8)
    assert theory.deepspeed_zero3_bytes(1e9, 8, largest_layer_params=1e6) == pytest.approx(
        18e9 / 8 + 4e6)


def test_overrides_for_bytes_per_param_and_grad():
    m = theory.model_state_memory(10, 2, "ZeRO-1", param_bytes=2, grad_bytes=4, k=12)
    assert m.as_dict() == {"params": 20, "grads": 40, "optimizer": 60}


@pytest.mark.parametrize(
    ("optimizer", "precision", "k"),
    [("adam", "fp32", 8), ("adamw", "mixed", 12), ("Adam", "bf16", 12),
     ("sgd_momentum", "fp32", 4), ("sgd-momentum", "mixed", 8), ("sgd", "fp32", 0),
     ("sgd", "fp16", 4)],
)
def test_optimizer_multiplier(optimizer, precision, k):
    assert theory.optimizer_multiplier(optimizer, precision) == k


def test_sgd_uses_its_multiplier():
    m = theory.model_state_memory(100, 1, "DDP", optimizer="sgd_momentum")
    assert m.as_dict() == {"params": 400, "grads": 400, "optimizer": 400}


@pytest.mark.parametrize(
    ("alias", "name"),
    [("ddp", "DDP"), (0, "DDP"), ("zero1", "ZeRO-1"), ("ZeRO-1", "ZeRO-1"), (2, "ZeRO-2"),
     ("zero_3", "ZeRO-3"), ("fsdp", "ZeRO-3"), ("zero1_all_reduce", theory.ALL_REDUCE_ZERO1)],
)
def test_stage_aliases(alias, name):
    assert theory.stage_name(alias) == name


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        theory.stage_name("zero4")
    with pytest.raises(ValueError):
        theory.precision_name("fp8")
    with pytest.raises(ValueError):
        theory.optimizer_multiplier("lion")
    with pytest.raises(ValueError):
        theory.model_state_memory(10, 0, "DDP")


def test_all_reduce_zero1_holds_what_zero1_holds():
    assert theory.model_state_memory(10, 4, "zero1 all-reduce") == theory.model_state_memory(
        10, 4, "zero1")


@pytest.mark.parametrize(
    ("stage", "kwargs", "text"),
    [("DDP", {}, "16Ψ"), ("ZeRO-1", {}, "8Ψ + 8Ψ/N"), ("ZeRO-2", {}, "4Ψ + 12Ψ/N"),
     ("ZeRO-3", {}, "16Ψ/N"), ("ZeRO-1", {"precision": "mixed"}, "4Ψ + 12Ψ/N"),
     ("ZeRO-2", {"precision": "mixed", "fp32_grad_accum": True}, "2Ψ + 18Ψ/N"),
     ("ZeRO-1", {"optimizer": "sgd"}, "8Ψ")],
)
def test_memory_formula_text(stage, kwargs, text):
    assert theory.memory_formula(stage, **kwargs) == text


# --- communication -------------------------------------------------------------------------------


def test_ring_sent_bytes():
    assert theory.ring_sent_bytes("all_reduce", 1000, 4) == pytest.approx(1500)
    assert theory.ring_sent_bytes("reduce_scatter", 1000, 4) == pytest.approx(750)
    assert theory.ring_sent_bytes("all_gather", 1000, 4) == pytest.approx(750)
    assert theory.ring_sent_bytes("allreduce", 1000, 1) == 0
    # all-reduce = reduce-scatter + all-gather, for any N
    for n in (2, 3, 5, 8):
        assert theory.ring_sent_bytes("all-reduce", 600, n) == pytest.approx(
            theory.ring_sent_bytes("reduce_scatter", 600, n)
            + theory.ring_sent_bytes("all_gather", 600, n))
    with pytest.raises(ValueError):
        theory.ring_sent_bytes("broadcast", 1000, 4)


@pytest.mark.parametrize(
    ("stage", "factor"),
    [("DDP", 2), ("ZeRO-1", 2), ("ZeRO-2", 2), ("ZeRO-3", 3), ("zero1_all_reduce", 3)],
)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_comm_volume(stage, factor, n):
    psi = 1_000_000
    c = theory.comm_volume(psi, n, stage, bytes_per_element=2)
    assert c.elements == factor * psi
    assert c.bytes == factor * psi * 2
    assert c.ring_sent_bytes == pytest.approx(factor * psi * 2 * (n - 1) / n)


def test_comm_volume_without_the_roots_backward_gather():
    """zerolab's ZeRO-3 and FSDP2 keep the root unit gathered from forward to backward."""
    psi, root, n = 1_000_000, 250_000, 4
    c = theory.comm_volume(psi, n, "ZeRO-3", root_numel=root)
    assert c.elements == 3 * psi - root
    assert c.ring_sent_bytes == pytest.approx(4 * (3 * psi - root) * (n - 1) / n)
    assert theory.comm_volume(psi, n, "ZeRO-3", root_numel=0) == theory.comm_volume(psi, n, 3)
    with pytest.raises(ValueError, match="root_numel is ZeRO-3's"):
        theory.comm_volume(psi, n, "ZeRO-2", root_numel=root)


def test_comm_collectives_per_stage():
    assert theory.comm_volume(1, 2, "DDP").collectives == ("all_reduce",)
    assert theory.comm_volume(1, 2, "zero1").collectives == ("reduce_scatter", "all_gather")
    assert theory.comm_volume(1, 2, "zero1 all-reduce").collectives == ("all_reduce", "all_gather")
    assert sorted(theory.comm_volume(1, 2, "zero3").collectives) == [
        "all_gather", "all_gather", "reduce_scatter"]


# --- model sizes, activations, units -------------------------------------------------------------


def test_gpt2_small_param_count():
    assert theory.gpt_param_count(50257, 768, 12, 1024) == 124_439_808
    assert theory.gpt_param_count(50257, 768, 12, 1024, tied_embeddings=False) == (
        124_439_808 + 50257 * 768)


def test_gpt_param_count_formula():
    v, h, layers, s = 100, 16, 3, 32
    expected = v * h + s * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert theory.gpt_param_count(v, h, layers, s) == expected


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_param_count_matches_a_nanogpt_style_model(tied):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    v, h, layers, s = 37, 24, 2, 11

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
            self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
            self.fc, self.fc_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(v, h), nn.Embedding(s, h)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(h)
            self.lm_head = nn.Linear(h, v, bias=False)
            if tied:
                self.lm_head.weight = self.wte.weight

    # model.parameters() yields a shared (tied) tensor once
    count = sum(p.numel() for p in GPT().parameters())
    assert theory.gpt_param_count(v, h, layers, s, tied_embeddings=tied) == count


def test_activation_estimate():
    # s=1024, b=1, h=768, a=12: 1024*768*(34 + 5*12*1024/768) = 1024*768*114 per layer
    per_layer = theory.activation_bytes_estimate(1024, 1, 768, 12)
    assert per_layer == pytest.approx(1024 * 768 * 114)
    assert theory.activation_bytes_estimate(1024, 4, 768, 12, num_layers=12) == pytest.approx(
        48 * per_layer)


def test_presets():
    assert theory.MODEL_PRESETS == {
        "125M": 125e6, "1.3B": 1.3e9, "7B": 7e9, "70B": 70e9}


@pytest.mark.parametrize(
    ("nbytes", "decimal", "text"),
    [(0, False, "0 B"), (512, False, "512 B"), (1024, False, "1 KiB"),
     (1.5 * 2**20, False, "1.5 MiB"), (1000 * 1024, False, "1000 KiB"),
     (3 * 2**30, False, "3 GiB"), (38.5e9, True, "38.5 GB"), (112e9, True, "112 GB"),
     (2_500, True, "2.5 kB"), (1.12e12, True, "1.12 TB")],
)
def test_format_bytes(nbytes, decimal, text):
    assert theory.format_bytes(nbytes, decimal=decimal) == text


def test_units():
    assert theory.GB == 1e9
    assert theory.GiB == 2**30
    assert theory.to_gb(112e9) == 112


def test_theory_does_not_import_torch():
    # Loaded by path, without the package __init__ (which starts the distributed machinery).
    path = Path(theory.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('theory', {str(path)!r})\n"
        "module = sys.modules['theory'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "assert 'torch' not in sys.modules, 'theory imported torch'\n"
        "print(module.format_bytes(module.model_state_memory(7e9, 8, 'ZeRO-2').total, True))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "38.5 GB"


# --- activations (notebook 08) ---------------------------------------------------------------


@pytest.mark.parametrize("attention", theory.ATTENTIONS)
def test_activation_terms_per_block(attention):
    s, b, h, a = 32, 2, 64, 4
    terms = theory.activation_terms(s, b, h, a, attention=attention)
    linear = 4 * s * b * (16 * h + 4)  # 16h fp32 elements and 4 statistics per token
    core = 4 * a * s * b if attention == "sdpa" else 4 * a * s * s * b + s * s
    assert sum(terms.values()) == linear + core
    assert theory.activation_bytes(s, b, h, a, 3, attention=attention) == 3 * (linear + core)
    # 16-bit halves the activations, not the fp32 statistics nor the 1-byte mask
    half = theory.activation_bytes(s, b, h, a, attention=attention, bytes_per_element=2)
    stats = 16 * s * b + (4 * a * s * b if attention == "sdpa" else s * s)
    probabilities = 0 if attention == "sdpa" else 4 * a * s * s * b
    assert half == (linear + core - stats - probabilities) / 2 + stats + probabilities / 2


def test_checkpointing_terms():
    s, b, h, a = 64, 2, 32, 4
    assert theory.activation_terms(s, b, h, a, checkpoint="full") == {
        "block input (kept for the recompute)": 4 * s * b * h}
    for attention in theory.ATTENTIONS:  # selective keeps the same for both attentions
        assert theory.activation_bytes(s, b, h, a, attention=attention,
                                       checkpoint="selective") == 4 * s * b * (16 * h + 4)
    assert theory.checkpoint_name("full") == "block"
    assert theory.checkpoint_name("selective") == "attention"
    with pytest.raises(ValueError, match="unknown checkpointing"):
        theory.checkpoint_name("some")
    with pytest.raises(ValueError, match="attention must be"):
        theory.activation_terms(s, b, h, a, attention="flash")
    # a recompute: one whole block (its input already kept), or one attention core
    full = theory.activation_bytes(s, b, h, a)
    assert theory.recompute_bytes(s, b, h, a, checkpoint="block") == full - 4 * s * b * h
    assert theory.recompute_bytes(s, b, h, a) == 0
    assert theory.recompute_bytes(s, b, h, a, checkpoint="attention") == (
        4 * s * b * h + 4 * a * s * b)
    assert theory.recompute_bytes(s, b, h, a, attention="explicit", checkpoint="attention") == (
        3 * 4 * s * b * h + 4 * a * s * s * b + s * s)


def test_explicit_attention_is_korthikanti_without_dropout_in_fp32():
    """Their sbh(34 + 5as/h) in 16-bit with dropout: take away the dropout masks (2sbh, as²b)
    and the dropout output (2as²b), double for fp32; add the statistics and the mask."""
    s, b, h, a = 128, 4, 64, 8
    paper = theory.activation_bytes_estimate(s, b, h, a)
    no_dropout = paper - 2 * s * b * h - 3 * a * s * s * b
    ours = theory.activation_bytes(s, b, h, a, attention="explicit")
    assert ours == 2 * no_dropout + 16 * s * b + s * s


def test_model_activations_and_the_peak():
    shape = theory.ModelShape(hidden=64, num_layers=4, num_heads=4, vocab_size=64)
    s, b = 256, 2
    head = theory.head_activation_bytes(s, b, 64, 64)
    assert head == 8 * (2 * s * b + s) + 4 * s * b * (2 * 64 + 64) + 8 * s * b
    kept = theory.model_activation_bytes(shape, s, b, peak=False)
    assert kept == 4 * theory.activation_bytes(s, b, 64, 4) + head
    assert theory.model_activation_bytes(shape, s, b) == kept  # no recompute: the end of forward
    # full checkpointing: backward's first recompute, (L - 1) inputs + one whole block
    one_input = 4 * s * b * 64
    peak = theory.model_activation_bytes(shape, s, b, checkpoint="block")
    assert peak == max(4 * one_input + head, 3 * one_input + theory.activation_bytes(s, b, 64, 4))


def test_model_shapes():
    assert theory.MODEL_SHAPES["125M"].num_params == 124_439_808 - 1024 * 768  # no positions
    eight = theory.MODEL_SHAPES["8B"]
    assert (eight.hidden, eight.num_layers, eight.num_heads, eight.vocab_size) == (
        4096, 32, 32, 128256)
    assert 7.4e9 < eight.num_params < 7.6e9  # Llama-3-8B's 8.0e9 has a wider, gated MLP


def test_longest_sequence():
    shape = theory.MODEL_SHAPES["8B"]
    states = theory.model_state_memory(8e9, 8, "ZeRO-3", precision="mixed").total
    kw = {"bytes_per_element": 2}
    longest = theory.longest_sequence(shape, 80e9, states, **kw)
    fits = states + theory.model_activation_bytes(shape, longest, **kw)
    assert fits <= 80e9 < states + theory.model_activation_bytes(shape, longest + 1, **kw)
    assert 14_000 < longest < 14_500  # notebook 08's figure
    alone = theory.longest_sequence(shape, 80e9, 0, **kw)  # N -> infinity: activations alone
    assert longest < theory.longest_sequence(shape, 80e9, states / 8, **kw) < alone < 18_000
    assert theory.longest_sequence(shape, 80e9, states, checkpoint="full", **kw) > 100_000
    assert theory.longest_sequence(shape, 80e9, 81e9, **kw) == 0
    assert theory.longest_sequence(shape, 1e15, 0, limit=1000, **kw) == 1000
