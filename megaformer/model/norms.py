"""Normalisation layers.

    LayerNorm(x) = (x - mean(x)) / sqrt(var(x) + eps) * g + b      (Ba et al. 2016; b optional)
    RMSNorm(x)   = x / sqrt(mean(x^2) + eps) * g                     (Zhang & Sennrich 2019)

Both normalise over the last (model) dimension; statistics are computed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from megaformer.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * g, with gain g initialised to 1."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * g + b, computed in fp32; b only when ``bias``."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__(dim, eps=eps, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        y = nn.functional.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)
        return y.to(x.dtype)


def build_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation layer named by ``cfg.norm`` over d_model."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)
    raise ValueError(f"model.norm={cfg.norm!r}: must be layernorm or rmsnorm")
