"""The kernel checks of ``megaformer check``: each kernel's public dispatch function (whatever
implementation it picks on the device) against a plain torch formula evaluated in float64 on the
same inputs -- forward output and every input gradient for a random upstream gradient, error =
||y - y_ref|| / ||y_ref||, the worst over them, per dtype (CUDA: bf16, fp16, fp32; CPU: fp32)
against :data:`TOLERANCE`; dropout by its dropped fraction and its kept values. The checks are a
table of :class:`KernelCheck` entries (name, kernel function, reference, inputs) in
:data:`KERNEL_CHECKS`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

from megaformer.kernels import activations, cross_entropy, dropout, gemm, norm, selection
from megaformer.kernels import attention as attention_ops
from megaformer.kernels import rope as rope_ops

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class KernelCheck:
    """One kernel against its reference.

    ``inputs(large, gen)`` returns the arguments in fp32 on the CPU (``large``: GPU-sized shapes);
    floating-point ones are cast to the checked dtype and moved to the device for ``fn``, and the
    same rounded values go to ``reference`` in float64. The arguments at the positions in
    ``grads`` (default: every floating-point one) are differentiated."""

    name: str
    fn: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    inputs: Callable[[bool, torch.Generator], tuple]
    grads: Optional[tuple] = None


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


# attention: q [B, H, T, D], k, v [B, Hkv, T, D] (grouped-query: H = 2 Hkv)


def _attention_inputs(large: bool, gen: torch.Generator) -> tuple:
    B, H, T, D = (2, 8, 256, 128) if large else (2, 4, 128, 64)
    return _randn(gen, B, H, T, D), _randn(gen, B, H // 2, T, D), _randn(gen, B, H // 2, T, D)


def _document_inputs(large: bool, gen: torch.Generator) -> tuple:
    q, k, v = _attention_inputs(large, gen)
    B, T = q.shape[0], q.shape[2]
    starts = torch.rand(B, T, generator=gen) < 8.0 / T  # about 8 documents per row
    starts[:, 0] = False
    return q, k, v, starts.cumsum(dim=-1).to(torch.int32)  # doc_ids [B, T]


def _attention_reference(q, k, v, causal: bool, doc_ids=None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D) + M) V with K, V heads repeated for the query groups."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    T, S = q.shape[2], k.shape[2]
    allowed = torch.ones(T, S, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(diagonal=S - T)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _gelu_reference(h, b) -> torch.Tensor:
    """GELU(h + b) exactly, 0.5 x (1 + erf(x / sqrt 2)), and in the tanh form
    0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), concatenated."""
    x = h + b
    exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    tanh = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return torch.cat([exact, tanh])


def _norm_inputs(large: bool, gen: torch.Generator) -> tuple:
    rows, width = (256, 4096) if large else (64, 256)
    x = _randn(gen, rows, width, scale=2.0) + 0.5
    return x, 1.0 + 0.1 * _randn(gen, width), 0.1 * _randn(gen, width)


def _rms_reference(x, w) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-5) * w


def _layer_norm_reference(x, w, b) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b (biased variance)."""
    mu = x.mean(dim=-1, keepdim=True)
    var = (x - mu).pow(2).mean(dim=-1, keepdim=True)
    return (x - mu) * torch.rsqrt(var + 1e-5) * w + b


def _rope_inputs(large: bool, gen: torch.Generator) -> tuple:
    B, H, T, D = (2, 8, 256, 128) if large else (2, 4, 64, 32)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (
        -torch.arange(0, D, 2, dtype=torch.float64) / D
    )
    emb = torch.cat([angles, angles], dim=-1)
    return _randn(gen, B, H, T, D), emb.cos().float(), emb.sin().float()


def _rope_reference(x, cos, sin) -> torch.Tensor:
    """Pairs (i, i + D/2) rotated: [x1 cos - x2 sin, x2 cos + x1 sin]."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    c, s = cos[..., :h], sin[..., :h]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


_CE_VOCAB = 1000  # real vocabulary; the weight has padded rows beyond it


def _ce_inputs(large: bool, gen: torch.Generator) -> tuple:
    n, d, padded = (512, 512, 1024) if large else (192, 128, 1024)
    labels = torch.randint(0, _CE_VOCAB, (n,), generator=gen)
    labels[::7] = -100  # ignored positions
    return _randn(gen, n, d), _randn(gen, padded, d, scale=d**-0.5), labels


def _ce_reference(h, w, labels) -> torch.Tensor:
    """mean over labels != -100 of logsumexp(z) - z_label, z = h W^T over the real vocabulary."""
    return _ce_logits_reference(h @ w.T, labels)


def _ce_logits_inputs(large: bool, gen: torch.Generator) -> tuple:
    h, w, labels = _ce_inputs(large, gen)
    return h @ w.T * 4.0, labels


def _ce_logits_reference(z, labels) -> torch.Tensor:
    """mean over labels != -100 of logsumexp(z_t) - z_t,label over the first _CE_VOCAB columns."""
    z, keep = z[:, :_CE_VOCAB], labels != -100
    lse = torch.logsumexp(z[keep], dim=-1)
    return (lse - z[keep].gather(-1, labels[keep][:, None])[:, 0]).mean()


def _linear_inputs(large: bool, gen: torch.Generator) -> tuple:
    n, k, m = (512, 1024, 1536) if large else (256, 256, 384)
    return _randn(gen, 4, n // 4, k), _randn(gen, m, k, scale=k**-0.5), _randn(gen, m)


#: (name, kernel, reference, inputs): the kernels' public dispatch functions, called through their
#: modules so that replacing a module attribute reaches the check.
KERNEL_CHECKS: list[KernelCheck] = [
    KernelCheck(
        "attention (causal, GQA)",
        lambda q, k, v: attention_ops.attention(q, k, v, causal=True),
        lambda q, k, v: _attention_reference(q, k, v, True),
        _attention_inputs,
    ),
    KernelCheck(
        "attention (full)",
        lambda q, k, v: attention_ops.attention(q, k, v, causal=False),
        lambda q, k, v: _attention_reference(q, k, v, False),
        _attention_inputs,
    ),
    KernelCheck(
        "attention (documents)",
        lambda q, k, v, d: attention_ops.attention(q, k, v, causal=True, doc_ids=d),
        lambda q, k, v, d: _attention_reference(q, k, v, True, d),
        _document_inputs,
    ),
    KernelCheck(
        "swiglu",
        lambda g, u: activations.swiglu(g, u),
        lambda g, u: g * torch.sigmoid(g) * u,
        lambda large, gen: (
            _randn(gen, 256, 2048 if large else 256, scale=2.0),
            _randn(gen, 256, 2048 if large else 256),
        ),
    ),
    KernelCheck(
        "bias_gelu",
        lambda h, b: torch.cat(
            [activations.bias_gelu(h, b, "none"), activations.bias_gelu(h, b, "tanh")]
        ),
        _gelu_reference,
        lambda large, gen: (
            _randn(gen, 256, 2048 if large else 256, scale=2.0),
            _randn(gen, 2048 if large else 256),
        ),
    ),
    KernelCheck(
        "rms_norm",
        lambda x, w: norm.rms_norm(x, w, 1e-5),
        _rms_reference,
        lambda large, gen: _norm_inputs(large, gen)[:2],
    ),
    KernelCheck(
        "layer_norm",
        lambda x, w, b: norm.layer_norm(x, w, b, 1e-5),
        _layer_norm_reference,
        _norm_inputs,
    ),
    KernelCheck(
        "rope", lambda x, c, s: rope_ops.rope(x, c, s), _rope_reference, _rope_inputs, grads=(0,)
    ),
    KernelCheck(
        "cross_entropy",
        lambda z, y: cross_entropy.cross_entropy(z, y, _CE_VOCAB),
        _ce_logits_reference,
        _ce_logits_inputs,
    ),
    KernelCheck(
        "cross_entropy (chunked)",
        lambda h, w, y: cross_entropy.chunked_cross_entropy(h, w, y, 64, vocab_size=_CE_VOCAB),
        _ce_reference,
        _ce_inputs,
    ),
    KernelCheck(
        "linear", lambda x, w, b: gemm.linear(x, w, b), lambda x, w, b: x @ w.T + b, _linear_inputs
    ),
]


@dataclass
class KernelOutcome:
    """One kernel on one rank: the worst relative error per dtype name, and what failed."""

    errors: dict = field(default_factory=dict)  # dtype name -> worst relative error
    failure: Optional[str] = None  # first dtype out of tolerance, or an exception
    via: list = field(default_factory=list)  # implementations that ran


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.detach().double(), ref.detach().double()
    if not torch.isfinite(y).all():
        return math.inf
    return float((y - ref).norm() / ref.norm().clamp_min(1e-30))


@contextlib.contextmanager
def _exact_fp32() -> Iterator[None]:
    """TF32 off for the duration: fp32 results are compared at fp32 tolerance."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _check_dtype(
    check: KernelCheck, device: torch.device, dtype: torch.dtype, seed: int
) -> tuple[float, str]:
    """(worst relative error, which tensor) of one kernel in one dtype, forward and backward."""
    gen = torch.Generator().manual_seed(seed)
    base = check.inputs(device.type == "cuda", gen)
    args, ref_args = [], []
    for i, a in enumerate(base):
        if a.is_floating_point():
            a = a.to(dtype)
            diff = check.grads is None or i in check.grads
            ref_args.append(a.to(device, torch.float64).requires_grad_(diff))
            args.append(a.to(device).requires_grad_(diff))
        else:
            ref_args.append(a.to(device))
            args.append(a.to(device))
    y = check.fn(*args)
    ref = check.reference(*ref_args)
    dy = torch.randn(tuple(ref.shape), generator=gen).to(device, torch.float64)
    diff = [a for a in args if a.requires_grad]
    grads = torch.autograd.grad(y, diff, dy.to(y.dtype))
    ref_grads = torch.autograd.grad(ref, [a for a in ref_args if a.requires_grad], dy)
    names = ["output"] + [f"grad of argument {i}" for i, a in enumerate(args) if a.requires_grad]
    errors = [_relative_error(y, ref)] + [_relative_error(g, r) for g, r in zip(grads, ref_grads)]
    worst = max(range(len(errors)), key=lambda i: errors[i])
    return errors[worst], names[worst]


def has_bf16(device: torch.device) -> bool:
    """The GPU computes in bf16 natively (compute capability 8.0 and newer; not emulated)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def check_dtypes(device: torch.device) -> list[torch.dtype]:
    """The dtypes the kernels are checked in: bf16 (where native), fp16, fp32 on CUDA; fp32 on CPU."""
    if device.type != "cuda":
        return [torch.float32]
    return ([torch.bfloat16] if has_bf16(device) else []) + [torch.float16, torch.float32]


def _per_dtype(
    measure: Callable[[torch.dtype], tuple[float, str]], dtypes: Sequence[torch.dtype]
) -> KernelOutcome:
    """``measure(dtype)`` -> (error, what) for each dtype, against :data:`TOLERANCE`; an
    exception is a failure (reported, not raised: a kernel that crashes on this device fails)."""
    out = KernelOutcome()
    with selection.track() as ran, _exact_fp32():
        for dtype in dtypes:
            name = _DTYPE_NAMES[dtype]
            try:
                err, what = measure(dtype)
            except Exception as e:
                out.failure = out.failure or f"{name}: {type(e).__name__}: {first_line(e)}"
                continue
            out.errors[name] = err
            if not err <= TOLERANCE[dtype] and out.failure is None:
                out.failure = (
                    f"{name}: {what} not finite"
                    if math.isinf(err)
                    else f"{name}: {what} rel. error {err:.1e} > {TOLERANCE[dtype]:.0e}"
                )
    out.via = _implementations(ran)
    return out


def run_kernel_check(
    check: KernelCheck,
    device: torch.device,
    dtypes: Optional[Sequence[torch.dtype]] = None,
    seed: int = 0,
) -> KernelOutcome:
    """One kernel against its reference in every dtype of ``dtypes`` (default :func:`check_dtypes`)."""
    return _per_dtype(
        lambda dt: _check_dtype(check, device, dt, seed), dtypes or check_dtypes(device)
    )


def _implementations(ran: dict) -> list[str]:
    """ "op: impl" for what ran (one op's implementations joined by "+"), e.g. ["rms_norm: triton"]."""
    return [f"{op}: {'+'.join(sorted(impls))}" for op, impls in sorted(ran.items())]


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else ""


def _check_dropout(device: torch.device, dtype: torch.dtype, seed: int) -> tuple[float, str]:
    """dropout(x, p): kept entries are x / (1 - p), the dropped fraction is p within 6 sigma
    (sigma = sqrt(p (1 - p) / n)), and the gradient is dy / (1 - p) on the kept entries, 0 elsewhere.
    Returns (worst relative error of the kept values and gradient, what), or raises on a wrong rate."""
    p, n = 0.125, (1 << 20) if device.type == "cuda" else (1 << 16)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        x = (torch.rand(n, device=device) + 0.5).to(dtype).requires_grad_()  # no zeros in x
        y = dropout.dropout(x, p, training=True)
        dy = torch.rand(n, device=device).to(dtype)
    kept = y.detach() != 0
    rate = 1.0 - kept.float().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    if abs(rate - p) > 6 * sigma:
        raise AssertionError(f"dropped fraction {rate:.4f}, expected {p} +- {6 * sigma:.4f}")
    (dx,) = torch.autograd.grad(y, x, dy)
    ref_y = x.detach().double() * kept / (1 - p)
    ref_dx = dy.double() * kept / (1 - p)
    ey, edx = _relative_error(y, ref_y), _relative_error(dx, ref_dx)
    return (ey, "output") if ey >= edx else (edx, "grad of argument 0")


def run_dropout_check(
    device: torch.device, dtypes: Optional[Sequence[torch.dtype]] = None, seed: int = 0
) -> KernelOutcome:
    """The dropout kernel (random by nature: checked by its rate and its kept values)."""
    return _per_dtype(lambda dt: _check_dropout(device, dt, seed), dtypes or check_dtypes(device))
