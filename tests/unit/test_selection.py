"""Which implementation runs for each op: the rules of megaformer.kernels.selection, checked on CPU
for CUDA devices too (the capabilities are stubbed), and that deciding creates no autograd state."""

from __future__ import annotations

import types

import pytest
import torch

from megaformer.config import ModelConfig
from megaformer.errors import ConfigError
from megaformer.kernels import capabilities, selection
from megaformer.kernels.selection import choose, kernel_mode, model_plan, set_mode


@pytest.fixture
def gpu_capabilities(monkeypatch):
    """CUDA capabilities as on a GPU node: triton importable, no apex, no flash-attn (the rules
    look only at these facts, so they can be checked here)."""
    selection._decide.cache_clear()
    monkeypatch.setattr(capabilities, "triton_status", lambda: (True, "triton (stub)"))
    monkeypatch.setattr(capabilities, "apex_status", lambda: (None, "no apex (stub)"))
    monkeypatch.setattr(capabilities, "flash_status", lambda: (None, "no flash-attn (stub)"))
    yield monkeypatch
    selection._decide.cache_clear()


def test_norms_on_cuda_follow_a_rule_not_a_timing(gpu_capabilities):
    """Same dtypes: torch's native fused op (LayerNorm; RMSNorm on torch >= 2.8), mixed dtypes
    (bf16 activations, fp32 gain): the Triton kernel -- the same answer every call, on every rank."""
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose("layer_norm", "cuda", bf16, weight_dtype=bf16).impl == "torch-native"
    rms_same = choose("rms_norm", "cuda", bf16, weight_dtype=bf16).impl
    assert rms_same == ("torch-native" if selection._TORCH_FUSED_RMS_NORM else "triton")
    assert choose("rms_norm", "cuda", bf16, weight_dtype=fp32).impl == "triton"
    assert choose("layer_norm", "cuda", bf16, weight_dtype=fp32).impl == "triton"
    assert {choose("rms_norm", "cuda", bf16, weight_dtype=fp32).impl for _ in range(5)} == {
        "triton"
    }


def test_apex_only_with_its_extension_and_where_it_is_right(gpu_capabilities):
    """apex runs norms of matching dtypes outside autocast, never a bias-less LayerNorm."""
    fake = types.SimpleNamespace()
    gpu_capabilities.setattr(capabilities, "apex_status", lambda: (fake, "apex (stub)"))
    bf16 = torch.bfloat16
    assert choose("rms_norm", "cuda", bf16, weight_dtype=bf16).impl == "apex"
    assert choose("layer_norm", "cuda", bf16, weight_dtype=bf16, bias=True).impl == "apex"
    assert choose("layer_norm", "cuda", bf16, weight_dtype=bf16, bias=False).impl != "apex"
    assert choose("rms_norm", "cuda", bf16, weight_dtype=bf16, autocast=True).impl != "apex"
    assert choose("rms_norm", "cuda", bf16, weight_dtype=torch.float32).impl != "apex"


def test_python_only_apex_is_not_trusted(monkeypatch):
    """apex without its compiled fused_layer_norm_cuda extension is reported, not used."""
    capabilities.apex_status.cache_clear()
    real = capabilities._try_import
    monkeypatch.setattr(
        capabilities,
        "_try_import",
        lambda m: (
            (None, f"{m} not installed")
            if m == "fused_layer_norm_cuda"
            else (types.SimpleNamespace(), "")
        ),
    )
    try:
        module, why = capabilities.apex_status()
        assert module is None and "fused_layer_norm_cuda" in why
    finally:
        monkeypatch.setattr(capabilities, "_try_import", real)
        capabilities.apex_status.cache_clear()


def test_cuda_rules_for_the_other_ops(gpu_capabilities):
    bf16 = torch.bfloat16
    assert choose("swiglu", "cuda", bf16).impl == "triton"
    assert (
        choose("bias_gelu", "cuda", bf16, autocast=True).impl == "triton"
    )  # fp32 bias under autocast
    assert (
        choose("projections", "cuda", bf16).impl == "separate"
    )  # no weight concatenation per call
    assert choose("linear", "cuda", bf16).impl == "torch"
    assert choose("dropout", "cuda", bf16).impl == "torch"
    assert choose("rope", "cuda", bf16).impl == "torch"
    assert (
        choose(
            "attention", "cuda", bf16, backend="auto", head_dim=128, dropout=False, doc_mask=False
        ).impl
        == "sdpa"
    )
    with kernel_mode("torch"):
        assert choose("swiglu", "cuda", bf16).impl == "torch"
    # inside torch.compile inductor fuses the torch ops itself
    assert choose("swiglu", "cuda", bf16, compiling=True).impl == "torch"


def test_unknown_mode_and_op_are_refused():
    with pytest.raises(ConfigError, match="kernels='cuda'"):
        set_mode("cuda")
    with pytest.raises(ValueError, match="unknown op"):
        choose("softmax2", "cpu", torch.float32)


def test_model_plan_names_every_op_of_the_model():
    cfg = ModelConfig(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        dropout=0.1,
    )
    plan = dict(model_plan(cfg, torch.device("cpu"), torch.float32))
    assert set(plan) == {
        "linear",
        "projections",
        "attention",
        "rms_norm",
        "swiglu",
        "rope",
        "dropout",
        "cross_entropy",
    }
    assert all(c.reason for c in plan.values())
    torch_plan = dict(
        model_plan(
            ModelConfig(**{**cfg.__dict__, "kernels": "torch"}), torch.device("cpu"), torch.float32
        )
    )
    assert {c.impl for op, c in torch_plan.items() if op != "attention"} == {"torch"}
    assert selection.get_mode() == "auto"  # the plan did not change this process's mode


def test_deciding_saves_nothing_for_autograd():
    """Under full recomputation (a non-reentrant checkpoint, which compares the tensors saved in
    forward and in the replay) the first call of each op saves as many tensors as any later call:
    choosing an implementation runs nothing on tensors (no timing of candidates at first use)."""
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.recompute import apply_recompute

    selection._decide.cache_clear()
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(cfg)
    apply_recompute(model.layers, "full")
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    counts = []
    for _ in range(2):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
            loss = model(x, x)
        loss.backward()
        counts.append(len(saved))
    assert counts[0] == counts[1] > 0


def test_ring_block_kernel_rule():
    """Ring attention's block kernel (one key block with its log-sum-exp): aten's CPU
    FlashAttention on CPU; on CUDA FlashAttention-2 for unmasked pairs in fp16/bf16, the
    memory-efficient kernel where a pair needs an explicit mask or the dtype/head size rules
    FlashAttention-2 out."""
    from megaformer.kernels.selection import choose

    def impl(device, dtype, head_dim=128, masked=False):
        return choose("attention_block", device, dtype, head_dim=head_dim, masked=masked).impl

    assert {
        impl("cpu", dt, masked=m) for dt in (torch.float32, torch.bfloat16) for m in (0, 1)
    } == {"cpu-flash"}
    assert impl("cuda", torch.bfloat16) == "flash"
    assert impl("cuda", torch.bfloat16, masked=True) == "efficient"
    assert impl("cuda", torch.float32) == "efficient"
    assert impl("cuda", torch.float16, head_dim=320) == "efficient"
