"""The fast paths give the same numbers as the plain ones.

* chunked cross-entropy fused with the output projection: loss and gradients (hidden states,
  output weight) equal logits -> F.cross_entropy within fp32 round-off (TP=1, here; the
  vocab-parallel version under TP=2 and 4, with and without SP, is a variant of
  tests/distributed/test_tensor_parallel.py);
* document masking: a token's output does not depend on earlier documents of the same packed row,
  and equals running its document alone;
* train.compile: compiled blocks equal eager ones, in one graph each (no graph breaks);
* config validation of the new keys;
* the oneDNN GEMM dispatch, fused projections and the CPU eager functions against torch ops.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from megaformer.config import ModelConfig, config_from_dict
from megaformer.errors import ConfigError
from megaformer.kernels import native
from megaformer.kernels.attention import attention, cu_seqlens, document_ids
from megaformer.kernels.cross_entropy import chunked_cross_entropy
from megaformer.kernels.selection import kernel_mode, track
from megaformer.model.transformer import Transformer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ----------------------------------------------------------------------------- chunked CE


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_equals_plain(chunk):
    """N = 2 x 23 tokens (chunks that do not divide N), vocabulary 37 of 48 rows (padding), some
    labels ignored: the loss and dL/dH, dL/dW equal the materialised-logits path."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 23, 16, generator=gen, requires_grad=True)
    w = torch.randn(48, 16, generator=gen) * 0.5
    w[37:] = 0.0
    w.requires_grad_()
    y = torch.randint(0, 37, (2, 23), generator=gen)
    y[0, :5] = -100
    loss = chunked_cross_entropy(h, w, y, chunk, vocab_size=37)
    dh, dw = torch.autograd.grad(loss, (h, w))
    ref = F.cross_entropy((h @ w.t())[..., :37].flatten(0, 1), y.flatten(), ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    assert _rel(dh, rh) < 1e-5 and _rel(dw, rw) < 1e-5
    assert float(dw[37:].abs().max()) == 0.0  # padding rows never receive gradient


def test_chunked_cross_entropy_under_bf16_autocast_follows_linear():
    """Under autocast the chunk matmuls run in bf16 like nn.Linear would, gradients come back in
    the inputs' dtype, and the loss agrees with the plain autocast path to bf16 accuracy."""
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(40, 16, generator=gen, requires_grad=True)
    w = torch.randn(30, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 30, (40,), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, y, 16)
        ref = F.cross_entropy(F.linear(h, w).float(), y)
    dh, dw = torch.autograd.grad(loss, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert dh.dtype == torch.float32 and dw.dtype == torch.float32
    assert abs(loss.item() - ref.item()) < 2e-2 * ref.item()
    assert _rel(dh, rh) < 3e-2 and _rel(dw, rw) < 3e-2


def _tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=57, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)
    base.update(kw)
    return ModelConfig(**base)


def test_model_chunked_loss_equals_plain_loss():
    """Transformer with loss_chunk_tokens (tied, padded vocabulary) == the plain head: loss and
    every gradient."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, 57, (2, 16), generator=gen)
    y = torch.randint(0, 57, (2, 16), generator=gen)
    y[1, -4:] = -100
    grads, losses = [], []
    for chunk in (0, 5):
        torch.manual_seed(0)
        m = Transformer(_tiny(loss_chunk_tokens=chunk), padded_vocab_size=64)
        with track() as ran:
            loss = m(x, y)
            loss.backward()
        assert ran["cross_entropy"] == (
            {"chunked"} if chunk else {"native", "torch"} & ran["cross_entropy"]
        )
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in m.named_parameters()})
    assert abs(losses[0] - losses[1]) <= 1e-6 * losses[0]
    for n in grads[0]:
        assert _rel(grads[1][n], grads[0][n]) < 1e-5, n


def test_chunked_loss_memory_is_bounded_by_the_chunk():
    """Peak memory of loss + backward: the plain path holds [N, V] fp32 logits (and their
    softmax); the chunked one about one [chunk, V] block (measured by the allocator)."""
    from megaformer.analysis.measure import measure

    N, d, V = 2048, 32, 4096  # logits: 32 MiB in fp32
    h = torch.randn(N, d, requires_grad=True)
    w = torch.randn(V, d, requires_grad=True)
    y = torch.randint(0, V, (N,))

    def plain():
        F.cross_entropy((h @ w.t()).float(), y).backward()

    def chunked():
        chunked_cross_entropy(h, w, y, 128).backward()

    p, c = measure(plain).peak, measure(chunked).peak
    logits = N * V * 4
    assert p >= logits  # the full logits existed
    assert c < logits / 4, (p, c)


# ----------------------------------------------------------------------------- document masking


def test_document_ids_and_cu_seqlens():
    ids = torch.tensor([[5, 9, 0, 3, 0, 7], [0, 1, 2, 0, 4, 4]])
    docs = document_ids(ids, eod_id=0)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 2, 2]]
    cu, longest = cu_seqlens(docs)
    assert cu.tolist() == [0, 3, 5, 6, 7, 10, 12] and longest == 3


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_document_mask_attention_equals_separate_documents(backend):
    """Attention over a packed row with doc_ids == attention over each document alone."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, 10, 8, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # GQA
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
    out = attention(q, k, v, causal=True, backend=backend, doc_ids=docs)
    for s, e in ((0, 3), (3, 7), (7, 10)):
        alone = attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], causal=True, backend=backend)
        assert torch.allclose(out[:, :, s:e], alone, atol=1e-6), (s, e)


def test_model_document_mask_isolates_packed_documents():
    """Model level (RoPE, 2 layers): changing an earlier document leaves the later one's logits
    unchanged, and they equal the document run alone; without the mask they change."""
    eod = 0
    docs_a = torch.tensor([[3, 4, 5, 6, eod, 7, 8, 9, 10, 11, 12]])
    docs_b = docs_a.clone()
    docs_b[0, :4] = torch.tensor([20, 21, 22, 23])
    second = docs_a[:, 5:]
    torch.manual_seed(0)
    m = Transformer(_tiny(document_mask=True, max_seq_len=16)).eval()
    m.eod_id = eod
    with torch.no_grad():
        la, lb, alone = m(docs_a), m(docs_b), m(second)
        m.cfg.document_mask = False
        unmasked = m(docs_a), m(docs_b)
    assert torch.allclose(la[:, 5:], lb[:, 5:], atol=1e-5)
    assert torch.allclose(la[:, 5:], alone, atol=1e-5)
    assert not torch.allclose(unmasked[0][:, 5:], unmasked[1][:, 5:], atol=1e-3)


def test_document_mask_is_computed_once_per_forward(monkeypatch):
    """The documents' boundaries (dense mask or cu_seqlens) are built once per forward, outside
    the blocks, not once per layer."""
    from megaformer.kernels import attention as attn

    calls = []
    real = attn.document_causal_mask
    monkeypatch.setattr(
        attn, "document_causal_mask", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    torch.manual_seed(0)
    m = Transformer(_tiny(document_mask=True, n_layers=3, attention_backend="sdpa"))
    m.eod_id = 0
    x = torch.randint(0, 57, (2, 16), generator=torch.Generator().manual_seed(1))
    x[:, 6] = 0
    with track() as ran:
        m(x, x).backward()
    assert len(calls) == 1 and ran["attention"] == {"sdpa"}


def test_document_mask_needs_eod_id():
    m = Transformer(_tiny(document_mask=True))
    with pytest.raises(ValueError, match="eod_id"):
        m(torch.zeros(1, 4, dtype=torch.long))


# ----------------------------------------------------------------------------- torch.compile


@pytest.mark.slow
def test_compiled_blocks_equal_eager_in_one_graph():
    """compile_blocks (aot_eager: dynamo + autograd tracing, no C++ build) gives eager's loss and
    gradients, with document masking on, and dynamo traces each block as one graph."""
    from torch._dynamo.utils import counters

    from megaformer.model.block import compile_blocks

    x = torch.randint(1, 57, (2, 16), generator=torch.Generator().manual_seed(5))
    x[:, 7] = 0
    results = []
    counters.clear()
    for compiled in (False, True):
        torch.manual_seed(0)
        m = Transformer(_tiny(document_mask=True, n_layers=1))
        m.eod_id = 0
        if compiled:
            compile_blocks(m.layers, backend="aot_eager")
        loss = m(x, x)
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    assert abs(results[0][0] - results[1][0]) <= 1e-6 * results[0][0]
    assert max(_rel(a, b) for a, b in zip(results[1][1], results[0][1])) < 1e-5
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters)


STANDIN_FLASH_ATTN = '''
"""A stand-in flash-attn 2.7 for CPU tests: the entry points of flash_attn, computed by SDPA
behind opaque custom ops (as the real package registers its CUDA kernels)."""
import torch
import torch.nn.functional as F

__version__ = "2.7.4"


def _sdpa(q, k, v, scale, causal, window_left):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    T, S = qt.shape[2], kt.shape[2]
    i = torch.arange(T, device=q.device)[:, None] + (S - T)
    j = torch.arange(S, device=q.device)[None, :]
    mask = (j <= i) if causal else torch.ones(T, S, dtype=torch.bool, device=q.device)
    if window_left >= 0:
        mask = mask & (i - j <= window_left)
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


if not hasattr(torch.ops.standin_flash, "fwd"):
    @torch.library.custom_op("standin_flash::fwd", mutates_args=())
    def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
             window_left: int) -> torch.Tensor:
        return _sdpa(q, k, v, scale, causal, window_left)

    @_fwd.register_fake
    def _(q, k, v, scale, causal, window_left):
        return torch.empty_like(q)

    def _setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3])
        ctx.args = inputs[3:]

    def _backward(ctx, grad):
        q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
        with torch.enable_grad():
            out = _sdpa(q, k, v, *ctx.args)
        return (*torch.autograd.grad(out, (q, k, v), grad), None, None, None)

    _fwd.register_autograd(_backward, setup_context=_setup)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    return torch.ops.standin_flash.fwd(q, k, v, scale, causal, window_size[0])
'''


def test_compiled_blocks_with_flash_attn_installed_are_one_graph(tmp_path, monkeypatch):
    """With a flash-attn package installed (a stand-in: flash-attn 2.7's entry point as an opaque
    custom op computing SDPA, flash allowed on CPU), two blocks (sliding window: the entry
    point's window_size is used) trace as one graph: the package and its signature are resolved
    by the kernel table, not inside the compiled region."""
    import sys

    import torch._dynamo

    from megaformer.kernels import capabilities, selection

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(STANDIN_FLASH_ATTN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # no flash-attn-4
    monkeypatch.setattr(selection, "_flash_unusable", lambda device, dtype, head_dim: None)
    for cached in (capabilities.flash_status, selection._decide):
        cached.cache_clear()
    try:
        torch.manual_seed(0)
        m = Transformer(_tiny(sliding_window=8))
        x, rope = m.embed(torch.randint(0, 57, (2, 16), generator=torch.Generator().manual_seed(3)))

        def blocks(h: torch.Tensor) -> torch.Tensor:
            for block in m.layers:
                h = block(h, rope=rope)
            return h

        with track() as ran:
            y = blocks(x)
        assert ran["attention"] == {"flash"}
        assert capabilities.resolved_flash().func_window  # window_size=(W - 1, 0) is passed
        for block in m.layers:
            block.attn.backend = "sdpa"
        assert torch.allclose(y, blocks(x), atol=1e-5)
        for block in m.layers:
            block.attn.backend = "auto"
        selection.mark_constant_for_compile()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(blocks)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (
            explained.break_reasons
        )
    finally:
        monkeypatch.undo()
        capabilities.flash_status.cache_clear()
        selection._decide.cache_clear()
        capabilities.flash_status()  # the real package (or none) again


@pytest.mark.skipif(
    os.environ.get("MEGAFORMER_TEST_INDUCTOR") != "1",
    reason="inductor's first CPU compile of a block takes ~140 s (C++ build); "
    "set MEGAFORMER_TEST_INDUCTOR=1 to run it",
)
def test_inductor_compiled_block_equals_eager():
    from megaformer.model.block import compile_blocks

    torch.manual_seed(0)
    m = Transformer(_tiny())
    x = torch.randint(0, 57, (2, 16), generator=torch.Generator().manual_seed(6))
    ref = m(x, x)
    compile_blocks(m.layers)
    assert abs(m(x, x).item() - ref.item()) <= 1e-5 * ref.item()


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"model": {"loss_chunk_tokens": -1}}, "model.loss_chunk_tokens=-1"),
        (
            {
                "model": {"document_mask": True, "n_layers": 2},
                "parallel": {"pipeline": 2, "context": 2, "zero_stage": 1},
            },
            "model.document_mask",
        ),
        ({"model": {"fused_kernels": "cuda"}}, "model.fused_kernels='cuda'"),
        ({"train": {"compile": "yes"}}, "train.compile='yes'"),
    ],
)
def test_new_keys_are_validated(raw, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        config_from_dict(raw)


# ----------------------------------------------------------------------------- through the trainer


@pytest.mark.slow
def test_training_with_chunked_loss_and_document_mask(tmp_path):
    """megaformer train (DeepSpeed, byte tokenizer, documents of 20-60 bytes, so every 32-token
    sample holds EODs) with the chunked loss (48 of the 128 tokens per micro-batch at a time) and
    document masking: the trainer hands the tokenizer's EOD id to the model (else the forward
    raises), and the first loss is the untrained model's ln(257) (N(0, 0.02) weights: near-uniform
    predictions), i.e. a mean over tokens, not a sum or a chunk's share. (The chunked loss equals
    the plain one, and masking isolates documents, in the model-level tests above.)"""
    import json
    import math

    from tests.helpers import run_cli, short_documents, tiny_overrides

    corpus = short_documents(tmp_path / "docs")
    runs = {}
    for chunk in (48, 0):  # the chunked loss against the plain one, after updates too
        run = tmp_path / f"run{chunk}"
        proc = run_cli(
            "train",
            "configs/quickstart.yaml",
            *tiny_overrides(corpus, **{"train.steps": 3, "eval.interval": 0}),
            "model.document_mask=true",
            f"model.loss_chunk_tokens={chunk}",
            "--run-dir",
            str(run),
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        runs[chunk] = {r["step"]: r["loss"] for r in rows if "loss" in r}
    losses = runs[48]
    assert sorted(losses) == [1, 2, 3]
    assert losses[1] == pytest.approx(math.log(257), rel=0.02)
    for step in (1, 2, 3):
        assert losses[step] == pytest.approx(runs[0][step], rel=1e-5), (step, losses, runs[0])


# ----------------------------------------------------------------------------- GEMM dispatch


def _onednn_or_skip():
    from megaformer.kernels import gemm
    from megaformer.kernels.capabilities import onednn_available

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear op (F.linear is used)")
    return gemm


@pytest.mark.parametrize("shape,bias", [((3, 5, 48), True), ((7, 40), False), ((2, 9, 16), False)])
@pytest.mark.parametrize("out", [24, 1100])  # dX on oneDNN (small weight) and on torch.mm (large)
def test_onednn_linear_equals_f_linear(shape, bias, out):
    """x W^T + b, dx, dW, db of the oneDNN custom op equal F.linear's within fp32 round-off."""
    gemm = _onednn_or_skip()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g)
    w = torch.randn(out, shape[-1], generator=g)
    b = torch.randn(out, generator=g) if bias else None
    dy = torch.randn(*shape[:-1], out, generator=g)
    results = []
    for fn in (gemm.linear, lambda *a: F.linear(*a)):
        leaves = [t.clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
        y = fn(*leaves) if bias else fn(*leaves, None)
        y.backward(dy)
        results.append([y.detach()] + [t.grad for t in leaves])
    assert gemm.use_onednn(x, w)
    for got, want in zip(*results):
        assert got.shape == want.shape and _rel(got, want) < 1e-6


def test_gemm_dispatch_rule():
    """oneDNN only for fp32 CPU tensors outside autocast in kernel mode auto."""
    gemm = _onednn_or_skip()
    x, w = torch.zeros(4, 8), torch.zeros(3, 8)
    assert gemm.use_onednn(x, w)
    with kernel_mode("torch"):
        assert not gemm.use_onednn(x, w)
    assert not gemm.use_onednn(x.bfloat16(), w.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not gemm.use_onednn(x, w)
        assert gemm.linear(x, w).dtype == torch.bfloat16  # F.linear under autocast, as nn.Linear


@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_equal_separate(bias):
    """[p(x) for p] as one GEMM over the concatenated weights: same outputs and gradients."""
    from megaformer.model.linear import Linear, fused_projections

    torch.manual_seed(0)
    ps = [Linear(16, n, bias=bias) for n in (16, 8, 8)]
    x = torch.randn(2, 5, 16)
    grads = []
    for fused in (True, False):
        xs = x.clone().requires_grad_()
        outs = fused_projections(xs, ps) if fused else [p(xs) for p in ps]
        sum((o * (i + 1)).sum() for i, o in enumerate(outs)).backward()
        grads.append([xs.grad] + [t.grad.clone() for p in ps for t in p.parameters()] + outs)
        for p in ps:
            p.zero_grad(set_to_none=True)
    for a, b in zip(*grads):
        assert _rel(a.detach(), b.detach()) < 1e-6


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_model_gemm_dispatch_equals_torch_ops(activation):
    """A whole model in kernel mode auto (fused q/k/v and gate/up, oneDNN GEMMs, native or
    fewer-pass CPU kernels) equals the same weights in mode torch: loss and every gradient; and
    each mode ran what its rule names."""
    _onednn_or_skip()
    extra = (
        {} if activation == "swiglu" else {"position": "learned", "norm": "layernorm", "bias": True}
    )
    x = torch.randint(0, 57, (2, 16), generator=torch.Generator().manual_seed(8))
    out, ran = [], {}
    for mode in ("auto", "torch"):
        torch.manual_seed(0)
        m = Transformer(_tiny(activation=activation, **extra))
        with kernel_mode(mode), track() as ran[mode]:
            loss = m(x, x)
            loss.backward()
        out.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
    assert ran["auto"]["linear"] == {"onednn"} and ran["auto"]["projections"] == {"fused"}
    assert all(impls == {"torch"} for op, impls in ran["torch"].items() if op != "attention")
    if activation == "swiglu":
        assert ran["auto"]["swiglu"] <= {"native", "cpu"} and ran["auto"]["rms_norm"] <= {
            "native",
            "cpu",
        }
    assert abs(out[0][0] - out[1][0]) <= 1e-6 * out[1][0]
    # all gradients as one vector, and each to an absolute bound: the key bias's gradient is 0 up
    # to rounding (softmax ignores a per-row constant), so its relative error compares noise
    flat = [torch.cat([g.flatten() for g in grads]) for _, grads in out]
    assert _rel(flat[0], flat[1]) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(out[0][1], out[1][1])) < 1e-6


# ----------------------------------------------------------------------------- CPU dropout


def test_int16_dropout_statistics_and_gradient():
    """Drop rate p within sampling error, E[y] = x (scale 1/q), dx = dy * m / q, seeded (the torch
    path, without the native kernels: tests/unit/test_native_kernels.py tests those)."""
    with native.disabled(), track() as ran:
        _check_int16_dropout()
    assert ran["dropout"] == {"int16"}


def _check_int16_dropout() -> None:
    from megaformer.kernels.dropout import dropout, keep_mask

    x = torch.ones(400_000, requires_grad=True)
    torch.manual_seed(11)
    y = dropout(x, 0.1)
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.003
    assert abs(y.mean().item() - 1.0) < 0.004  # E[y] = x
    torch.manual_seed(11)
    m, scale = keep_mask(x.shape, 0.1, x.device)
    assert torch.equal(m, kept) and torch.equal(y.detach(), m.float() * scale)
    dy = torch.randn_like(x)
    y.backward(dy)
    assert torch.equal(x.grad, torch.where(m, dy, 0.0) * scale)
    assert dropout(x, 0.1, training=False) is x and dropout(x, 0.0) is x


def test_cpu_attention_dropout_is_softmax_masked_scaled():
    """attention() on CPU with dropout = softmax(QK^T/sqrt(d) + causal) * m / q @ V with the mask
    the same seed draws (GQA heads shared); the torch path (native kernels off)."""
    from megaformer.kernels.dropout import keep_mask

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, 8, 16, generator=g) for h in (4, 2, 2))
    torch.manual_seed(5)
    with native.disabled():
        out = attention(q, k, v, causal=True, dropout_p=0.25)
    kf, vf = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kf.transpose(-2, -1)) / 4.0
    scores = scores.masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), float("-inf"))
    torch.manual_seed(5)
    m, scale = keep_mask(torch.Size([2, 4, 8, 8]), 0.25, q.device)
    want = (torch.softmax(scores, dim=-1) * m * scale) @ vf
    assert _rel(out, want) < 1e-6


# ----------------------------------------------------------------------------- CPU eager RMSNorm, RoPE


def _grads_of(fn, *inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return [y.detach()] + [t.grad for t in leaves]


def test_cpu_rmsnorm_function_equals_reference():
    from megaformer.kernels.cpu_eager import RMSNormFunction
    from megaformer.kernels.norm import rms_norm_reference

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 5, 48, generator=g), torch.rand(48, generator=g) + 0.5
    dy = torch.randn(3, 5, 48, generator=g)
    got = _grads_of(lambda a, b: RMSNormFunction.apply(a, b, 1e-5, False), x, w, dy=dy)
    want = _grads_of(lambda a, b: rms_norm_reference(a, b, 1e-5), x, w, dy=dy)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("layout", ["projection", "heads_adjacent", "contiguous", "one_head"])
def test_cpu_rotary_function_equals_reference_on_strided_heads(layout):
    """q as the attention makes it (a slice of the [B, T, (H + 2 H_kv) D] projection viewed as
    [B, H, T, D]: heads adjacent in memory) and the other layouts the function may be given."""
    from megaformer.model.positions import RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(9)
    B, T, H, D = 2, 6, 4, 16
    heads = 1 if layout == "one_head" else H
    if layout == "projection":  # rows of 3 H D, q the first H D: row stride > H D
        x = torch.randn(B, T, 3 * H * D, generator=g)[..., : H * D].view(B, T, H, D).transpose(1, 2)
    elif layout == "contiguous":
        x = torch.randn(B, H, T, D, generator=g)
    else:
        x = torch.randn(B, T, heads, D, generator=g).transpose(1, 2)
    cos, sin = RotaryEmbedding(D)(torch.arange(3, 3 + T))
    dy = torch.randn(B, T, heads, D, generator=g).transpose(1, 2)  # SDPA's dq layout for such q
    if layout == "contiguous":
        dy = dy.contiguous()

    def grads(mode):
        leaf = x.detach().requires_grad_()  # the same strides as x (a clone would make it dense)
        with kernel_mode(mode), track() as ran:
            y = apply_rotary(leaf, cos, sin)
            y.backward(dy)
        return y.detach(), leaf.grad, ran["rope"]

    fast, plain = grads("auto"), grads("torch")
    assert fast[2] <= {"native", "cpu"} and plain[2] == {"torch"}
    for a, b in zip(fast[:2], plain[:2]):
        assert _rel(a, b) < 1e-6


def test_cpu_packed_swiglu_equals_reference():
    """SiLU(g) u of y = [g | u] and dy = [dg | du] as one tensor, against torch's silu * mul."""
    from megaformer.kernels.cpu_eager import PackedSwiGLUFunction

    g = torch.Generator().manual_seed(11)
    y = torch.randn(3, 5, 2 * 24, generator=g) * 3
    dh = torch.randn(3, 5, 24, generator=g)
    got = _grads_of(lambda t: PackedSwiGLUFunction.apply(t, False), y, dy=dh)
    want = _grads_of(lambda t: F.silu(t[..., :24]) * t[..., 24:], y, dy=dh)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-6
    assert torch.autograd.gradcheck(
        lambda t: PackedSwiGLUFunction.apply(t, False), (y[:1, :2].double().requires_grad_(),)
    )


def test_rope_tables_are_built_on_the_target_device_once():
    """RoPE's cos/sin tables are computed on the positions' device (no host tensor copied over,
    checked on the meta device: any CPU tensor would show up as an operand) and shared by every
    layer: asking again returns the same tensors."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megaformer.model.positions import RotaryEmbedding

    devices = set()

    class Devices(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            for a in list(args) + list((kwargs or {}).values()):
                if isinstance(a, torch.Tensor):
                    devices.add(a.device.type)
            return func(*args, **(kwargs or {}))

    rotary = RotaryEmbedding(16, theta=12345.0)
    with Devices():
        cos, sin = rotary.tables(3, 8, torch.device("meta"))
    assert cos.device.type == "meta" and devices == {"meta"}
    assert rotary.tables(3, 8, torch.device("meta"))[0] is cos
    assert RotaryEmbedding(16, theta=12345.0).tables(3, 8, torch.device("meta"))[0] is cos
    ref = rotary(torch.arange(3, 11))
    got = rotary.tables(3, 8, torch.device("cpu"))
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
