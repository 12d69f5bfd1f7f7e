"""Rotary position embedding (RoPE) applied to queries or keys, one public function over every
implementation.

    RoPE(x, pos) = [x1 cos - x2 sin,  x2 cos + x1 sin,  x[rot:]]

on x [B, H, T, D] with (x1, x2) the two halves of the first ``rot`` dimensions and cos, sin [T, rot]
(halves duplicated, as :class:`megaformer.model.positions.RotaryEmbedding` returns them). Which
implementation runs is decided by :mod:`megaformer.kernels.selection` (op ``rope``): on fp32 CPU
tensors in eager mode the native kernel or fewer-pass torch ops
(:class:`megaformer.kernels.cpu_eager.RotaryFunction`), else the torch formula.
"""

from __future__ import annotations

import torch

from megaformer.kernels.cpu_eager import RotaryFunction
from megaformer.kernels.selection import choose_for


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x_rot cos + rotate_half(x_rot) sin on the first rot = cos.shape[-1] dims, the rest passed."""
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [B, H, T, D] by cos, sin [T, rot] (cast to x's dtype, as Hugging Face does)."""
    full = cos.shape[-1] == x.shape[-1]
    impl = choose_for("rope", x, full=full).impl
    if impl in ("native", "cpu"):
        h = cos.shape[-1] // 2
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return RotaryFunction.apply(x, cos[..., :h], sin[..., :h], impl == "native")
    return rope_reference(x, cos, sin)
