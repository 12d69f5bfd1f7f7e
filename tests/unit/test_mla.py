"""Multi-head latent attention against the equations written out by hand in fp64 (with and
without the query latent, with YaRN and DeepSeek's attention scale), on every attention backend
(value heads narrower than the query/key heads), and its latent KV cache against the full
forward."""

from __future__ import annotations

import math

import pytest
import torch

from megaformer.config import ModelConfig
from megaformer.config.model import MLAConfig
from megaformer.model.mla import LatentAttention, LatentKVCache
from megaformer.model.transformer import Transformer

D, H, T = 32, 4, 10
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "mscale": 0.7,
    "mscale_all_dim": 0.7,
}


def _cfg(q_lora: bool, yarn: bool, **extra) -> ModelConfig:
    base = dict(vocab_size=50, d_model=D, n_layers=2, n_heads=H, max_seq_len=32)
    return ModelConfig(
        **{**base, **extra},
        attention="mla",
        mla=MLAConfig(
            q_lora_rank=12 if q_lora else None,
            kv_lora_rank=10,
            qk_nope_head_dim=12,
            qk_rope_head_dim=4,
            v_head_dim=8,
        ),
        rope_scaling=dict(YARN) if yarn else None,
    )


def _rms(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


def _rope(x: torch.Tensor, inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """x [..., T, d_r]: pair (i, i + d_r/2) rotated by t * w_i, cos and sin times ``factor``."""
    t = torch.arange(x.shape[-2], dtype=torch.float64)
    ang = torch.outer(t, inv_freq.double())
    cos, sin = torch.cos(ang) * factor, torch.sin(ang) * factor
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float, float]:
    """(w_i, the factor on cos/sin, the factor on the logits): YaRN's taken from transformers'
    own implementation, DeepSeek's logit scale m^2 written here."""
    d_r = cfg.mla.qk_rope_head_dim
    if cfg.rope_scaling is None:
        w = 10000.0 ** (-torch.arange(0, d_r, 2, dtype=torch.float64) / d_r)
        return w, 1.0, 1.0
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = DeepseekV3Config(
        hidden_size=D,
        num_attention_heads=H,
        qk_rope_head_dim=d_r,
        max_position_embeddings=32,
        rope_parameters={**cfg.rope_scaling, "rope_theta": 10000.0},
    )
    w, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    s, m_all = cfg.rope_scaling["factor"], cfg.rope_scaling["mscale_all_dim"]
    m = 0.1 * m_all * math.log(s) + 1.0
    return w, attention_factor, m * m


def reference(attn: LatentAttention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The equations of DeepSeek-V2 section 2.1, head by head, in fp64."""
    mla = cfg.mla
    dn, dr, dv, dc = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    W = {k: v.double() for k, v in attn.named_parameters()}
    w, cs_factor, logit_factor = _frequencies(cfg)
    x = x.double()
    if mla.q_lora_rank is None:
        q_all = x @ W["wq.weight"].T
    else:
        c_q = _rms(x @ W["wq_a.weight"].T, W["q_norm.weight"])  # c^Q = RMSNorm(W^DQ h)
        q_all = c_q @ W["wq_b.weight"].T  # W^UQ c^Q
    a = x @ W["wkv_a.weight"].T
    c_kv = _rms(a[..., :dc], W["kv_norm.weight"])  # c^KV
    k_r = _rope(a[..., dc:], w, cs_factor)  # k^R, shared by the heads
    kv_all = c_kv @ W["wkv_b.weight"].T  # W^UKV c^KV
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    heads = []
    for i in range(H):
        qi = q_all[..., i * (dn + dr) : (i + 1) * (dn + dr)]
        q_c, q_r = qi[..., :dn], _rope(qi[..., dn:], w, cs_factor)
        kvi = kv_all[..., i * (dn + dv) : (i + 1) * (dn + dv)]
        k_c, v_i = kvi[..., :dn], kvi[..., dn:]
        logits = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r.transpose(-1, -2)) * (
            logit_factor / math.sqrt(dn + dr)
        )
        probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)
        heads.append(probs @ v_i)
    return torch.cat(heads, dim=-1) @ W["wo.weight"].T


def _module(cfg: ModelConfig) -> LatentAttention:
    torch.manual_seed(0)
    attn = LatentAttention(cfg).double()
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return attn


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("yarn", [False, True])
def test_equals_the_equations_in_fp64(q_lora, yarn):
    cfg = _cfg(q_lora, yarn, attention_backend="reference")
    attn = _module(cfg)
    x = torch.randn(2, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours, ref = attn(x), reference(attn, x, cfg)
    assert ref.std() > 0.1
    # 1e-6, not fp64's 1e-12: the rotary cos/sin tables are fp32, as transformers computes them
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    if yarn:  # the YaRN scales change the function: the check above is not vacuous
        plain = _module(_cfg(q_lora, False, attention_backend="reference"))
        assert (plain(x) - ours).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_every_backend_takes_value_heads_narrower_than_query_heads(backend):
    """sdpa takes d_v = 8 != d_n + d_r = 16 as is; auto on fp32 CPU is the native kernel, which
    runs on value heads padded with zero columns: all equal the fp64 equations, forward and
    backward."""
    cfg = _cfg(True, True, attention_backend=backend)
    ref_attn = _module(_cfg(True, True, attention_backend="reference"))
    attn = LatentAttention(cfg)
    attn.load_state_dict({k: v.float() for k, v in ref_attn.state_dict().items()})
    x = torch.randn(2, T, D, generator=torch.Generator().manual_seed(2), requires_grad=True)
    xr = x.detach().double().requires_grad_()
    ours, ref = attn(x), reference(ref_attn, xr, cfg)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=1e-5)
    ours.square().sum().backward()
    ref.square().sum().backward()
    grads = [("x", x.grad, xr.grad)]
    grads += [
        (n, p.grad, q.grad) for (n, p), q in zip(attn.named_parameters(), ref_attn.parameters())
    ]
    for name, g, g_ref in grads:  # fp32 against fp64: relative to the gradient's size
        err = (g.double() - g_ref).abs().max() / g_ref.abs().max()
        assert err < 1e-5, (name, err.item())


def test_latent_cache_holds_the_latent_and_decodes_as_the_full_forward():
    cfg = _cfg(True, True, attention_backend="sdpa")
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        cache = model.new_cache()
        first, _ = model.forward_cached(ids[:, :7], cache, 0)
        steps = [model.forward_cached(ids[:, t : t + 1], cache, t)[0] for t in range(7, 12)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, rtol=0, atol=1e-5)
    layer = cache.layers[0]
    assert isinstance(layer, LatentKVCache)
    # per token and layer: d_c + d_r = 10 + 4 numbers, not h (d_n + d_r + d_v) = 4 * 24
    assert layer.latent.shape == (2, 32, 10) and layer.k_rope.shape == (2, 1, 32, 4)


@pytest.mark.parametrize(
    "model,needle",
    [
        ({"attention": "mla", "mla": {"kv_lora_rank": 0}}, "model.mla.kv_lora_rank=0: must be > 0"),
        ({"attention": "mla", "mla": {"qk_rope_head_dim": 3}}, "qk_rope_head_dim=3: must be even"),
        ({"attention": "mla", "n_kv_heads": 2}, "model.n_kv_heads=2: not supported with"),
        ({"attention": "mla", "position": "learned"}, "model.position=learned: not supported"),
        ({"attention": "mla", "bias": True}, "its projections have no biases"),
        ({"attention": "gqa"}, "model.attention"),
        ({"moe": {"interval": 1, "num_groups": 3}}, "num_groups=3: must divide"),
        ({"moe": {"interval": 1, "num_groups": 4, "top_groups": 5}}, "top_groups=5: more than"),
        (
            {
                "moe": {
                    "interval": 1,
                    "num_experts": 8,
                    "top_k": 3,
                    "num_groups": 4,
                    "top_groups": 1,
                }
            },
            "the groups kept hold fewer than model.moe.top_k=3",
        ),
        ({"moe": {"interval": 1, "first_dense": 4}}, "first_dense=4: no block would be MoE"),
        ({"moe": {"interval": 1, "routed_scaling_factor": 0}}, "routed_scaling_factor=0"),
    ],
)
def test_config_errors_are_one_line(model, needle):
    from megaformer.config import ConfigError, config_from_dict, validate

    with pytest.raises(ConfigError) as e:
        validate(config_from_dict({"model": model}))
    assert needle in str(e.value) and "\n" not in str(e.value)
    ok = {"attention": "mla", "moe": {"interval": 1, "num_groups": 4, "top_groups": 2}}
    validate(config_from_dict({"model": ok}))


def _deepseek_tiny(**kw) -> ModelConfig:
    """Multi-head latent attention with the DeepSeek-V3 MoE: the first block dense, 8 experts in
    4 groups of which 2 are kept, one shared expert."""
    from megaformer.config import MoEConfig

    return _cfg(
        True,
        True,
        attention_backend="reference",
        n_layers=3,
        d_ffn=48,
        moe=MoEConfig(
            interval=1,
            first_dense=1,
            num_experts=8,
            top_k=3,
            score="sigmoid",
            d_expert=16,
            num_shared_experts=1,
            num_groups=4,
            top_groups=2,
            routed_scaling_factor=2.5,
        ),
        **kw,
    )


@pytest.mark.parametrize("q_lora", [True, False])
def test_parameter_and_flop_counts_equal_the_module_and_the_flop_counter(q_lora):
    from torch.utils.flop_counter import FlopCounterMode

    from megaformer.analysis.flops import step_flops
    from megaformer.analysis.params import count_parameters

    cfg = _deepseek_tiny()
    if not q_lora:
        cfg.mla.q_lora_rank = None
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=64)
    counts = count_parameters(cfg)
    assert counts["total"] == model.num_parameters()
    with torch.device("meta"):  # the same count from a model built on meta
        on_meta = Transformer(cfg)
    assert counts["total"] == on_meta.num_parameters()
    per_expert = 3 * cfg.d_model * cfg.expert_dim
    assert counts["total"] - counts["active"] == 2 * (8 - 3) * per_expert  # 2 MoE blocks
    x = torch.randint(0, 50, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    assert (
        counter.get_total_flops() == step_flops(cfg, 16, 2, causal=False, padded_vocab=64).hardware
    )


def test_both_context_modes_are_taken():
    from megaformer.config import config_from_dict, validate

    for mode in ("ring", "all_to_all"):
        raw = {"model": {"attention": "mla", "max_seq_len": 64}, "parallel": {"context": 2}}
        raw["parallel"]["context_mode"] = mode
        validate(config_from_dict(raw))


def test_fp8_converts_every_projection_and_counts_their_flops():
    from megaformer.analysis.flops import forward_flops, fp8_forward_flops
    from megaformer.parallel.fp8 import apply_fp8

    cfg = _cfg(True, False, d_ffn=64, max_seq_len=32)
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=64)
    x = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        before = model(x, x)
    assert apply_fp8(model, "tensorwise", True) == 2 * 8
    converted = {n for n, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    names = ("attn.wq_a", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo")
    assert converted == {
        f"layers.{i}.{n}" for i in range(2) for n in (*names, "mlp.w1", "mlp.w3", "mlp.w2")
    }
    with torch.no_grad():
        after = model(x, x)
    assert 0 < abs(after.item() - before.item()) < 0.05  # quantised, not broken
    total = forward_flops(cfg, 16)
    assert fp8_forward_flops(cfg, 16) == total.qkv + total.attn_out + total.mlp
