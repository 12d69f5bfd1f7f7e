"""Normalisation layers.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * g + b      (Ba et al. 2016; b optional)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * g                     (Zhang & Sennrich 2019)

Both normalise over the last (model) dimension; statistics are computed in fp32. On CUDA the
forward and backward run as fused kernels (apex, Triton or torch native, see
``megaformer.kernels.norm``; ``model.fused_kernels``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.kernels.norm import layer_norm, rms_norm


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, with gain g initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-5, kernels: str = "auto") -> None:
        super().__init__()
        self.eps = eps
        self.kernels = kernels
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.kernels)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * g + b, computed in fp32; b only when ``bias``."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, kernels: str = "auto") -> None:
        super().__init__(dim, eps=eps, bias=bias)
        self.kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.kernels)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer named by ``cfg.norm`` over d_model."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps, kernels=cfg.fused_kernels)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias, kernels=cfg.fused_kernels)
    raise ValueError(f"model.norm={cfg.norm!r}: must be layernorm or rmsnorm")
