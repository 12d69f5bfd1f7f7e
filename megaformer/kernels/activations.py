"""Fused FFN activations (Triton forward and backward, torch fallback).

    SwiGLU:     y = SiLU(g) * u = g * sigmoid(g) * u
                dL/dg = dy * u * s * (1 + g (1 - s)),  s = sigmoid(g);    dL/du = dy * g * s
    bias-GELU:  y = GELU(h + b)
                exact:  GELU(x) = x Phi(x),           GELU'(x) = Phi(x) + x phi(x)
                tanh:   GELU(x) = x/2 (1 + tanh(z)),  z = sqrt(2/pi) (x + 0.044715 x^3)
                        GELU'(x) = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),  t = tanh(z)
                dL/dh = dy * GELU'(h + b);   dL/db = sum over rows of dL/dh

The unfused torch version reads and writes each [tokens, d_ffn] intermediate once per elementwise op
(SiLU, multiply; add, GELU) and keeps them for backward; the kernels read the inputs once, compute in
fp32, write the output once, and recompute the activation in backward from the saved inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megaformer.kernels.triton_support import announce, use_triton

_BLOCK = 1024
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def swiglu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u in torch."""
    return F.silu(g) * u


def bias_gelu_reference(h: torch.Tensor, b: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """GELU(h + b) in torch."""
    return F.gelu(h + b if b is not None else h, approximate=approximate)


def _build_kernels() -> dict:
    """The @triton.jit kernels, defined on first use (triton is imported only when it runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_fwd(g_ptr, u_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def swiglu_bwd(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
        tl.store(dg_ptr + offs, dg.to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(du_ptr + offs, du.to(du_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def gelu_fwd(h_ptr, b_ptr, y_ptr, n, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                 BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(b_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
        if TANH:
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
        else:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def gelu_bwd(h_ptr, b_ptr, dy_ptr, dh_ptr, n, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                 BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(b_ptr + offs % N, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if TANH:
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
            d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        else:
            d = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
        tl.store(dh_ptr + offs, (dy * d).to(dh_ptr.dtype.element_ty), mask=m)

    return {"swiglu_fwd": swiglu_fwd, "swiglu_bwd": swiglu_bwd, "gelu_fwd": gelu_fwd,
            "gelu_bwd": gelu_bwd}


_KERNELS: dict = {}


def _kernels() -> dict:
    if not _KERNELS:
        _KERNELS.update(_build_kernels())
    return _KERNELS


def _grid(n: int) -> tuple[int]:
    return (max(1, -(-n // _BLOCK)),)


class SwiGLUFunction(torch.autograd.Function):
    """y = SiLU(g) * u with the Triton kernels; saves g and u, recomputes SiLU in backward."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g, u = g.contiguous(), u.contiguous()
        y = torch.empty_like(g)
        _kernels()["swiglu_fwd"][_grid(g.numel())](g, u, y, g.numel(), BLOCK=_BLOCK)
        ctx.save_for_backward(g, u)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        g, u = ctx.saved_tensors
        dy = dy.contiguous()
        dg, du = torch.empty_like(g), torch.empty_like(u)
        _kernels()["swiglu_bwd"][_grid(g.numel())](g, u, dy, dg, du, g.numel(), BLOCK=_BLOCK)
        return dg, du


class BiasGELUFunction(torch.autograd.Function):
    """y = GELU(h + b) with the Triton kernels (b broadcast over the last dimension, or None)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, b: torch.Tensor | None, tanh: bool) -> torch.Tensor:  # type: ignore[override]
        h = h.contiguous()
        y = torch.empty_like(h)
        bias = b.contiguous() if b is not None else h  # unused pointer when there is no bias
        _kernels()["gelu_fwd"][_grid(h.numel())](h, bias, y, h.numel(), h.shape[-1], HAS_BIAS=b is not None,
                                                TANH=tanh, BLOCK=_BLOCK)
        ctx.save_for_backward(h, b)
        ctx.tanh = tanh
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        h, b = ctx.saved_tensors
        dy = dy.contiguous()
        dh = torch.empty_like(h)
        bias = b if b is not None else h
        _kernels()["gelu_bwd"][_grid(h.numel())](h, bias, dy, dh, h.numel(), h.shape[-1],
                                                HAS_BIAS=b is not None, TANH=ctx.tanh, BLOCK=_BLOCK)
        db = None
        if b is not None and ctx.needs_input_grad[1]:
            db = dh.float().sum(dim=tuple(range(dh.dim() - 1))).to(b.dtype)
        return dh, db, None


def _same_dtype(*ts: torch.Tensor | None) -> bool:
    dtypes = {t.dtype for t in ts if t is not None}
    return len(dtypes) == 1


def swiglu(g: torch.Tensor, u: torch.Tensor, kernels: str = "auto") -> torch.Tensor:
    """SiLU(g) * u: the Triton kernel on CUDA (or under the interpreter), else torch."""
    if use_triton(g, kernels) and g.shape == u.shape and _same_dtype(g, u):
        announce("SwiGLU", "fused Triton kernel")
        return SwiGLUFunction.apply(g, u)
    return swiglu_reference(g, u)


def bias_gelu(h: torch.Tensor, b: torch.Tensor | None, approximate: str = "none",
              kernels: str = "auto") -> torch.Tensor:
    """GELU(h + b) (``approximate`` none or tanh): the Triton kernel on CUDA, else torch."""
    if use_triton(h, kernels) and _same_dtype(h, b):
        announce("bias-GELU", "fused Triton kernel")
        return BiasGELUFunction.apply(h, b, approximate == "tanh")
    return bias_gelu_reference(h, b, approximate)
