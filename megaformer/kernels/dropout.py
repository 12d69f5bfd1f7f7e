"""Dropout on CPU from 16-bit random integers, with a one-byte mask saved for backward.

    y = x * m / q,   m_i = [r_i >= t],   r_i uniform on the 2^16 values of an int16,
    t = round(p * 2^16) - 2^15,  q = P(m_i = 1) = 1 - round(p * 2^16) / 2^16,
    dx = dy * m / q

So E[y] = x exactly, and the drop probability is p rounded to a multiple of 2^-16 (|error| <=
7.6e-6). torch's CPU ``F.dropout`` draws a float Bernoulli sample per element, divides it by 1 - p
and saves it (4 bytes per element); here the randomness is half an int32 per element (torch's
generator, so ``torch.manual_seed`` and the tensor-parallel RNG forks govern it as before), and the
saved mask is a bool. Where the native CPU kernels load (:mod:`megaformer.kernels.native`, fp32
eager) one pass draws the mask from a counter-based hash (drop probability p to 2^-32) and writes
the product. On CUDA torch's fused dropout kernel runs (``F.dropout``), and everywhere with
``model.kernels=torch`` (op ``dropout`` of :mod:`megaformer.kernels.selection`).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaformer.kernels import native
from megaformer.kernels.selection import choose_for


def keep_mask(shape: torch.Size, p: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """(m, 1 / q): a bool keep-mask of ``shape`` with P(keep) = q (see the module docstring)."""
    n = shape.numel()
    bits = torch.empty((n + 1) // 2, dtype=torch.int32, device=device).random_(-(2**31), 2**31)
    r = bits.view(torch.int16)[:n].view(shape)
    drop = round(p * 65536)
    return r >= drop - 32768, 65536.0 / (65536 - drop)


class _MaskedScale(torch.autograd.Function):
    """y = x * m * scale with the bool mask m saved (backward: dy * m * scale); the native kernel
    (:mod:`megaformer.kernels.native`: mask and product in one pass) where it loads."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float, use_native: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.native = use_native
        if ctx.native:
            y, m, scale = native.dropout_forward(x, p)
        else:
            m, scale = keep_mask(x.shape, p, x.device)
            y = torch.where(m, x, 0.0).mul_(scale)
        ctx.save_for_backward(m)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        (m,) = ctx.saved_tensors
        if ctx.native:
            return native.masked_scale(dy, m, ctx.scale), None, None
        return torch.where(m, dy, 0.0).mul_(ctx.scale), None, None


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout with drop probability ``p`` (identity when not training or p = 0)."""
    if not training or p == 0.0:
        return x
    impl = choose_for("dropout", x).impl
    if impl == "torch" or not 0.0 < p < 1.0 or not x.is_floating_point():
        return F.dropout(x, p, training=True)
    return _MaskedScale.apply(x, p, impl == "native" and x.dtype == torch.float32)


class Dropout(nn.Dropout):
    """nn.Dropout (same p, same train/eval switch) through :func:`dropout`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
