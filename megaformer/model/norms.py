"""Normalisation layers.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * g + b      (Ba et al. 2016; b optional)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * g                     (Zhang & Sennrich 2019)

Both normalise over the last (model) dimension; statistics are computed in fp32. Which kernel
computes them is decided by :mod:`megaformer.kernels.norm`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.kernels.norm import layer_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, with gain g initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * g + b, computed in fp32; b only when ``bias``."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(dim, eps=eps, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer named by ``cfg.norm`` over d_model."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    raise ValueError(f"model.norm={cfg.norm!r}: must be layernorm or rmsnorm")
