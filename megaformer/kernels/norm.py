"""Normalisation kernels: torch reference, Triton (forward + backward), NVIDIA apex, torch native.

    RMSNorm:    y = x * r * w,               r = 1 / sqrt(mean(x^2) + eps)
    LayerNorm:  y = (x - mu) * r * w + b,    r = 1 / sqrt(var(x) + eps)
    backward (x_hat = (x - mu) r, mu = 0 for RMSNorm, g = dy * w, N = row width):
                dx = r (g - x_hat mean(g x_hat) - mean(g))      (the last term only for LayerNorm)
                dw = sum_rows dy x_hat;   db = sum_rows dy

Statistics are computed in fp32. Which implementation runs (``rms_norm`` / ``layer_norm``) is a
rule of :mod:`megaformer.kernels.selection` on device and dtypes -- never a timing, so every run and
every rank computes with the same kernel: on CUDA apex's fused kernels (with its compiled
extension, same dtypes, not under autocast, not a bias-less LayerNorm), else torch's native fused
op for same dtypes, else the Triton kernel (bf16 activations with an fp32 gain); on fp32 CPU
tensors in eager mode RMSNorm runs the native kernel or the fewer-pass autograd function of
:mod:`megaformer.kernels.cpu_eager`; under Triton's interpreter the Triton kernel runs on CPU
(tests); elsewhere (and with ``model.kernels=torch``) the torch reference.

The Triton kernels keep a row in registers: the warps per program grow with the row width
(``_num_warps``), so wide rows (4096-8192 and more) do not spill, and the backward gives each
program a strided set of rows with its partial dw, db sums.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from megaformer.kernels import capabilities
from megaformer.kernels.cpu_eager import RMSNormFunction
from megaformer.kernels.selection import choose_for

# ----------------------------------------------------------------------------- torch reference


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w, statistics in fp32 (the model's definition)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def layer_norm_reference(
    x: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * w + b in fp32, returned in x's dtype."""
    y = F.layer_norm(
        x.float(),
        x.shape[-1:],
        w.float() if w is not None else None,
        b.float() if b is not None else None,
        eps,
    )
    return y.to(x.dtype)


# ----------------------------------------------------------------------------- Triton


@functools.lru_cache(maxsize=None)
def _kernels() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def norm_fwd(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        mean_ptr,
        rstd_ptr,
        N,
        eps,
        IS_RMS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
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
    def norm_bwd(
        x_ptr,
        w_ptr,
        dy_ptr,
        dx_ptr,
        mean_ptr,
        rstd_ptr,
        dw_ptr,
        db_ptr,
        M,
        N,
        IS_RMS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
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


def _num_warps(block: int) -> int:
    """Warps per program: a row of ``block`` fp32 values spread over 32 * warps threads, at most 8
    per thread per tensor held up to width 4096 (4 warps up to 1024, 8 at 2048, 16 from 4096 on),
    so wide rows are not spilled to local memory."""
    return min(16, max(4, block // 256))


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
        block = _block(N)
        _kernels()["fwd"][(M,)](
            x2,
            w,
            bias,
            y,
            mean,
            rstd,
            N,
            eps,
            IS_RMS=rms,
            HAS_BIAS=b is not None and not rms,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
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
        block = _block(N)
        _kernels()["bwd"][(P,)](
            x2,
            w,
            dy2,
            dx,
            mean,
            rstd,
            dw,
            db,
            M,
            N,
            IS_RMS=ctx.rms,
            BLOCK=block,
            num_warps=_num_warps(block),
        )
        db_out = db.sum(0).to(w.dtype) if ctx.has_bias else None
        return dx.view(ctx.shape), dw.sum(0).to(w.dtype), db_out, None, None


def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return NormFunction.apply(x, w, None, eps, True)


def layer_norm_triton(
    x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    return NormFunction.apply(x, w, b, eps, False)


# ----------------------------------------------------------------------------- apex, torch native


def _apex():
    return capabilities.apex_status()[0]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension (see the module docstring for which implementation runs)."""
    impl = choose_for("rms_norm", x, weight_dtype=w.dtype).impl
    if impl == "apex":
        return _apex().fused_rms_norm_affine(x, w, x.shape[-1:], eps)
    if impl == "triton":
        return rms_norm_triton(x, w, eps)
    if impl == "torch-native":
        return F.rms_norm(x, x.shape[-1:], w, eps)
    if impl in ("native", "cpu"):
        return RMSNormFunction.apply(x, w, eps, impl == "native")
    return rms_norm_reference(x, w, eps)


def layer_norm(
    x: torch.Tensor, w: Optional[torch.Tensor], b: Optional[torch.Tensor], eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension (see the module docstring for which implementation runs)."""
    if w is None:
        return layer_norm_reference(x, w, b, eps)
    facts = {"weight_dtype": w.dtype, "bias": b is not None}
    if b is not None and b.dtype != w.dtype:
        facts["weight_dtype"] = b.dtype if b.dtype != x.dtype else w.dtype
    impl = choose_for("layer_norm", x, **facts).impl
    if impl == "apex":
        return _apex().fused_layer_norm_affine(x, w, b, x.shape[-1:], eps)
    if impl == "triton":
        return layer_norm_triton(x, w, b, eps)
    if impl == "torch-native":
        return F.layer_norm(x, x.shape[-1:], w, b, eps)
    return layer_norm_reference(x, w, b, eps)
