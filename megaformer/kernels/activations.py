"""Fused FFN activations: SwiGLU and bias-GELU, one public function each over every implementation.

    SwiGLU:     y = SiLU(g) * u = g * sigmoid(g) * u
                dL/dg = dy * u * s * (1 + g (1 - s)),  s = sigmoid(g);    dL/du = dy * g * s
    bias-GELU:  y = GELU(h + b)
                exact:  GELU(x) = x Phi(x),           GELU'(x) = Phi(x) + x phi(x)
                tanh:   GELU(x) = x/2 (1 + tanh(z)),  z = sqrt(2/pi) (x + 0.044715 x^3)
                        GELU'(x) = (1 + t)/2 + x/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2),  t = tanh(z)
                dL/dh = dy * GELU'(h + b);   dL/db = sum over rows of dL/dh

SwiGLU comes in two forms: :func:`swiglu` (g and u from separate GEMMs) and :func:`swiglu_packed`
(y = [g | u] from one GEMM over the concatenated weights). The Triton kernels read g and u with
their row strides, so the halves of a packed y are read in place, and the packed backward writes
[dg | du] into one buffer (the input gradient of the fused GEMM as is). They compute in fp32, read
the inputs once, write the output once, and recompute the activation in backward from the saved
inputs; bias-GELU reads an fp32 bias beside bf16/fp16 activations (autocast). Which implementation
runs is decided by :mod:`megaformer.kernels.selection` (ops ``swiglu`` and ``bias_gelu``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megaformer.kernels.cpu_eager import PackedSwiGLUFunction
from megaformer.kernels.gemm import linear
from megaformer.kernels.selection import choose_for

_BLOCK = 1024
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def swiglu_reference(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u in torch."""
    return F.silu(g) * u


def bias_gelu_reference(
    h: torch.Tensor, b: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """GELU(h + b) in torch."""
    return F.gelu(h + b if b is not None else h, approximate=approximate)


def _build_kernels() -> dict:
    """The @triton.jit kernels, defined on first use (triton is imported only when it runs).
    Grid: (rows, column blocks); pointers advance by each tensor's own row stride."""
    import triton
    import triton.language as tl

    @triton.jit
    def swiglu_fwd(g_ptr, u_ptr, y_ptr, N, sg, su, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        g = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
        y = g * tl.sigmoid(g) * u
        tl.store(y_ptr + row * sy + cols, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def swiglu_bwd(
        g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, N, sg, su, sdy, sdg, sdu, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        g = tl.load(g_ptr + row * sg + cols, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * sdy + cols, mask=m, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = dy * u * s * (1.0 + g * (1.0 - s))
        du = dy * g * s
        tl.store(dg_ptr + row * sdg + cols, dg.to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(du_ptr + row * sdu + cols, du.to(du_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def gelu_fwd(
        h_ptr, b_ptr, y_ptr, N, HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(h_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if TANH:
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
        else:
            y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def gelu_bwd(
        h_ptr,
        b_ptr,
        dy_ptr,
        dh_ptr,
        N,
        HAS_BIAS: tl.constexpr,
        TANH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < N
        x = tl.load(h_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_BIAS:
            x += tl.load(b_ptr + cols, mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if TANH:
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            t = 2.0 * tl.sigmoid(2.0 * z) - 1.0
            d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (
                1.0 + 0.134145 * x * x
            )
        else:
            d = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476)) + x * 0.3989422804014327 * tl.exp(
                -0.5 * x * x
            )
        tl.store(dh_ptr + row * N + cols, (dy * d).to(dh_ptr.dtype.element_ty), mask=m)

    return {
        "swiglu_fwd": swiglu_fwd,
        "swiglu_bwd": swiglu_bwd,
        "gelu_fwd": gelu_fwd,
        "gelu_bwd": gelu_bwd,
    }


_KERNELS: dict = {}


def _kernels() -> dict:
    if not _KERNELS:
        _KERNELS.update(_build_kernels())
    return _KERNELS


def _grid(rows: int, n: int) -> tuple[int, int]:
    return (max(1, rows), max(1, -(-n // _BLOCK)))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, N] with a unit column stride, without a copy where its layout allows."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < t2.shape[1]):
        t2 = t2.contiguous()
    return t2


class SwiGLUFunction(torch.autograd.Function):
    """y = SiLU(g) * u with the Triton kernels for g, u from separate GEMMs; saves g and u."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g2, u2 = _rows(g), _rows(u)
        M, N = g2.shape
        y = torch.empty((M, N), dtype=g.dtype, device=g.device)
        _kernels()["swiglu_fwd"][_grid(M, N)](
            g2, u2, y, N, g2.stride(0), u2.stride(0), N, BLOCK=_BLOCK
        )
        ctx.save_for_backward(g2, u2)
        ctx.shape = g.shape
        return y.view(g.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        g2, u2 = ctx.saved_tensors
        M, N = g2.shape
        dy2 = _rows(dy)
        dg, du = torch.empty((M, N), dtype=g2.dtype, device=g2.device), torch.empty_like(g2)
        _kernels()["swiglu_bwd"][_grid(M, N)](
            g2, u2, dy2, dg, du, N, g2.stride(0), u2.stride(0), dy2.stride(0), N, N, BLOCK=_BLOCK
        )
        return dg.view(ctx.shape), du.view(ctx.shape)


class PackedSwiGLUTriton(torch.autograd.Function):
    """h = SiLU(g) * u for y = [g | u] on the last dimension with the Triton kernels: the halves are
    read in place (row stride 2F), and backward writes [dg | du] into one buffer; saves y."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y2 = _rows(y)
        M, F2 = y2.shape
        N = F2 // 2
        h = torch.empty((M, N), dtype=y.dtype, device=y.device)
        _kernels()["swiglu_fwd"][_grid(M, N)](
            y2, y2[:, N:], h, N, y2.stride(0), y2.stride(0), N, BLOCK=_BLOCK
        )
        ctx.save_for_backward(y2)
        ctx.shape = y.shape
        return h.view(*y.shape[:-1], N)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):  # type: ignore[override]
        (y2,) = ctx.saved_tensors
        M, F2 = y2.shape
        N = F2 // 2
        dh2 = _rows(dh)
        dy = torch.empty((M, F2), dtype=y2.dtype, device=y2.device)
        _kernels()["swiglu_bwd"][_grid(M, N)](
            y2,
            y2[:, N:],
            dh2,
            dy,
            dy[:, N:],
            N,
            y2.stride(0),
            y2.stride(0),
            dh2.stride(0),
            F2,
            F2,
            BLOCK=_BLOCK,
        )
        return dy.view(ctx.shape)


class BiasGELUFunction(torch.autograd.Function):
    """y = GELU(h + b) with the Triton kernels (b broadcast over the rows, in its own dtype, or
    None); the output has h's dtype."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, b: torch.Tensor | None, tanh: bool) -> torch.Tensor:  # type: ignore[override]
        h2 = h.reshape(-1, h.shape[-1]).contiguous()
        M, N = h2.shape
        y = torch.empty_like(h2)
        bias = b.contiguous() if b is not None else h2  # unused pointer when there is no bias
        _kernels()["gelu_fwd"][_grid(M, N)](
            h2, bias, y, N, HAS_BIAS=b is not None, TANH=tanh, BLOCK=_BLOCK
        )
        ctx.save_for_backward(h2, b)
        ctx.tanh, ctx.shape = tanh, h.shape
        return y.view(h.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        h2, b = ctx.saved_tensors
        M, N = h2.shape
        dy2 = dy.reshape(M, N).contiguous()
        dh = torch.empty_like(h2)
        bias = b if b is not None else h2
        _kernels()["gelu_bwd"][_grid(M, N)](
            h2, bias, dy2, dh, N, HAS_BIAS=b is not None, TANH=ctx.tanh, BLOCK=_BLOCK
        )
        db = None
        if b is not None and ctx.needs_input_grad[1]:
            db = dh.float().sum(dim=0).to(b.dtype)
        return dh.view(ctx.shape), db, None


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u for g, u of the same shape (the gate and up projections of a SwiGLU FFN)."""
    if g.shape == u.shape and g.dtype == u.dtype and choose_for("swiglu", g).impl == "triton":
        return SwiGLUFunction.apply(g, u)
    return swiglu_reference(g, u)


def swiglu_packed(y: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u for y = [g | u] on the last dimension (the output of one GEMM over the
    concatenated gate and up weights) -> [..., F]."""
    impl = choose_for("swiglu", y).impl
    if impl == "triton":
        return PackedSwiGLUTriton.apply(y)
    if impl in ("native", "cpu"):
        return PackedSwiGLUFunction.apply(y, impl == "native")
    g, u = y.chunk(2, dim=-1)
    return swiglu_reference(g, u)


def bias_gelu(h: torch.Tensor, b: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """GELU(h + b) (``approximate`` none or tanh) for h = x W1 without its bias."""
    if choose_for("bias_gelu", h).impl == "triton" and (b is None or b.shape == h.shape[-1:]):
        return BiasGELUFunction.apply(h, b, approximate == "tanh")
    return bias_gelu_reference(h, b, approximate)


def linear_gelu(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """GELU(x W^T + b): the GEMM without its bias and then the fused bias-GELU kernel where it
    runs, else GELU of the GEMM with its bias (one pass fewer than adding the bias apart)."""
    if b is not None and choose_for("bias_gelu", x).impl == "triton":
        return bias_gelu(linear(x, w), b, approximate)
    return F.gelu(linear(x, w, b), approximate=approximate)
