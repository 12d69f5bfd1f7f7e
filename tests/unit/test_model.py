"""The model: shapes, masking, positions, GQA, residual forms, init, dropout, loss, KV-cache generation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from megaformer.config import ModelConfig
from megaformer.model import (
    MLP,
    Attention,
    Block,
    RotaryEmbedding,
    Transformer,
    apply_rotary,
    sinusoidal_table,
)

POSITIONS = ("rope", "learned", "sinusoidal", "none")


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def build(seed: int = 0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(tiny(**kw)).eval()


def ids(B: int = 2, T: int = 10, V: int = 37, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- shapes and masking


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(
            norm="layernorm",
            activation="gelu",
            bias=True,
            residual="parallel",
            tie_embeddings=False,
        ),
    ],
)
def test_shapes(position, variant):
    m = build(position=position, **variant)
    out = m(ids(2, 7))
    assert out.shape == (2, 7, 37) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("position", POSITIONS)
def test_causal_masking(position):
    m = build(
        position=position, n_kv_heads=2, init_std=0.3
    )  # large enough that attention is not ~uniform
    x = ids(2, 12)
    j = 6
    y = x.clone()
    y[:, j] = (y[:, j] + 1) % 37
    a, b = m(x), m(y)
    assert torch.allclose(a[:, :j], b[:, :j], atol=1e-6, rtol=0)
    assert (a[:, j:] - b[:, j:]).abs().amax(dim=-1).min() > 1e-3  # every later position changes


def test_attention_permutation_equivariance_without_positions_or_mask():
    cfg = tiny(position="none")
    torch.manual_seed(0)
    attn = Attention(cfg, causal=False).eval()
    x = torch.randn(2, 9, 32)
    perm = torch.randperm(9, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(perm, torch.arange(9))
    assert torch.allclose(attn(x[:, perm]), attn(x)[:, perm], atol=1e-5, rtol=0)

    torch.manual_seed(0)
    causal = Attention(cfg, causal=True).eval()
    assert (causal(x[:, perm]) - causal(x)[:, perm]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- positions


@pytest.mark.parametrize("k", [1, 5])
def test_sinusoidal_shift_is_a_fixed_linear_map(k):
    n, d = 512, 16
    pe = sinusoidal_table(n, d, dtype=torch.float64)
    assert torch.allclose(pe.float(), sinusoidal_table(n, d), atol=1e-7)
    assert pe[3, 4] == pytest.approx(math.sin(3 / 10000 ** (4 / d)))
    assert pe[3, 5] == pytest.approx(math.cos(3 / 10000 ** (4 / d)))
    idx = torch.linspace(0, n - k - 1, 24).long()  # a few positions
    M = torch.linalg.lstsq(pe[idx], pe[idx + k]).solution.T  # PE(pos) M^T = PE(pos + k)
    assert (pe[: n - k] @ M.T - pe[k:]).abs().max() < 1e-4  # for every position
    predicted = torch.zeros(d, d, dtype=torch.float64)
    for i in range(
        d // 2
    ):  # [sin(a+b), cos(a+b)] = [[cos b, sin b], [-sin b, cos b]] [sin a, cos a]
        b = k / 10000 ** (2 * i / d)
        predicted[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(
            [[math.cos(b), math.sin(b)], [-math.sin(b), math.cos(b)]], dtype=torch.float64
        )
    assert (M - predicted).abs().max() < 1e-4


def complex_rope(x: torch.Tensor, positions: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    """Independent RoPE: pair (i, i + rot/2) is the complex x_i + j x_{i+rot/2}, times e^{j pos w_i}."""
    x = x.double()
    half = rot // 2
    w = torch.tensor([theta ** (-2 * i / rot) for i in range(half)], dtype=torch.float64)
    z = torch.complex(x[..., :half], x[..., half:rot])
    z = z * torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64),
        positions.double()[:, None] * w[None, :],
    )
    return torch.cat((z.real, z.imag, x[..., rot:]), dim=-1)


@pytest.mark.parametrize("fraction", [1.0, 0.25])
def test_rope_matches_complex_reference(fraction):
    head_dim = 16
    rope = RotaryEmbedding(head_dim, fraction, theta=500.0)
    assert rope.rot == int(head_dim * fraction)
    x = torch.randn(2, 3, 7, head_dim)
    pos = torch.arange(5, 12)
    out = apply_rotary(x, *rope(pos))
    ref = complex_rope(x, pos, rope.rot, 500.0)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.equal(out[..., rope.rot :], x[..., rope.rot :])


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding(16, 1.0, 10000.0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(m, n):
        qm = apply_rotary(q, *rope(torch.tensor([m])))
        kn = apply_rotary(k, *rope(torch.tensor([n])))
        return (qm * kn).sum().item()

    assert score(7, 3) == pytest.approx(score(12, 8), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


# ----------------------------------------------------------------------------- dimensions and GQA


def test_head_dim_and_default_ffn():
    cfg = tiny(n_heads=4, activation="gelu")
    attn, mlp = Attention(cfg), MLP(cfg)
    assert attn.head_dim == 32 // 4 == cfg.head_dim
    assert attn.wq.weight.shape == (32, 32) and attn.wo.weight.shape == (32, 32)
    assert mlp.w1.weight.shape == (4 * 32, 32) and mlp.w2.weight.shape == (32, 4 * 32)
    assert not hasattr(mlp, "w3")
    gqa = Attention(tiny(n_kv_heads=2))
    assert gqa.wk.weight.shape == (2 * 8, 32) and gqa.wv.weight.shape == (2 * 8, 32)
    sw = MLP(tiny(d_model=96, n_heads=4, activation="swiglu"))
    assert (
        sw.w1.weight.shape[0] == sw.w3.weight.shape[0] == 256
    )  # 2/3 * 4 * 96 = 256, multiple of 64


def test_gqa_with_all_kv_heads_is_mha():
    a = build(seed=3)
    b = build(seed=3, n_kv_heads=4)
    x = ids()
    assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("n_kv", [2, 1])
def test_gqa_and_mqa_equal_mha_with_duplicated_kv_heads(n_kv):
    gqa = build(seed=4, n_kv_heads=n_kv)
    mha = build(seed=5)
    groups, dk = 4 // n_kv, 8
    state = {}
    for name, p in gqa.state_dict().items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):
            p = p.view(n_kv, dk, 32).repeat_interleave(groups, dim=0).reshape(4 * dk, 32)
        state[name] = p
    mha.load_state_dict(state)
    x = ids()
    assert torch.allclose(gqa(x), mha(x), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- residual forms


def _rms(x, g, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _hand_attention(blk: Block, x: torch.Tensor) -> torch.Tensor:
    a = blk.attn
    B, T, d = x.shape
    q = (x @ a.wq.weight.T).view(B, T, 4, 8).transpose(1, 2)
    k = (x @ a.wk.weight.T).view(B, T, 4, 8).transpose(1, 2)
    v = (x @ a.wv.weight.T).view(B, T, 4, 8).transpose(1, 2)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    s = s + torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
    return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, d) @ a.wo.weight.T


def _hand_mlp(blk: Block, x: torch.Tensor) -> torch.Tensor:
    m = blk.mlp
    return (F.silu(x @ m.w1.weight.T) * (x @ m.w3.weight.T)) @ m.w2.weight.T


def test_sequential_and_parallel_residual_match_formulas():
    x = torch.randn(2, 6, 32)
    outs = {}
    for residual in ("sequential", "parallel"):
        cfg = tiny(position="none", residual=residual)
        torch.manual_seed(0)
        blk = Block(cfg).eval()
        for p in blk.parameters():  # non-trivial norm gains too
            nn.init.normal_(p, std=0.3) if p.dim() > 1 else nn.init.uniform_(p, 0.5, 1.5)
        ga, gm, eps = blk.attn_norm.weight, blk.mlp_norm.weight, cfg.norm_eps
        with torch.no_grad():
            out = blk(x)
            if residual == "sequential":
                h = x + _hand_attention(blk, _rms(x, ga, eps))
                expected = h + _hand_mlp(blk, _rms(h, gm, eps))
            else:
                expected = (
                    x + _hand_attention(blk, _rms(x, ga, eps)) + _hand_mlp(blk, _rms(x, gm, eps))
                )
        # fp32 round-off of sums over d terms scales with the outputs (|out| up to ~25 here)
        scale = float(expected.abs().max())
        assert torch.allclose(out, expected, atol=1e-6 * scale, rtol=1e-5), residual
        outs[residual] = out
    assert (outs["sequential"] - outs["parallel"]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- parameters and init


def test_tied_and_untied_embeddings():
    tied, untied = build(tie_embeddings=True), build(tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_embeddings.weight
    assert tied.lm_head.weight.data_ptr() == tied.tok_embeddings.weight.data_ptr()
    assert untied.lm_head.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert untied.num_parameters() - tied.num_parameters() == 37 * 32
    assert tied.num_parameters(exclude_embeddings=True) == untied.num_parameters(
        exclude_embeddings=True
    )


@pytest.mark.parametrize("bias", [True, False])
def test_biases_follow_config(bias):
    m = build(bias=bias, norm="layernorm", activation="gelu")
    for name, mod in m.named_modules():
        if isinstance(mod, (nn.Linear, nn.LayerNorm)):
            expect = bias and name != "lm_head"
            assert (mod.bias is not None) == expect, name
            if mod.bias is not None:
                assert torch.count_nonzero(mod.bias) == 0


def test_scaled_init():
    L, std = 8, 0.02
    m = build(d_model=64, n_heads=4, n_layers=L, d_ffn=256, init_std=std, bias=True)
    out = torch.cat(
        [torch.cat([b.attn.wo.weight.flatten(), b.mlp.w2.weight.flatten()]) for b in m.layers]
    )
    other = torch.cat(
        [torch.cat([b.attn.wq.weight.flatten(), b.mlp.w1.weight.flatten()]) for b in m.layers]
    )
    assert out.std().item() == pytest.approx(std / math.sqrt(2 * L), rel=0.05)
    assert out.mean().abs() < 1e-3
    assert other.std().item() == pytest.approx(std, rel=0.05)
    assert m.tok_embeddings.weight.std().item() == pytest.approx(std, rel=0.05)
    for b in m.layers:
        assert torch.equal(b.attn_norm.weight, torch.ones(64))
        assert torch.count_nonzero(b.attn.wq.bias) == 0


def test_same_seed_same_weights():
    a, b, c = build(seed=7), build(seed=7), build(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.attn.wq.weight"], sc["layers.0.attn.wq.weight"])


def test_dropout_behaviour():
    x = ids()
    m0 = build(dropout=0.0).train()
    assert torch.equal(m0(x), m0(x))
    m = build(dropout=0.2, attention_dropout=0.2).train()
    assert not torch.allclose(m(x), m(x))
    m.eval()
    assert torch.equal(m(x), m(x))


# ----------------------------------------------------------------------------- loss


def test_loss_is_cross_entropy_ignoring_minus_100():
    m = build()
    x = ids(2, 10)
    labels = ids(2, 10, seed=9)
    labels[0, :4] = -100
    labels[1, 7] = -100
    logits = m(x)
    loss = m(x, labels=labels)
    assert loss.dim() == 0
    assert torch.allclose(
        loss, F.cross_entropy(logits.view(-1, 37), labels.view(-1), ignore_index=-100)
    )
    keep = labels != -100
    manual = -torch.log_softmax(logits[keep], -1).gather(-1, labels[keep][:, None]).mean()
    assert torch.allclose(loss, manual, atol=1e-6)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % 37  # last input only affects the last position's logits
    labels2 = labels.clone()
    labels2[:, -1] = -100
    assert torch.allclose(m(x, labels=labels2), m(x2, labels=labels2), atol=1e-6)


def test_too_long_raises():
    m = build()
    with pytest.raises(ValueError, match="max_seq_len"):
        m(ids(1, 17))
    with pytest.raises(ValueError, match="max_seq_len"):
        m.forward_cached(ids(1, 4), None, start_pos=14)


def test_vocab_size_must_be_set():
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(tiny(vocab_size=None))


# ----------------------------------------------------------------------------- KV cache and generation


def naive_greedy(m: Transformer, x: torch.Tensor, n: int) -> torch.Tensor:
    L = m.cfg.max_seq_len
    for _ in range(n):
        nxt = m(x[:, -L:])[:, -1].argmax(-1, keepdim=True)
        x = torch.cat((x, nxt), 1)
    return x


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal"])
def test_cached_logits_equal_full_forward(position):
    m = build(position=position, n_kv_heads=2)
    x = ids(2, 11)
    full = m(x)
    logits, cache = m.forward_cached(x[:, :6], None, 0)
    parts = [logits]
    for t in range(
        6, 11, 2
    ):  # chunks of 2 then 1: T < S with T > 1 exercises the bottom-right mask
        logits, cache = m.forward_cached(x[:, t : t + 2], cache, t)
        parts.append(logits)
    assert torch.allclose(torch.cat(parts, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal"])
def test_cached_greedy_generation_equals_naive(position):
    m = build(seed=2, position=position, n_kv_heads=2, init_std=0.3)
    prompt = ids(1, 5)
    fast = m.generate(prompt, 20, temperature=0)  # 25 > max_seq_len 16: crosses the full context
    assert fast.shape == (1, 25)
    assert torch.equal(fast, naive_greedy(m, prompt, 20))
    long_prompt = ids(1, 20)  # longer than max_seq_len: cropped from the left
    assert torch.equal(m.generate(long_prompt, 3, temperature=0), naive_greedy(m, long_prompt, 3))


def test_generate_eos_sampling_and_mode():
    m = build(seed=2, init_std=0.3).train()
    prompt = ids(1, 4)
    greedy = m.generate(prompt, 6, temperature=0)
    assert m.training  # mode restored
    eos = int(greedy[0, 6])  # the third generated token
    stopped = m.generate(prompt, 6, temperature=0, eos_id=eos)
    assert torch.equal(stopped, greedy[:, :7])
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    s1 = m.generate(prompt, 8, temperature=1.0, top_k=5, generator=g1)
    s2 = m.generate(prompt, 8, temperature=1.0, top_k=5, generator=g2)
    assert torch.equal(s1, s2) and s1.shape == (1, 12)
    top1 = m.generate(prompt, 6, temperature=0.7, top_k=1, generator=g1)
    assert torch.equal(top1, greedy)


def test_meta_device_construction():
    with torch.device("meta"):
        m = Transformer(tiny(position="sinusoidal"))
    assert m.tok_embeddings.weight.is_meta
    assert m.num_parameters() == build(position="sinusoidal").num_parameters()
    m = m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    ref = build(seed=0, position="sinusoidal")
    torch.manual_seed(0)
    ref.reset_parameters()  # same RNG stream as m's (construction on CPU drew from it too)
    assert torch.equal(m.pos_table, ref.pos_table)
    assert m.lm_head.weight is m.tok_embeddings.weight
    assert torch.allclose(m.eval()(ids()), ref(ids()))
