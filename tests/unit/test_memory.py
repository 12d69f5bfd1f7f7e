"""Memory estimator against the CPU allocator's measured bytes, and its ZeRO / TP / PP arithmetic."""

from __future__ import annotations

import pytest
import torch

from megaformer.analysis.measure import measure, optimizer_state_tensors, tensor_bytes
from megaformer.analysis.memory import (
    Layout,
    activation_bytes,
    estimate,
    korthikanti_layer_bytes,
    params_per_rank,
    state_bytes,
)
from megaformer.analysis.params import count_parameters
from megaformer.config import MLAConfig, ModelConfig
from megaformer.model import Transformer

LLAMA = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
MLA = dict(LLAMA, attention="mla")
CONFIGS = {
    "llama-gqa": dict(LLAMA, n_kv_heads=2),
    "gpt-dropout": dict(
        vocab_size=300,
        d_model=96,
        n_layers=3,
        n_heads=4,
        max_seq_len=64,
        activation="gelu",
        position="learned",
        norm="layernorm",
        bias=True,
        tie_embeddings=False,
        dropout=0.1,
    ),
    # multi-head latent attention: value heads narrower than query heads, padded by the native
    # kernel; then without the query latent and with two multi-token prediction modules
    "mla": dict(MLA, mla=dict(q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=16, v_head_dim=24)),
    "mla-mtp": dict(MLA, mla=dict(q_lora_rank=None, kv_lora_rank=24, v_head_dim=16), mtp_depth=2),
}


def _measured(cfg: ModelConfig, B: int, s: int, mode: str, padded: int) -> tuple[int, int]:
    """(activation bytes held after forward, peak bytes of a whole AdamW training step)."""
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=padded)
    if mode != "none":
        from megaformer.parallel.recompute import apply_recompute

        apply_recompute(model.layers, mode, 1)
    x = torch.randint(0, cfg.vocab_size, (B, s))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer states exist from here on
    held = {}
    act = measure(lambda: held.setdefault("loss", model(x, x)))
    del held["loss"]
    base = tensor_bytes(list(model.parameters()) + optimizer_state_tensors(opt))
    return act.end, base + measure(step).peak


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_matches_measured_cpu_memory(name, mode):
    if mode != "none":
        pytest.importorskip("megaformer.parallel.recompute")
    kw = dict(CONFIGS[name])
    if "mla" in kw:
        kw["mla"] = MLAConfig(**{"qk_nope_head_dim": 16, **kw["mla"]})
    cfg = ModelConfig(**kw)
    B, s, padded = 4, 64, 384 if cfg.vocab_size > 256 else None
    act, peak = _measured(cfg, B, s, mode, padded)
    layout = Layout(micro_batch=B, recompute=mode, device="cpu")
    est_act = activation_bytes(cfg, s, layout, padded)["total"]
    est_peak = estimate(cfg, s, layout, padded).total
    assert abs(est_act / act - 1) < 0.05, (est_act, act)
    assert abs(est_peak / peak - 1) < 0.15, (est_peak, peak)


def test_model_states_under_zero_and_tp():
    cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=4, n_heads=4, max_seq_len=64)
    P = count_parameters(cfg)["total"]
    assert params_per_rank(cfg, Layout()) == P
    s0 = state_bytes(cfg, Layout(dp=4, zero=0, precision="bf16"))
    assert (s0["weights"], s0["grads"], s0["optimizer"]) == (2 * P, 2 * P, 12 * P)
    s1 = state_bytes(cfg, Layout(dp=4, zero=1, precision="bf16"))
    assert s1["optimizer"] == 3 * P and s1["grads"] == 2 * P
    s2 = state_bytes(cfg, Layout(dp=4, zero=2, precision="bf16"))
    assert s2["grads"] == P / 2 and s2["weights"] == 2 * P
    s3 = state_bytes(cfg, Layout(dp=4, zero=3, precision="bf16"))
    assert s3["total"] == 16 * P / 4  # ZeRO paper: (2 + 2 + 12) P / N_d
    # TP=2 halves matrices and vocabulary, replicates the norms (2 per block + final)
    norms = (2 * 4 + 1) * 64
    assert params_per_rank(cfg, Layout(tp=2)) == (P - norms) // 2 + norms


def test_real_adamw_states_equal_estimate():
    cfg = ModelConfig(**CONFIGS["llama-gqa"])
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    st = state_bytes(cfg, Layout(precision="fp32"))
    assert tensor_bytes(model.parameters()) == st["weights"]
    assert tensor_bytes(p.grad for p in model.parameters()) == st["grads"]
    assert tensor_bytes(optimizer_state_tensors(opt)) == st["optimizer"]


def test_activation_scaling_with_sp_and_recompute_and_korthikanti():
    cfg = ModelConfig(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, max_seq_len=4096)
    base = Layout(micro_batch=1, precision="bf16")
    a = activation_bytes(cfg, 4096, base)
    tp = activation_bytes(cfg, 4096, Layout(micro_batch=1, precision="bf16", tp=8))
    sp = activation_bytes(
        cfg, 4096, Layout(micro_batch=1, precision="bf16", tp=8, sequence_parallel=True)
    )
    assert sp["per_layer"] == pytest.approx(a["per_layer"] / 8)
    assert a["per_layer"] / 8 < tp["per_layer"] < a["per_layer"]
    full = activation_bytes(cfg, 4096, Layout(micro_batch=1, precision="bf16", recompute="full"))
    assert full["layers"] == 32 * 4096 * 4096 * 2  # 2 s b h bytes per layer
    # Korthikanti table 2 (s=2048, b=1, h=12288, a=96, t=8) relations
    s, b, h, heads = 2048, 1, 12288, 96
    none = korthikanti_layer_bytes(s, b, h, heads)
    assert none == s * b * h * (34 + 5 * heads * s / h)
    assert korthikanti_layer_bytes(s, b, h, heads, t=8, sp=True) == pytest.approx(none / 8)
    assert korthikanti_layer_bytes(
        s, b, h, heads, t=8, sp=True, recompute="selective"
    ) == pytest.approx(34 * s * b * h / 8)


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_pipeline_holds_its_warm_up_in_flight(v):
    """Interleaved with v stages per rank: rank 0 holds 2(p-1) + (v-1)p + 1 chunks of 1/v of its
    layers when m > p (every forward, m micro-batches, when m = p); the parameters per rank are
    1F1B's (the embedding on rank 0, the head on rank p-1)."""
    from megaformer.analysis.memory import pipeline_in_flight

    cfg = ModelConfig(**dict(LLAMA, n_layers=16))  # 16 stages at most: v p <= 16
    kw = dict(pp=4, micro_batch=2, precision="fp32", device="cpu")
    lay = Layout(**kw, grad_accum=8, schedule="interleaved", virtual_stages=v)
    assert pipeline_in_flight(lay) == pytest.approx((2 * 3 + (v - 1) * 4 + 1) / v)
    assert (
        pipeline_in_flight(Layout(**kw, grad_accum=4, schedule="interleaved", virtual_stages=v))
        == 4
    )
    one = Layout(**kw, grad_accum=8)
    a, b = activation_bytes(cfg, 32, one), activation_bytes(cfg, 32, lay)
    assert b["layers"] == pytest.approx(a["layers"] * pipeline_in_flight(lay) / 4)
    assert b["output"] == a["output"]
    assert params_per_rank(cfg, lay) == params_per_rank(cfg, one)
