"""The native CPU kernels (megaformer/kernels/cpu_native.c) against torch references: values and
gradients, dropout statistics and seeding, the build cache and the fallback when no compiler works."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from megaformer.kernels import native
from megaformer.kernels.attention import attention
from megaformer.kernels.selection import choose_for, track


def _native_attention(q: torch.Tensor, dropout_p: float = 0.0) -> bool:
    return (
        choose_for(
            "attention",
            q,
            backend="auto",
            head_dim=q.shape[-1],
            dropout=dropout_p > 0,
            doc_mask=False,
        ).impl
        == "native"
    )


pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None,
    reason="no C compiler: the native kernels cannot be built here",
)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_library_builds_and_loads():
    assert native.library() is not None, native.status()
    assert native.status().startswith("native CPU kernels: ")


def test_swiglu_equals_float64_reference():
    from megaformer.kernels.cpu_eager import PackedSwiGLUFunction

    g = torch.Generator().manual_seed(1)
    y = (torch.randn(3, 7, 2 * 40, generator=g) * 4).requires_grad_()  # SiLU's tails too
    dh = torch.randn(3, 7, 40, generator=g)
    assert choose_for("swiglu", y).impl == "native"
    h = PackedSwiGLUFunction.apply(y, True)
    h.backward(dh)
    y64 = y.detach().double().requires_grad_()
    h64 = F.silu(y64[..., :40]) * y64[..., 40:]
    h64.backward(dh.double())
    assert _rel(h, h64) < 1e-6 and _rel(y.grad, y64.grad) < 1e-6
    with native.disabled():  # the torch fallback path agrees too
        assert choose_for("swiglu", y).impl == "cpu"
    assert _rel(PackedSwiGLUFunction.apply(y.detach(), False), h64) < 1e-6


def test_exp_through_softmax_over_the_float_range():
    """Scores from -80 to +80 (exp's clamped range reduction): softmax rows equal torch's."""
    s = torch.linspace(-80, 80, 4 * 96).view(4, 1, 96)
    s = torch.cat([s, s.flip(-1) * 0.5, torch.zeros(4, 1, 96)], dim=1)
    probs, _, _, _ = native.softmax_dropout_forward(s, causal=False, p=0.5)
    assert (probs - torch.softmax(s.double(), -1)).abs().max().item() < 1e-7
    assert torch.allclose(probs.sum(-1), torch.ones(4, 3), atol=1e-6)


def test_dropout_rate_mean_gradient_and_seeding():
    from megaformer.kernels.dropout import dropout

    n, p = 1_000_000, 0.1
    x = torch.ones(n, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x, p)
    kept = y != 0
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * sigma
    assert abs(y.mean().item() - 1.0) < 6 * sigma / (1 - p)  # E[y] = x
    assert torch.allclose(y.detach()[kept], torch.full((int(kept.sum()),), 1 / (1 - p)), rtol=1e-6)
    dy = torch.randn(n)
    y.backward(dy)
    assert torch.allclose(x.grad, torch.where(kept, dy / (1 - p), 0.0), rtol=1e-6, atol=0)
    torch.manual_seed(3)
    assert torch.equal(dropout(x.detach(), p) != 0, kept)  # torch.manual_seed governs it
    assert not torch.equal(dropout(x.detach(), p) != 0, kept)  # the next draw differs


def test_dropout_mask_is_independent_of_thread_count_and_uncorrelated():
    x = torch.ones(1 << 18)
    masks = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            torch.manual_seed(9)
            masks.append(native.dropout_forward(x, 0.5)[1])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])
    m = masks[0].float()
    both = (m[1:] * m[:-1]).mean().item()  # neighbours: P(keep, keep) = 1/4
    assert abs(both - 0.25) < 5 * (0.25 * 0.75 / m.numel()) ** 0.5
    lag = (m[4096:] * m[:-4096]).mean().item()  # across a 4096-element block boundary
    assert abs(lag - 0.25) < 5 * (0.25 * 0.75 / m.numel()) ** 0.5


@pytest.mark.parametrize("t_len,s_len,causal", [(8, 8, True), (1, 9, True), (5, 5, False)])
def test_attention_softmax_dropout_equals_reference(t_len, s_len, causal):
    """attention() on CPU with dropout: softmax(QK^T/sqrt(d) + causal) * m / q @ V for the mask
    the same seed draws, and gradients through it, against float64 autograd."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, h, n, 16, generator=g).requires_grad_()
        for h, n in ((4, t_len), (2, s_len), (2, s_len))
    )
    torch.manual_seed(5)
    out = attention(q, k, v, causal=causal, dropout_p=0.25)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    scores = (q64 @ k64.repeat_interleave(2, 1).transpose(-2, -1)) / 4.0
    if causal:
        allowed = torch.ones(t_len, s_len, dtype=torch.bool).tril(s_len - t_len)
        scores = scores.masked_fill(~allowed, float("-inf"))
    torch.manual_seed(5)
    _, _, m, scale = native.softmax_dropout_forward(scores.detach().float(), causal, 0.25)
    want = (torch.softmax(scores, -1) * m * scale) @ v64.repeat_interleave(2, 1)
    # the mask and scale above come from the kernel: check them on their own, over many draws
    _, _, big_m, big_scale = native.softmax_dropout_forward(torch.zeros(8, 4, 64, 256), False, 0.25)
    assert abs(big_m.float().mean().item() - 0.75) < 0.003 and big_scale == pytest.approx(1 / 0.75)
    want.backward(dout.double())
    assert _rel(out, want) < 1e-6
    for a, b in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert _rel(a, b) < 1e-5


def test_cross_entropy_with_padding_columns_and_ignored_labels():
    from megaformer.kernels.cross_entropy import native_cross_entropy

    g = torch.Generator().manual_seed(6)
    z = (torch.randn(3, 11, 70, generator=g) * 5).requires_grad_()  # vocabulary 64 + 6 padding
    labels = torch.randint(0, 64, (3, 11), generator=g)
    labels[0, :4] = -100
    loss = native_cross_entropy(z, labels, 64, -100)
    loss.backward(torch.tensor(2.0))
    z64 = z.detach().double().requires_grad_()
    want = F.cross_entropy(z64[..., :64].flatten(0, 1), labels.flatten(), ignore_index=-100)
    (2 * want).backward()
    assert abs(loss.item() - want.item()) < 1e-6 * want.item()
    assert _rel(z.grad, z64.grad) < 1e-6
    assert torch.count_nonzero(z.grad[..., 64:]) == 0 and torch.count_nonzero(z.grad[0, :4]) == 0
    all_ignored = native_cross_entropy(z.detach(), torch.full((3, 11), -100), 64, -100)
    assert torch.isnan(all_ignored)  # as F.cross_entropy: 0 / 0
    with pytest.raises(IndexError, match="target 64 is out of bounds"):
        native_cross_entropy(z.detach(), torch.full((3, 11), 64), 64, -100)


def test_model_loss_and_gradients_equal_the_torch_ops():
    """A tiny GPT (dropout 0 so both paths see the same function) and a tiny Llama: loss and every
    gradient with the native kernels equal those with native.disabled()."""
    from megaformer.config import ModelConfig
    from megaformer.model.transformer import Transformer

    for extra in (
        {"activation": "swiglu"},
        {"activation": "gelu_tanh", "norm": "layernorm", "position": "learned", "bias": True},
    ):
        cfg = ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, **extra)
        x = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(2))
        out = []
        for ctx in (native.disabled, lambda: __import__("contextlib").nullcontext()):
            torch.manual_seed(0)
            m = Transformer(cfg, padded_vocab_size=64)
            with ctx():
                loss = m(x, x)
                loss.backward()
            out.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
        assert abs(out[0][0] - out[1][0]) <= 1e-6 * out[1][0]
        # all gradients as one vector: the key bias's gradient is 0 up to rounding (softmax ignores a
        # per-row constant), so a per-parameter relative error would compare noise with noise
        flat = [torch.cat([g.flatten() for g in grads]) for _, grads in out]
        assert _rel(flat[0], flat[1]) < 1e-6
        assert max((a - b).abs().max().item() for a, b in zip(out[0][1], out[1][1])) < 1e-6


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@pytest.mark.slow
def test_build_is_cached_and_a_broken_compiler_falls_back(tmp_path):
    """A fresh cache builds once and the next process loads the same file; a compiler that fails
    leaves the torch ops running with the reason in status(); MEGAFORMER_NATIVE=0 turns them off.
    Each case then runs a forward + backward with dropout."""
    code = (
        "import torch; from megaformer.kernels import native, dropout as d; print(native.status()); "
        "x = torch.ones(1000, requires_grad=True); d.dropout(x, 0.5).sum().backward(); "
        "print('ok', int((x.grad != 0).sum()) > 300)"
    )
    env = {"MEGAFORMER_CACHE_DIR": str(tmp_path / "cache")}
    first = _python(code, env)
    assert first.returncode == 0, first.stderr
    built = list((tmp_path / "cache" / "native").glob("*/libmegaformer_native.so"))
    assert len(built) == 1 and str(built[0]) in first.stdout and "ok True" in first.stdout
    mtime = built[0].stat().st_mtime_ns
    again = _python(code, env)
    assert str(built[0]) in again.stdout and built[0].stat().st_mtime_ns == mtime
    broken = _python(code, {"MEGAFORMER_CACHE_DIR": str(tmp_path / "c2"), "CC": "false"})
    assert broken.returncode == 0, broken.stderr
    assert (
        "native CPU kernels unavailable (false failed" in broken.stdout
        and "ok True" in broken.stdout
    )
    assert not list((tmp_path / "c2").rglob("*.so"))  # no half-written library left behind
    off = _python(code, {"MEGAFORMER_NATIVE": "0"})
    assert "native CPU kernels off (MEGAFORMER_NATIVE=0)" in off.stdout and "ok True" in off.stdout


def test_rmsnorm_and_rope_equal_the_torch_paths():
    """The native RMSNorm (values, dx, dw) and RoPE (the projection's strided q layout, forward and
    backward) against the same functions with native.disabled()."""
    from megaformer.kernels.cpu_eager import RMSNormFunction, RotaryFunction
    from megaformer.model.positions import RotaryEmbedding

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(3, 5, 48, generator=g) * 3, torch.rand(48, generator=g) + 0.5
    dy = torch.randn(3, 5, 48, generator=g)
    B, T, H, D = 2, 6, 4, 16
    q = torch.randn(B, T, 3 * H * D, generator=g)[..., : H * D].view(B, T, H, D).transpose(1, 2)
    cos, sin = RotaryEmbedding(D)(torch.arange(2, 2 + T))
    dq = torch.randn(B, T, H, D, generator=g).transpose(1, 2)

    def run(use_native):
        xl, wl, ql = (
            x.clone().requires_grad_(),
            w.clone().requires_grad_(),
            q.detach().requires_grad_(),
        )
        y = RMSNormFunction.apply(xl, wl, 1e-5, use_native)
        y.backward(dy)
        r = RotaryFunction.apply(ql, cos[..., : D // 2], sin[..., : D // 2], use_native)
        r.backward(dq)
        return [y.detach(), xl.grad, wl.grad, r.detach(), ql.grad]

    got, want = run(True), run(False)
    for a, b in zip(got, want):
        assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("impl", ["auto", "fused", "foreach"])
def test_adam_impl_choices_make_the_same_update(impl):
    """train.adam_impl: auto picks torch's fused AdamW on CPU; fused and foreach update the
    parameters alike (three steps, weight decay on matrices only)."""
    from megaformer.config import TrainConfig
    from megaformer.runtime.optimizer import build_optimizer

    def run(choice):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        )
        opt = build_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.1, adam_impl=choice))
        for i in range(3):
            model(
                torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
            ).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return opt, torch.cat([p.detach().flatten() for p in model.parameters()])

    opt, got = run(impl)
    assert bool(opt.defaults["fused"]) == (impl != "foreach")
    _, ref = run("foreach")
    assert _rel(got, ref) < 1e-6


@pytest.mark.parametrize(
    "B,H,HK,T,S,D,causal",
    [
        (2, 8, 4, 96, 96, 32, True),  # GQA, the projection's strided layout
        (2, 4, 4, 50, 50, 64, True),  # MHA, T not a multiple of the 32-query block
        (1, 4, 2, 7, 70, 32, True),  # T < S: bottom-right causal alignment (a chunk after a cache)
        (1, 4, 1, 1, 20, 16, True),  # one new token, MQA
        (2, 4, 2, 33, 40, 48, False),  # no mask, S not a multiple of the 64-key block
    ],
)
def test_native_flash_attention_equals_float64_reference(B, H, HK, T, S, D, causal):
    """attention(backend=auto) on fp32 CPU without dropout runs the native kernel: output and the
    gradients of q, k, v against softmax(QK^T/sqrt(D) + M)V in float64 autograd."""
    g = torch.Generator().manual_seed(B * 100 + T)
    if T == S:
        proj = torch.randn(B, T, (H + 2 * HK) * D, generator=g)
        q, k, v = (
            proj[..., a * D : b * D].view(B, T, b - a, D).transpose(1, 2)
            for a, b in ((0, H), (H, H + HK), (H + HK, H + 2 * HK))
        )
    else:
        q, k, v = (torch.randn(B, n, L, D, generator=g) for n, L in ((H, T), (HK, S), (HK, S)))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with track() as ran:
        out = attention(*leaves, causal=causal)
    assert ran["attention"] == {"native"}
    dout = torch.randn(B, T, H, D, generator=g).transpose(1, 2)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = (t.repeat_interleave(H // HK, 1) for t in (k64, v64))
    scores = q64 @ kk.transpose(-2, -1) / D**0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    want = torch.softmax(scores, -1) @ vv
    want.backward(dout.double())
    assert _rel(out, want) < 1e-6
    for got, ref in zip((t.grad for t in leaves), (q64.grad, k64.grad, v64.grad)):
        assert _rel(got, ref) < 1e-6


def test_attention_falls_back_to_sdpa_where_the_native_kernel_does_not_apply():
    """head_dim not a multiple of 16, dropout, an explicit backend: torch SDPA (or the dropout path)."""
    q, k = torch.randn(1, 2, 5, 24), torch.randn(1, 2, 5, 24)
    assert not _native_attention(q)
    q, k = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    assert _native_attention(q)
    assert not _native_attention(q, 0.1)
    assert not _native_attention(q.double())
    with native.disabled():
        assert not _native_attention(q)
    ref = attention(q, k, k, causal=True, backend="sdpa")
    assert _rel(attention(q, k, k, causal=True), ref) < 1e-6
