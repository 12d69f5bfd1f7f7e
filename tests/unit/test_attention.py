"""Attention kernels: every available path agrees with the reference; backend resolution."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from megaformer.errors import ConfigError
from megaformer.kernels import attention as kernels
from megaformer.kernels import capabilities
from megaformer.kernels.attention import attention
from megaformer.kernels.selection import choose, track


def resolve(backend, device, dtype, head_dim=16, dropout=False, doc_mask=False):
    return choose(
        "attention",
        device,
        dtype,
        backend=backend,
        head_dim=head_dim,
        dropout=dropout,
        doc_mask=doc_mask,
    )


HEADS = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
LENGTHS = [(6, 6), (3, 8), (1, 8)]  # T == S, and the KV-cache cases T < S


def qkv(B, H, Hkv, T, S, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, Hkv, S, D, generator=g)
    v = torch.randn(B, Hkv, S, D, generator=g)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def naive(q, k, v, causal):
    """Loop over heads and queries, in float64: softmax(q k^T / sqrt(D)) v over allowed keys."""
    B, H, T, D = q.shape
    S, groups = k.shape[2], H // k.shape[1]
    out = torch.zeros(B, H, T, D, dtype=torch.float64)
    for h in range(H):
        for i in range(T):
            n = (S - T + i + 1) if causal else S  # query i sits at absolute position S - T + i
            kk, vv = k[:, h // groups, :n].double(), v[:, h // groups, :n].double()  # [B, n, D]
            s = torch.einsum("bd,bnd->bn", q[:, h, i].double(), kk) / math.sqrt(D)
            out[:, h, i] = torch.einsum("bn,bnd->bd", torch.softmax(s, -1), vv)
    return out


@pytest.mark.parametrize("T,S", LENGTHS)
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_reference_matches_naive_loop(causal, H, Hkv, T, S):
    q, k, v = qkv(2, H, Hkv, T, S)
    out = attention(q, k, v, causal=causal, backend="reference")
    assert out.shape == (2, H, T, 16)
    assert torch.allclose(out.double(), naive(q, k, v, causal), atol=1e-5)


@pytest.mark.parametrize("T,S", LENGTHS)
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_matches_reference(causal, H, Hkv, T, S):
    q, k, v = qkv(2, H, Hkv, T, S, seed=1)
    ref = attention(q, k, v, causal=causal, backend="reference")
    assert torch.allclose(attention(q, k, v, causal=causal, backend="sdpa"), ref, atol=1e-5, rtol=0)
    assert torch.allclose(attention(q, k, v, causal=causal, backend="auto"), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_cached_queries_equal_last_rows_of_full_attention(backend):
    q, k, v = qkv(1, 4, 2, 8, 8, seed=2)
    full = attention(q, k, v, causal=True, backend=backend)
    last = attention(q[:, :, -3:], k, v, causal=True, backend=backend)
    assert torch.allclose(last, full[:, :, -3:], atol=1e-6)


def _flash_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    impl, why = capabilities.flash_status()  # FA3, FA2 or flash-attn-4, whichever is installed
    return None if impl is not None else why


@pytest.mark.cuda
@pytest.mark.parametrize("T,S", LENGTHS)
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_flash_matches_reference(causal, H, Hkv, T, S):
    reason = _flash_skip_reason()
    if reason:
        print(f"flash path skipped: {reason}")
        pytest.skip(f"flash path skipped: {reason}")
    q, k, v = qkv(2, H, Hkv, T, S, dtype=torch.bfloat16, device="cuda", seed=3)
    ref = attention(q.float(), k.float(), v.float(), causal=causal, backend="reference")
    out = attention(q, k, v, causal=causal, backend="flash")
    # bf16 inputs/outputs: 1e-5 is below bf16 resolution; compare at bf16 precision.
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=0)
    assert resolve("auto", "cuda", torch.bfloat16).impl == "flash"


def test_resolve_backend_on_cpu():
    name, reason = resolve("auto", torch.device("cpu"), torch.bfloat16)
    assert name == "sdpa" and reason
    assert resolve("reference", "cpu", torch.float32).impl == "reference"
    assert resolve("sdpa", "cpu", torch.bfloat16).impl == "sdpa"
    # fp32 CPU eager: the native kernel where it takes the shape and there is no dropout or mask
    native_ok = kernels.native.library() is not None
    assert (resolve("auto", "cpu", torch.float32).impl == "native") == native_ok
    assert resolve("auto", "cpu", torch.float32, head_dim=24).impl == "sdpa"
    assert resolve("auto", "cpu", torch.float32, dropout=True).impl == "sdpa"
    assert resolve("auto", "cpu", torch.float32, doc_mask=True).impl == "sdpa"


def test_what_runs_is_what_was_chosen():
    """The op records the implementation it ran; it is the one the rule names."""
    q, k, v = qkv(1, 4, 2, 6, 6, D=16)
    for backend in ("auto", "sdpa", "reference"):
        with track() as ran:
            attention(q, k, v, causal=True, backend=backend)
        assert ran["attention"] == {resolve(backend, "cpu", torch.float32).impl}


def test_forcing_flash_on_cpu_raises():
    with pytest.raises(ConfigError, match="flash") as e:
        resolve("flash", torch.device("cpu"), torch.float32)
    assert "\n" not in str(e.value)
    q, k, v = qkv(1, 2, 2, 3, 3)
    with pytest.raises(ConfigError):
        attention(q, k, v, causal=True, backend="flash")


def test_unknown_backend_and_bad_shapes():
    with pytest.raises(ConfigError, match="attention_backend"):
        resolve("xformers", "cpu", torch.float32)
    q, k, v = qkv(1, 3, 2, 3, 3)
    with pytest.raises(ValueError):
        attention(q, k, v, causal=True)
    q, k, v = qkv(1, 2, 2, 5, 3)
    with pytest.raises(ValueError):
        attention(q, k, v, causal=True)


def test_sdpa_backend_priority_from_the_environment(monkeypatch):
    """torch chooses SDPA's backend unless MEGAFORMER_SDPA_BACKENDS names a priority; a typo is
    one line naming the bad entry."""
    from torch.nn.attention import SDPBackend

    monkeypatch.delenv("MEGAFORMER_SDPA_BACKENDS", raising=False)
    assert kernels.sdpa_priority() is None
    monkeypatch.setenv("MEGAFORMER_SDPA_BACKENDS", "flash, cudnn,math")
    assert kernels.sdpa_priority() == [
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ]
    monkeypatch.setenv("MEGAFORMER_SDPA_BACKENDS", "flash,cudnnn")
    with pytest.raises(ConfigError, match="cudnnn") as e:
        kernels.sdpa_priority()
    assert "\n" not in str(e.value)


def _fake_flash_attn(version: str) -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.__spec__ = types.SimpleNamespace(name="flash_attn")  # find_spec consults sys.modules
    module.flash_attn_func = lambda *a, **k: None
    return module


@pytest.mark.parametrize(
    "version,usable", [("2.0.9", False), ("2.1.0", True), ("2.7.4.post1", True)]
)
def test_flash_attn_before_2_1_is_not_used(monkeypatch, version, usable):
    """FA2 < 2.1 aligns causal masks of T < S queries top-left, which breaks KV-cache decoding."""
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(version))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # no flash-attn-4
    capabilities.flash_status.cache_clear()
    try:
        impl, why = capabilities.flash_status()
        assert (impl is not None) == usable, why
        if not usable:
            assert "older than 2.1" in why
    finally:
        capabilities.flash_status.cache_clear()


def test_sdpa_without_enable_gqa_falls_back_to_repeat(monkeypatch):
    monkeypatch.setattr(kernels, "_sdpa_has_gqa", lambda: False)  # as on torch < 2.5
    q, k, v = qkv(2, 4, 2, 3, 8, seed=4)
    ref = attention(q, k, v, causal=True, backend="reference")
    assert torch.allclose(attention(q, k, v, causal=True, backend="sdpa"), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dv", [8, 12])
def test_block_kernel_returns_lse_and_its_backward_takes_the_final_lse(dtype, dv):
    """One key block of ring attention: O and lse equal the written-out formula (a row that sees
    no key: lse -inf, O 0), and the backward given O and lse of the block equals autograd."""
    from megaformer.kernels.attention_block import block_backward, block_forward

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    v, do = torch.randn(2, 2, 6, dv, generator=g), torch.randn(2, 4, 6, dv, generator=g)
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.4
    mask[0, 0, 2] = False  # a row with no visible key
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].repeat_interleave(2, 1).transpose(-2, -1) * 0.3
    s = s.masked_fill(~mask, float("-inf"))
    lse_ref = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse_ref), 0.0, lse_ref).unsqueeze(-1))
    ref = p @ leaves[2].repeat_interleave(2, 1)
    ref.backward(do)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    o, lse = block_forward(*(t.to(dtype) for t in (q, k, v)), causal=False, mask=mask, scale=0.3)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.allclose(o.float(), ref.detach(), atol=tol)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    assert torch.allclose(lse[~torch.isinf(lse)], lse_ref[~torch.isinf(lse_ref)], atol=tol)
    grads = block_backward(
        do.to(dtype), *(t.to(dtype) for t in (q, k, v)), o, lse, causal=False, mask=mask, scale=0.3
    )
    for got, leaf in zip(grads, leaves):
        assert got.dtype == dtype and torch.allclose(got.float(), leaf.grad, atol=2 * tol)
