"""The GPU tier: what only a CUDA device can show. ``pytest -m cuda`` on one GPU (a few minutes);
on a machine without one every test here is collected and skips with the reason.

* every kernel against its torch reference in bf16 and fp16, forward and backward, naming what ran;
* the attention implementations (flash-attn if installed, each SDPA backend) against the fp32
  reference: MHA/GQA/MQA, KV-cache queries (T < S), packed-document masks;
* a whole model with megaformer's kernels against plain torch ops;
* bf16 training through DeepSpeed with each ZeRO stage and recompute mode against fp32;
* one training step audited for host synchronisations; the compiled blocks without graph breaks.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import ModelConfig
from megaformer.kernels import activations as A
from megaformer.kernels import capabilities
from megaformer.kernels import norm as N
from megaformer.kernels.attention import attention, document_ids
from megaformer.kernels.cross_entropy import chunked_cross_entropy, cross_entropy
from megaformer.kernels.gemm import linear
from megaformer.kernels.rope import rope, rope_reference
from megaformer.kernels.selection import kernel_mode, track

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = {"bf16": (torch.bfloat16, 2e-2), "fp16": (torch.float16, 5e-3)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _compare(fn, ref, *inputs: torch.Tensor, dtype: torch.dtype) -> tuple[list[float], dict]:
    """Relative errors [output, grad of each input] of fn (inputs in ``dtype``) against ref in
    fp32 on the same rounded values, and what ran."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = [t.to(dtype).detach().requires_grad_() for t in inputs]
    b = [t.to(dtype).float().detach().requires_grad_() for t in inputs]
    with track() as ran:
        ya = fn(*a)
        dy = torch.randn(ya.shape, device="cuda", generator=gen)
        ya.backward(dy.to(ya.dtype))
    yb = ref(*b)
    yb.backward(dy)
    return [_rel(ya, yb)] + [_rel(x.grad, y.grad) for x, y in zip(a, b)], ran


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    return torch.randn(*shape, device="cuda", generator=g) * scale


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("kernel", ["swiglu", "swiglu_packed", "bias_gelu", "rms_norm", "layer_norm",
                                    "rope", "linear"])
def test_kernel_against_reference(kernel, dtype_name):
    dtype, tol = DTYPES[dtype_name]
    M, D, F_ = 257, 1024, 2816  # odd row count: masked tails
    cases = {
        "swiglu": (A.swiglu, A.swiglu_reference, (_randn(M, F_), _randn(M, F_))),
        "swiglu_packed": (A.swiglu_packed, lambda y: A.swiglu_reference(*y.chunk(2, -1)),
                          (_randn(M, 2 * F_),)),
        "bias_gelu": (A.bias_gelu, A.bias_gelu_reference, (_randn(M, F_), _randn(F_))),
        "rms_norm": (lambda x, w: N.rms_norm(x, w, 1e-5), lambda x, w: N.rms_norm_reference(x, w, 1e-5),
                     (_randn(M, D) * 3 + 1, _randn(D))),
        "layer_norm": (lambda x, w, b: N.layer_norm(x, w, b, 1e-5),
                       lambda x, w, b: N.layer_norm_reference(x, w, b, 1e-5),
                       (_randn(M, D) * 3 + 1, _randn(D), _randn(D))),
        "rope": (lambda x: rope(x, *_tables(x)), lambda x: rope_reference(x, *_tables(x)),
                 (_randn(2, 8, 64, 128),)),
        "linear": (linear, F.linear, (_randn(M, D), _randn(F_, D, scale=0.03), _randn(F_))),
    }
    fn, ref, inputs = cases[kernel]
    errors, ran = _compare(fn, ref, *inputs, dtype=dtype)
    assert max(errors) < tol, (errors, ran)


def _tables(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from megaformer.model.positions import RotaryEmbedding

    return RotaryEmbedding(x.shape[-1]).tables(0, x.shape[2], x.device)


def test_triton_norms_at_large_widths_and_mixed_dtypes():
    """bf16 activations with an fp32 gain (autocast) go to the Triton kernel, at widths up to 8192."""
    for width in (4096, 8192):
        x, w = _randn(64, width) * 2, _randn(width)
        errors, ran = _compare(lambda x_, w_: N.rms_norm(x_.bfloat16(), w_, 1e-5),
                               lambda x_, w_: N.rms_norm_reference(x_, w_, 1e-5), x, w,
                               dtype=torch.float32)
        assert ran["rms_norm"] == {"triton"} and max(errors) < 2e-2, (width, errors)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_cross_entropy_plain_and_chunked(dtype_name):
    dtype, tol = DTYPES[dtype_name]
    h, w = _randn(512, 256), _randn(1000, 256, scale=0.05)
    y = torch.randint(0, 900, (512,), device="cuda")
    y[:7] = -100
    errs, _ = _compare(lambda h_, w_: cross_entropy(h_ @ w_.t(), y, 900),
                       lambda h_, w_: F.cross_entropy((h_ @ w_.t())[:, :900], y), h, w, dtype=dtype)
    assert max(errs) < tol, errs
    errs, _ = _compare(lambda h_, w_: chunked_cross_entropy(h_, w_, y, 128, vocab_size=900),
                       lambda h_, w_: F.cross_entropy((h_ @ w_.t())[:, :900], y), h, w, dtype=dtype)
    assert max(errs) < tol, errs


def _attention_cases():
    for H, Hkv in ((8, 8), (8, 2), (8, 1)):
        for T, S in ((256, 256), (64, 256), (1, 256)):
            yield H, Hkv, T, S


def _sdpa_backends() -> list[str]:
    return ["flash", "efficient", "cudnn", "math"]


@pytest.mark.parametrize("backend", ["auto", "flash"] + [f"sdpa:{b}" for b in _sdpa_backends()])
def test_attention_implementations_against_reference(backend, monkeypatch):
    if backend == "flash" and capabilities.flash_status()[0] is None:
        pytest.skip(f"flash-attn: {capabilities.flash_status()[1]}")
    name = backend
    if backend.startswith("sdpa:"):
        monkeypatch.setenv("MEGAFORMER_SDPA_BACKENDS", backend.split(":")[1])
        name = "sdpa"
    for H, Hkv, T, S in _attention_cases():
        q, k, v = _randn(2, H, T, 128), _randn(2, Hkv, S, 128), _randn(2, Hkv, S, 128)
        ref = attention(q, k, v, causal=True, backend="reference")
        try:
            out = attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True, backend=name)
        except RuntimeError as e:  # an SDPA backend that does not take this case says so
            if backend.startswith("sdpa:") and "No available kernel" in str(e):
                continue
            raise
        assert _rel(out, ref) < 2e-2, (backend, H, Hkv, T, S)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_document_mask_on_cuda(backend):
    """Packed documents (flash-attn's varlen kernel where installed, else the dense mask) equal
    each document run alone."""
    ids = torch.randint(1, 50, (2, 256), device="cuda")
    ids[0, [40, 41, 200]] = 0
    ids[1, [128]] = 0
    docs = document_ids(ids, 0)
    q, k, v = _randn(2, 8, 256, 64), _randn(2, 2, 256, 64), _randn(2, 2, 256, 64)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = attention(q, k, v, causal=True, backend=backend, doc_ids=docs)
    for row in range(2):
        bounds = [0] + [int(i) + 1 for i in (ids[row] == 0).nonzero().flatten()] + [256]
        for s, e in zip(bounds[:-1], bounds[1:]):
            if s == e:
                continue
            alone = attention(q[row:row + 1, :, s:e], k[row:row + 1, :, s:e], v[row:row + 1, :, s:e],
                              causal=True, backend="reference")
            assert _rel(out[row:row + 1, :, s:e], alone) < 2e-2, (backend, row, s, e)


@pytest.mark.parametrize("variant", [dict(activation="swiglu", norm="rmsnorm"),
                                     dict(activation="gelu", norm="layernorm", bias=True,
                                          position="learned")])
def test_model_with_kernels_equals_torch_ops(variant):
    from megaformer.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=256, **variant)
    x = torch.randint(0, 1000, (4, 256), device="cuda")
    out = []
    for mode in ("auto", "torch"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            m = Transformer(cfg)
        with kernel_mode(mode), track() as ran, torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x, x)
        loss.backward()
        out.append((loss.item(), torch.cat([p.grad.flatten() for p in m.parameters()]), ran))
    assert abs(out[0][0] - out[1][0]) < 1e-2 * out[1][0]
    assert _rel(out[0][1], out[1][1]) < 5e-2
    assert all(v == {"torch"} for op, v in out[1][2].items() if op != "attention")


def test_one_training_step_never_waits_for_the_host():
    """Forward, backward, clipping and the AdamW step of a model with megaformer's kernels under
    bf16 autocast: torch's sync debug mode raises on any host synchronisation."""
    from megaformer.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                      max_seq_len=256)
    with torch.device("cuda"):
        m = Transformer(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 1000, (4, 256), device="cuda")
    for step in range(2):  # the first step warms caches (RoPE tables, kernel builds)
        mode = "error" if step == 1 else "default"
        torch.cuda.set_sync_debug_mode(mode)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = m(x, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_compiled_blocks_have_no_graph_breaks():
    from torch._dynamo.utils import counters

    from megaformer.model.block import compile_blocks
    from megaformer.model.transformer import Transformer

    counters.clear()
    cfg = ModelConfig(vocab_size=1000, d_model=256, n_layers=2, n_heads=4, max_seq_len=256,
                      document_mask=True)
    with torch.device("cuda"):
        m = Transformer(cfg)
    m.eod_id = 0
    compile_blocks(m.layers, backend="aot_eager")
    x = torch.randint(0, 1000, (2, 256), device="cuda")
    x[:, 100] = 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        m(x, x).backward()
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.parametrize("zero,recompute", [(0, "none"), (1, "none"), (2, "none"), (3, "none"),
                                            (1, "full"), (1, "selective")])
def test_bf16_training_with_deepspeed_tracks_fp32(tmp_path: Path, zero: int, recompute: str):
    """megaformer train on the GPU in bf16 (each ZeRO stage; recomputation) against the fp32 run:
    losses of the first steps within bf16 accuracy, all finite."""
    from tests.helpers import run_cli, subprocess_env, tiny_overrides

    env = subprocess_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
                         DS_ACCELERATOR="cuda")
    losses = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        proc = run_cli("train", "configs/quickstart.yaml",
                       *tiny_overrides(**{"train.steps": 4, "eval.interval": 0, "model.d_model": 64,
                                          "train.device": "cuda"}),
                       f"train.precision={precision}", f"parallel.zero_stage={zero}",
                       f"train.recompute={recompute}", "--run-dir", str(run), env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses[precision] = [r["loss"] for r in rows if "loss" in r]
    assert all(math.isfinite(v) for v in losses["bf16"])
    for a, b in zip(losses["bf16"], losses["fp32"]):
        assert abs(a - b) < 0.03 * b, losses
