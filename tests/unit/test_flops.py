"""FLOPs model: hand counts, PyTorch's FLOP counter, the published closed forms, peaks, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megaformer.accelerators import UnknownGPUError, find_accelerator, peak_tflops
from megaformer.analysis.flops import (
    checkpointed_blocks,
    forward_flops,
    korthikanti_no_recompute,
    matmul_parameters,
    narayanan_full_recompute,
    palm_per_token,
    step_flops,
    utilisation,
)
from megaformer.analysis.params import count_parameters
from megaformer.config import ModelConfig
from tests.helpers import assert_one_line_error, cli_main, tiny_model


def gpt(L=2, h=64, heads=4, V=100, **kw) -> ModelConfig:
    """MHA + GELU with d_ffn = 4h and no biases: the architecture of the closed forms."""
    kw = dict(
        dict(position="learned", norm="layernorm", activation="gelu", tie_embeddings=False), **kw
    )
    return ModelConfig(vocab_size=V, d_model=h, n_layers=L, n_heads=heads, max_seq_len=512, **kw)


def test_hand_count_tiny_gqa_swiglu():
    # d=8, 2 heads of 4, 1 KV head (MQA), f=16, L=1, V=10, s=3, causal: 6 query-key pairs per head
    cfg = ModelConfig(
        vocab_size=10,
        d_model=8,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        d_ffn=16,
        activation="swiglu",
        max_seq_len=8,
    )
    f = forward_flops(cfg, 3)
    assert f.qkv == 2 * 3 * 8 * 8 + 2 * 2 * 3 * 8 * 4  # q: 8->8, k,v: 8->4
    assert f.attn_scores == f.attn_values == 2 * 6 * 8  # 6 pairs x h_q=8
    assert f.attn_out == 2 * 3 * 8 * 8
    assert f.mlp == 3 * 2 * 3 * 8 * 16  # three matrices
    assert f.logits == 2 * 3 * 8 * 10
    assert forward_flops(cfg, 3, causal=False).attn_scores == 2 * 9 * 8
    s = step_flops(cfg, 3, sequences=2)
    assert s.model == 3 * 2 * f.total and s.tokens == 6
    assert s.hardware == s.model  # no recompute, no padding


def test_gelu_has_two_matrices_and_gqa_shrinks_kv():
    base = gpt(L=1, h=32, heads=4)
    assert forward_flops(base, 5).mlp == 2 * 2 * 5 * 32 * 128
    gqa = gpt(L=1, h=32, heads=4, n_kv_heads=2)
    assert forward_flops(base, 5).qkv - forward_flops(gqa, 5).qkv == 2 * 2 * 5 * 32 * 16


@pytest.mark.parametrize(
    "kw",
    [
        dict(activation="gelu", n_kv_heads=None, tie_embeddings=False),
        dict(activation="swiglu", n_kv_heads=2, tie_embeddings=True),
        dict(activation="swiglu", n_kv_heads=1, tie_embeddings=True, residual="parallel"),
    ],
)
def test_equals_torch_flop_counter(kw):
    """PyTorch's FlopCounterMode (reference attention: full s^2, no mask skipping) over forward +
    backward of the real module equals 3 x forward_flops(causal=False) with the padded vocabulary."""
    from megaformer.model import Transformer

    cfg = tiny_model(attention_backend="reference", **kw)
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=64)
    x = torch.randint(0, 37, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(x, x).backward()
    expected = step_flops(cfg, 16, 2, causal=False, padded_vocab=64).hardware
    assert counter.get_total_flops() == expected


@pytest.mark.parametrize(
    "B,s,L,h,V", [(1, 128, 2, 64, 100), (8, 2048, 24, 2048, 51200), (512, 2048, 96, 12288, 51200)]
)
def test_closed_forms(B, s, L, h, V):
    cfg = gpt(L=L, h=h, heads=max(1, h // 128), V=V)
    none = step_flops(cfg, s, B, causal=False)
    assert none.model == pytest.approx(korthikanti_no_recompute(B, s, L, h, V), rel=1e-12)
    full = step_flops(cfg, s, B, causal=False, recompute="full")
    assert full.hardware == pytest.approx(narayanan_full_recompute(B, s, L, h, V), rel=1e-12)
    assert full.model == none.model  # recomputation is not model work
    # PaLM: N = matmul weights (blocks + output layer), non-causal attention
    N = matmul_parameters(cfg)
    counts = count_parameters(cfg)  # untied: output layer counted as embedding
    assert N == counts["non_embedding"] - (2 * L + 1) * h + V * h  # minus norm gains
    assert none.model_per_token == pytest.approx(
        palm_per_token(N, L, cfg.n_heads, cfg.head_dim, s), rel=1e-12
    )


def test_causal_selective_and_padding():
    cfg = gpt(L=4, h=64, heads=4, V=100)
    s = 64
    c, nc = forward_flops(cfg, s), forward_flops(cfg, s, causal=False)
    assert nc.attn_scores - c.attn_scores == cfg.n_layers * 2 * (s * (s - 1) // 2) * 64
    sel = step_flops(cfg, s, 1, recompute="selective")
    assert sel.hardware - sel.model == c.attn_scores + c.attn_values
    half = step_flops(cfg, s, 1, recompute="full", recompute_every=2)
    assert checkpointed_blocks(4, 2) == 2 and checkpointed_blocks(5, 2) == 3
    assert half.hardware - half.model == c.layers // 2
    pad = step_flops(cfg, s, 1, padded_vocab=128)
    assert pad.model == step_flops(cfg, s, 1).model  # MFU: real vocabulary
    assert pad.hardware - pad.model == 3 * 2 * s * 64 * 28  # HFU: the 28 padding rows too


def test_utilisation_and_peaks():
    cfg = gpt()
    f = step_flops(cfg, 128, 4)
    u = utilisation(f, step_time_s=0.5, world_size=2, peak_tflops=None)
    assert "mfu" not in u and u["tflops_per_gpu"] == pytest.approx(f.model / 0.5 / 2 / 1e12)
    u = utilisation(f, 0.5, 2, peak_tflops=1e-3)
    assert u["mfu"] == pytest.approx(u["tflops_per_gpu"] / 1e-3)
    assert find_accelerator("NVIDIA H100 80GB HBM3").name == "H100-SXM"
    assert find_accelerator("NVIDIA H100 PCIe").name == "H100-PCIe"
    assert find_accelerator("AMD Instinct MI300X").peak("bf16") == pytest.approx(1307.4)
    assert peak_tflops("A100-SXM4-80GB", "bf16") == 312
    assert peak_tflops(None, "bf16") is None  # no silent default
    assert peak_tflops("my-asic", "bf16", explicit=100.0) == 100.0
    with pytest.raises(UnknownGPUError, match="--peak-tflops"):
        peak_tflops("TPU v5p", "bf16")


def test_cli_flops_json_and_errors():
    r = cli_main(
        "flops",
        "configs/gpt2-124m.yaml",
        "--gpu",
        "A100",
        "--gpus",
        "8",
        "--step-time",
        "1.5",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["parameters"]["total"] == 124_439_808
    assert out["gpu"]["name"] == "A100-SXM" and out["gpu"]["peak_tflops"] == 312
    tokens = 480 * 1024
    assert out["step"]["tokens"] == tokens
    assert out["measured"]["tflops_per_gpu"] == pytest.approx(out["step"]["model"] / 1.5 / 8 / 1e12)
    assert 0 < out["measured"]["mfu"] < 1
    assert_one_line_error(
        cli_main("flops", "configs/gpt2-124m.yaml", "--gpu", "TPU-v5p", "--step-time", "1"),
        "unknown GPU",
    )
    assert_one_line_error(cli_main("flops", "does/not/exist.yaml"), "not found")
