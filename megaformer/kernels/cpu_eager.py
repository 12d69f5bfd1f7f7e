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

computed with ``mul(out=)`` + ``addcmul_`` into one output buffer: four half-width passes each way
instead of mul, neg, cat, mul, add (and their backward). Used on fp32 CPU tensors in eager mode with
``model.fused_kernels=auto``; inside ``torch.compile`` the torch references run and inductor fuses
them itself. Tested equal to the references (tests/test_fast_paths.py).
"""

from __future__ import annotations

import torch


def cpu_eager(x: torch.Tensor, kernels: str) -> bool:
    """These paths apply: fused_kernels=auto, an fp32 CPU tensor, eager (not compiling), no autocast."""
    return (kernels == "auto" and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu"))


class RMSNormFunction(torch.autograd.Function):
    """y = x r w (see the module docstring); saves x, r, w."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        n = x.shape[-1]
        x2 = x.reshape(-1, n)
        r = torch.linalg.vector_norm(x2, dim=-1).square_().div_(n).add_(eps).rsqrt_()
        y = torch.mul(x2, r.unsqueeze(1)).mul_(w)
        ctx.save_for_backward(x2, r, w)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x2, r, w = ctx.saved_tensors
        n = x2.shape[-1]
        dy2 = dy.reshape(-1, n)
        g = dy2 * w
        coef = torch.linalg.vecdot(g, x2).mul_(r.pow(3)).div_(-n)
        dx = g.mul_(r.unsqueeze(1)).addcmul_(x2, coef.unsqueeze(1))
        dw = torch.linalg.vecdot(dy2, x2 * r.unsqueeze(1), dim=0) if ctx.needs_input_grad[1] else None
        return dx.view(dy.shape), dw, None


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """[x1 c - x2 s, x2 c + x1 s] on the last dimension, into one new buffer."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :h], out[..., h:]
    torch.mul(x1, c, out=o1).addcmul_(x2, s, value=-1.0)
    torch.mul(x2, c, out=o2).addcmul_(x1, s)
    return out


class RotaryFunction(torch.autograd.Function):
    """RoPE of x [B, H, T, D] by the half tables c, s [T, D/2] (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(c, s)
        return _rotate(x, c, s)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        c, s = ctx.saved_tensors
        return _rotate(dy, c, -s), None, None
