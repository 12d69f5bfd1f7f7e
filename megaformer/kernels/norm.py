"""Normalisation kernels: torch reference, Triton (forward + backward), NVIDIA apex, torch native.

    RMSNorm:    y = x * r * w,               r = 1 / sqrt(mean(x^2) + eps)
    LayerNorm:  y = (x - mu) * r * w + b,    r = 1 / sqrt(var(x) + eps)
    backward (x_hat = (x - mu) r, mu = 0 for RMSNorm, g = dy * w, N = row width):
                dx = r (g - x_hat mean(g x_hat) - mean(g))      (the last term only for LayerNorm)
                dw = sum_rows dy x_hat;   db = sum_rows dy

Statistics are computed in fp32. Dispatch (``rms_norm`` / ``layer_norm``) on a CUDA tensor: apex's
fused kernels when apex is installed; else whichever of the Triton kernel and torch's native op
(``F.rms_norm`` / ``F.layer_norm``) runs forward + backward faster, timed once per (width, dtype)
and logged. On fp32 CPU tensors in eager mode RMSNorm runs the fewer-pass autograd function of
``megaformer.kernels.cpu_eager``. Elsewhere (and with ``model.fused_kernels=torch``) the torch
reference runs; under Triton's interpreter the Triton kernel runs on CPU (tests).
"""

from __future__ import annotations

import functools
import importlib
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaformer.kernels.cpu_eager import RMSNormFunction, cpu_eager
from megaformer.kernels.triton_support import announce, interpreting, use_triton


# ----------------------------------------------------------------------------- torch reference

def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w, statistics in fp32 (the model's definition)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def layer_norm_reference(x: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor],
                         eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b in fp32, returned in x's dtype."""
    y = F.layer_norm(x.float(), x.shape[-1:], w.float() if w is not None else None,
                     b.float() if b is not None else None, eps)
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- Triton

@functools.lru_cache(maxsize=None)
def _kernels() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def norm_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, eps,
                 IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if IS_RMS:
            mean = 0.0
        else:
            mean = tl.sum(x, axis=0) / N
        xc = tl.where(m, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        y = xc * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=m)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def norm_bwd(x_ptr, w_ptr, dy_ptr, dx_ptr, mean_ptr, rstd_ptr, dw_ptr, db_ptr, M, N,
                 IS_RMS: tl.constexpr, BLOCK: tl.constexpr):
        """Program p does rows p, p + P, ...; writes its partial dw, db sums to row p of [P, N]."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < N
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, tl.num_programs(0)):
            base = tl.cast(row, tl.int64) * N
            x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            xhat = tl.where(m, (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row), 0.0)
            g = dy * w
            c1 = tl.sum(g * xhat, axis=0) / N
            if IS_RMS:
                dx = (g - xhat * c1) * tl.load(rstd_ptr + row)
            else:
                c2 = tl.sum(g, axis=0) / N
                dx = (g - xhat * c1 - c2) * tl.load(rstd_ptr + row)
            tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
            dw += dy * xhat
            db += dy
        tl.store(dw_ptr + pid * N + cols, dw, mask=m)
        tl.store(db_ptr + pid * N + cols, db, mask=m)

    return {"fwd": norm_fwd, "bwd": norm_bwd}


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _programs(rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        return max(1, min(rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count))
    return max(1, min(rows, 4))


class NormFunction(torch.autograd.Function):
    """RMSNorm (b ignored, ``rms=True``) or LayerNorm over the last dimension with Triton kernels.

    Output dtype: x's dtype for LayerNorm; the promotion of x and w for RMSNorm (as the reference)."""

    @staticmethod
    def forward(ctx, x, w, b, eps: float, rms: bool):  # type: ignore[override]
        shape, N = x.shape, x.shape[-1]
        x2 = x.reshape(-1, N).contiguous()
        M = x2.shape[0]
        out_dtype = torch.promote_types(x.dtype, w.dtype) if rms else x.dtype
        y = torch.empty((M, N), dtype=out_dtype, device=x.device)
        mean = torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty_like(mean)
        bias = b if (b is not None and not rms) else w
        _kernels()["fwd"][(M,)](x2, w, bias, y, mean, rstd, N, eps, IS_RMS=rms,
                                HAS_BIAS=b is not None and not rms, BLOCK=_block(N))
        ctx.save_for_backward(x2, w, mean, rstd)
        ctx.rms, ctx.has_bias, ctx.shape = rms, b is not None and not rms, shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        x2, w, mean, rstd = ctx.saved_tensors
        M, N = x2.shape
        dy2 = dy.reshape(M, N).contiguous()
        dx = torch.empty_like(x2)
        P = _programs(M, x2.device)
        dw = torch.empty((P, N), dtype=torch.float32, device=x2.device)
        db = torch.empty_like(dw)
        _kernels()["bwd"][(P,)](x2, w, dy2, dx, mean, rstd, dw, db, M, N, IS_RMS=ctx.rms,
                                BLOCK=_block(N))
        db_out = db.sum(0).to(w.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw.sum(0).to(w.dtype), db_out, None, None


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return NormFunction.apply(x, w, None, eps, True)


def layer_norm_triton(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return NormFunction.apply(x, w, b, eps, False)


# ----------------------------------------------------------------------------- apex, native

@functools.lru_cache(maxsize=None)
def _apex() -> Optional[object]:
    """NVIDIA apex's fused_layer_norm module (built with its CUDA extensions), or None."""
    try:
        return importlib.import_module("apex.normalization.fused_layer_norm")
    except Exception:  # not installed, the unrelated PyPI "apex", or built without extensions
        return None


def _rms_native(x, w, eps):
    return F.rms_norm(x, x.shape[-1:], w, eps)


def _ln_native(x, w, b, eps):
    return F.layer_norm(x, x.shape[-1:], w, b, eps)


def _rms_apex(x, w, eps):
    return _apex().fused_rms_norm_affine(x, w, x.shape[-1:], eps)


def _ln_apex(x, w, b, eps):
    return _apex().fused_layer_norm_affine(x, w, b, x.shape[-1:], eps)


def _time_fwd_bwd(fn: Callable, args: tuple, iters: int = 10) -> float:
    x = args[0].detach().requires_grad_(True)
    rest = args[1:]
    for _ in range(2):
        fn(x, *rest).sum().backward()
    torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x, *rest).sum().backward()
    torch.cuda.synchronize(x.device)
    return time.perf_counter() - t0


_CHOICE: dict = {}


def _pick(kind: str, candidates: dict[str, Callable], args: tuple) -> Callable:
    """The fastest candidate for (kind, width, dtype, device), measured once (CUDA), and logged."""
    x = args[0]
    key = (kind, x.shape[-1], x.dtype, args[1].dtype, str(x.device))
    if key not in _CHOICE:
        if len(candidates) == 1:
            name = next(iter(candidates))
        else:
            with torch.enable_grad():
                times = {n: _time_fwd_bwd(f, tuple(a.detach() if isinstance(a, torch.Tensor) else a
                                                   for a in args)) for n, f in candidates.items()}
            name = min(times, key=times.get)
            announce(f"{kind} (width {x.shape[-1]}, {str(x.dtype).replace('torch.', '')})",
                     f"{name} (measured fwd+bwd: " + ", ".join(f"{n} {1e3 * t:.2f} ms" for n, t in times.items()) + ")")
        _CHOICE[key] = candidates[name]
    return _CHOICE[key]


def _candidates(kind: str, same_dtype: bool) -> dict[str, Callable]:
    """apex alone when installed; else Triton and torch's native op. Mixed dtypes (an fp32 gain
    on bf16 activations under autocast): only the Triton kernel, which reads each in its own dtype."""
    triton_fn = rms_norm_triton if kind == "RMSNorm" else layer_norm_triton
    if not same_dtype:
        return {"triton": triton_fn}
    if _apex() is not None:
        return {"apex": _rms_apex if kind == "RMSNorm" else _ln_apex}
    native = _rms_native if kind == "RMSNorm" else _ln_native
    out = {"triton": triton_fn, "torch native": native}
    if kind == "RMSNorm" and not hasattr(F, "rms_norm"):  # torch < 2.4
        out.pop("torch native")
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, kernels: str = "auto") -> torch.Tensor:
    """RMSNorm over the last dimension (see the module docstring for the dispatch)."""
    if not use_triton(x, kernels):
        if cpu_eager(x, kernels) and w.dtype == torch.float32:
            return RMSNormFunction.apply(x, w, eps)
        return rms_norm_reference(x, w, eps)
    if interpreting() and not x.is_cuda:
        return rms_norm_triton(x, w, eps)
    return _pick("RMSNorm", _candidates("RMSNorm", x.dtype == w.dtype), (x, w, eps))(x, w, eps)


def layer_norm(x: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor], eps: float,
               kernels: str = "auto") -> torch.Tensor:
    """LayerNorm over the last dimension (see the module docstring for the dispatch)."""
    if w is None or not use_triton(x, kernels):
        return layer_norm_reference(x, w, b, eps)
    if interpreting() and not x.is_cuda:
        return layer_norm_triton(x, w, b, eps)
    same = x.dtype == w.dtype and (b is None or b.dtype == w.dtype)
    return _pick("LayerNorm", _candidates("LayerNorm", same), (x, w, b, eps))(x, w, b, eps)
