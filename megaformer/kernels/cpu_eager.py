"""RMSNorm and RoPE for eager fp32 CPU training: the same math as the torch references in fewer
passes over memory (torch composes them from 5-13 elementwise ops each, forward + backward).

RMSNorm, rows x of width N, r = 1 / sqrt(|x|^2 / N + eps):

    y  = x * r * w                                 (|x|^2 by one reduction: vector_norm)
    g  = dy * w
    dx = r g - x r^3 (g . x) / N                   ((g . x) by one reduction: vecdot)
    dw = sum_rows dy * x * r

RoPE on the full head width D (h = D/2; cos/sin halves c, s of the [T, D] tables):

    y1 = x1 c - x2 s,  y2 = x2 c + x1 s            (a rotation of each pair (x1_i, x2_i))
    dx1 = dy1 c + dy2 s,  dx2 = dy2 c - dy1 s       (the rotation by -angle)

computed as y = x C + swap(x) S with C = [c, c], S = [-s, s]: one full-width product, then two
half-width ``addcmul_`` into the same buffer (three passes each way instead of mul, neg, cat, mul,
add and their backward). q and k arrive as [B, H, T, D] views of the projection's [B, T, H D] output
(heads adjacent in memory); there the product runs in that memory order against [T, H, D] tables,
so each inner loop covers a whole row of H D elements instead of D/2 (iterating [B, H, T, D/2]
against [T, D/2]).

SwiGLU of the fused gate/up product y = [g | u] (one GEMM, :func:`megaformer.model.linear.fused_projections`):

    h  = SiLU(g) u
    du = dh SiLU(g),  dg = dh u SiLU'(g)             written into one [.., 2F] gradient dy = [dg | du]

It saves y alone (torch's silu and mul keep g, u and SiLU(g): 3F per token instead of 2F) and
recomputes SiLU(g) in backward; dy is the input gradient of the fused GEMM as is, where splitting y
into g and u would concatenate dg and du (a copy of 2F per token).

Used on fp32 CPU tensors in eager mode with ``model.kernels=auto`` (implementations ``native``
and ``cpu`` of :mod:`megaformer.kernels.selection`): each function takes ``use_native``, one native
kernel each way (:mod:`megaformer.kernels.native`), else the torch ops above. Tested equal to the
references (tests/unit/test_fast_paths.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megaformer.kernels import native


class RMSNormFunction(torch.autograd.Function):
    """y = x r w (see the module docstring); saves x, r, w."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        w: torch.Tensor,
        eps: float,  # type: ignore[override]
        use_native: bool,
    ) -> torch.Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        ctx.native = use_native
        if ctx.native:
            y, r = native.rmsnorm_forward(x2, w, eps)
            ctx.save_for_backward(x2, r, w)
            return y.view(x.shape)
        r = torch.linalg.vector_norm(x2, dim=-1).square_().div_(n).add_(eps).rsqrt_()
        y = torch.mul(x2, r.unsqueeze(1)).mul_(w)
        ctx.save_for_backward(x2, r, w)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, r, w = ctx.saved_tensors
        n = x2.shape[-1]
        if ctx.native:
            dx, dw = native.rmsnorm_backward(x2, w, r, dy.reshape(-1, n))
            return dx.view(dy.shape), dw if ctx.needs_input_grad[1] else None, None, None
        dy2 = dy.reshape(-1, n)
        g = dy2 * w
        coef = torch.linalg.vecdot(g, x2).mul_(r.pow(3)).div_(-n)
        dx = g.mul_(r.unsqueeze(1)).addcmul_(x2, coef.unsqueeze(1))
        dw = (
            torch.linalg.vecdot(dy2, x2 * r.unsqueeze(1), dim=0)
            if ctx.needs_input_grad[1]
            else None
        )
        return dx.view(dy.shape), dw, None, None


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[x1 c - x2 s, x2 c + x1 s] on the last dimension of x [B, H, T, D], into one new buffer."""
    heads, half = x.shape[1], x.shape[-1] // 2
    cos, sin = torch.cat((c, c), -1), torch.cat((-s, s), -1)  # [T, D]
    heads_adjacent = x.stride(-1) == 1 and x.stride(1) == x.shape[-1] and heads > 1
    if heads_adjacent:  # iterate in memory order [B, T, H, D] against [T, H, D] tables
        x = x.transpose(1, 2)
        cos = cos.unsqueeze(1).expand(-1, heads, -1).contiguous()
        sin = sin.unsqueeze(1).expand(-1, heads, -1).contiguous()
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half])
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out.transpose(1, 2) if heads_adjacent else out


class RotaryFunction(torch.autograd.Function):
    """RoPE of x [B, H, T, D] by the half tables c, s [T, D/2] (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        c: torch.Tensor,
        s: torch.Tensor,  # type: ignore[override]
        use_native: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(c, s)
        ctx.native = use_native
        return _rotate_any(x, c, s, use_native)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        c, s = ctx.saved_tensors
        return _rotate_any(dy, c, -s, ctx.native), None, None, None


def _rotate_any(
    x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, use_native: bool
) -> torch.Tensor:
    """The native kernel (one pass, any strides with a contiguous last dimension) or :func:`_rotate`."""
    if use_native and x.stride(-1) == 1 and c.dtype == torch.float32:
        return native.rope(x, c, s)
    return _rotate(x, c, s)


class PackedSwiGLUFunction(torch.autograd.Function):
    """h = SiLU(g) u for y = [g | u] on the last dimension; saves y (see the module docstring).
    One native kernel each way where :mod:`megaformer.kernels.native` loads, else torch ops."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, use_native: bool) -> torch.Tensor:  # type: ignore[override]
        f = y.shape[-1] // 2
        ctx.save_for_backward(y)
        ctx.native = use_native
        if ctx.native:
            return native.swiglu_forward(y)
        return F.silu(y[..., :f]).mul_(y[..., f:])

    @staticmethod
    def backward(ctx, dh: torch.Tensor):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        if ctx.native:
            return native.swiglu_backward(y, dh), None
        f = y.shape[-1] // 2
        g, u = y[..., :f], y[..., f:]
        dy = torch.empty_like(y, memory_format=torch.contiguous_format)
        silu = F.silu(g)
        torch.mul(dh, silu, out=dy[..., f:])  # du = dh SiLU(g)
        dh_u = torch.mul(dh, u, out=silu)  # (buffer reused)
        torch.ops.aten.silu_backward.grad_input(
            dh_u, g, grad_input=dy[..., :f]
        )  # dg = dh u SiLU'(g)
        return dy, None
