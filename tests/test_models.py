"""zerolab.models: deterministic small models with the awkward cases built in."""

import math

import pytest
import torch

from zerolab.models import GPT, MLP, GPTConfig, MLPConfig, num_params


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# --- MLP --------------------------------------------------------------------------------------


def test_mlp_same_seed_same_weights_different_seed_different():
    assert same_state(MLP(MLPConfig(seed=3)), MLP(MLPConfig(seed=3)))
    a, b = MLP(MLPConfig(seed=0)), MLP(MLPConfig(seed=1)).state_dict()
    for name, t in a.state_dict().items():
        if name == "gain":  # always 1.0
            assert torch.equal(t, b[name])
        else:
            assert not torch.equal(t, b[name]), name


def test_mlp_has_a_frozen_parameter_a_numel_1_parameter_and_a_buffer():
    model = MLP()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["layers.0.bias"]
    tiny = [n for n, p in model.named_parameters() if p.numel() == 1]
    assert tiny == ["gain"]
    assert [n for n, _ in model.named_buffers()] == ["input_shift"]
    assert "input_shift" not in dict(model.named_parameters())
    assert all(p.requires_grad for p in MLP(MLPConfig(freeze_first_bias=False)).parameters())


def test_mlp_num_params_by_hand():
    model = MLP()  # dims (16, 32, 32, 8)
    total = (16 * 32 + 32) + (32 * 32 + 32) + (32 * 8 + 8) + 1  # + gain
    assert num_params(model) == total == 1865
    assert num_params(model, trainable_only=True) == total - 32  # frozen first bias


def test_mlp_forward_shape_and_frozen_bias_gets_no_grad():
    model = MLP()
    x, y = model.make_batch(5)
    assert x.shape == (5, 16) and y.shape == (5, 8)
    out = model(x)
    assert out.shape == (5, 8)
    loss = model.loss(out, y)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    assert model.layers[0].bias.grad is None
    assert model.gain.grad is not None and model.gain.grad.shape == (1,)


def test_mlp_reuse_hidden_applies_a_layer_twice():
    cfg = MLPConfig(dims=(16, 24, 24, 24, 8), reuse_hidden=True)
    model = MLP(cfg)
    calls = []
    model.layers[1].register_forward_hook(lambda *_: calls.append(1))
    x, _ = model.make_batch(3)
    out = model(x)
    assert out.shape == (3, 8)
    assert len(calls) == 2
    # Same weights without reuse give a different function.
    plain = MLP(MLPConfig(dims=cfg.dims, reuse_hidden=False))
    assert same_state(model, plain)
    assert not torch.allclose(plain(x), out)


def test_mlp_make_batch_is_deterministic():
    model = MLP()
    x1, y1 = model.make_batch(4, seed=7)
    x2, y2 = model.make_batch(4, seed=7)
    x3, _ = model.make_batch(4, seed=8)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    # The same batch whatever the model's own seed: every rank can draw the global batch.
    assert torch.equal(MLP(MLPConfig(seed=5)).make_batch(4, seed=7)[0], x1)


# --- GPT --------------------------------------------------------------------------------------


# Default GPTConfig by hand: vocab 64, block 16, 2 layers, n_embd 32.
#   wte 64*32 = 2048, wpe 16*32 = 512, ln_f 2*32 = 64
#   per block: ln1 64 + qkv 32*96+96 = 3168 + proj 32*32+32 = 1056 + ln2 64
#              + fc 32*128+128 = 4224 + fc_out 128*32+32 = 4128  -> 12704
GPT_PARAMS = 2048 + 512 + 2 * 12704 + 64  # 28032; the tied head adds nothing


def test_gpt_tied_weights_counted_once():
    model = GPT()
    assert model.lm_head.weight is model.wte.weight
    assert num_params(model) == GPT_PARAMS == 28032
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # one Parameter
    untied = GPT(GPTConfig(tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert num_params(untied) == GPT_PARAMS + 64 * 32


def test_gpt_same_seed_same_weights_different_seed_different():
    assert same_state(GPT(GPTConfig(seed=2)), GPT(GPTConfig(seed=2)))
    a, b = GPT(GPTConfig(seed=0)).state_dict(), GPT(GPTConfig(seed=1)).state_dict()
    matrices = [k for k, v in a.items() if v.dim() >= 2]
    assert len(matrices) == 2 + 2 * 4 + 1  # wte, wpe, 4 Linear weights per block, lm_head
    for k in matrices:
        assert not torch.equal(a[k], b[k]), k


def test_gpt_forward_shape_and_initial_loss():
    model = GPT()
    idx, targets = model.make_batch(3)
    assert idx.shape == targets.shape == (3, 16)
    logits = model(idx)
    assert logits.shape == (3, 16, 64)
    # Weights of std 0.02 give near-uniform predictions: loss close to ln(vocab).
    assert model.loss(logits, targets).item() == pytest.approx(math.log(64), abs=0.05)
    # Shorter sequences work too (positions are taken from the input length).
    assert model(idx[:, :5]).shape == (3, 5, 64)


def test_gpt_make_batch_is_deterministic_next_token():
    model = GPT()
    x1, y1 = model.make_batch(4, seed=3)
    x2, y2 = model.make_batch(4, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, model.make_batch(4, seed=4)[0])
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # the target is the input shifted by one
    assert x1.dtype == torch.int64
    assert int(x1.min()) >= 0 and int(x1.max()) < 64


def test_gpt_tied_weight_gets_gradient_from_both_uses():
    model = GPT()
    idx, targets = model.make_batch(2)
    model.loss(model(idx), targets).backward()
    grad_both = model.wte.weight.grad.clone()
    # Untied copy with the same values: the tied gradient is the sum of the two uses.
    untied = GPT(GPTConfig(tie_weights=False))
    untied.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(model.wte.weight)
    untied.loss(untied(idx), targets).backward()
    assert torch.allclose(grad_both, untied.wte.weight.grad + untied.lm_head.weight.grad,
                          atol=1e-6)
