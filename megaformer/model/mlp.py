"""Position-wise feed-forward network.

    GELU:   FFN(x) = GELU(x W1 + b1) W2 + b2                 (Vaswani et al. 2017 with GELU, GPT-2)
    SwiGLU: FFN(x) = (SiLU(x W1) * (x W3)) W2                 (Shazeer 2020; Llama)

W1: d_model -> d_ffn (SwiGLU: the gate), W3: d_model -> d_ffn (the up projection), W2: d_ffn -> d_model.
The SwiGLU gate and up projections are one GEMM (``fused_projections``). The activations
(SiLU(g) * u; GELU(h + b1)) run as fused Triton kernels on CUDA (``megaformer.kernels.activations``;
``model.fused_kernels``); on fp32 CPU in eager mode SwiGLU reads the gate/up product [g | u] as one
tensor (``megaformer.kernels.cpu_eager.PackedSwiGLUFunction``: saves 2F per token instead of 3F, no
concatenation of dg and du in backward); as torch ops elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaformer.config import ModelConfig
from megaformer.kernels.activations import bias_gelu, swiglu
from megaformer.kernels.cpu_eager import PackedSwiGLUFunction, cpu_eager
from megaformer.kernels.gemm import linear
from megaformer.kernels.triton_support import use_triton
from megaformer.model.linear import Linear, fused_product, fused_projections


class MLP(nn.Module):
    """FFN(x) with GELU (w1, w2) or SwiGLU (w1 gate, w3 up, w2 down); d_ffn = cfg.ffn_dim."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.ffn_dim
        # "gelu" is the exact erf form (GPT-NeoX); "gelu_tanh" (GPT-2's tanh approximation) is
        # accepted too, should the config ever offer it.
        if cfg.activation not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"model.activation={cfg.activation!r}: must be gelu or swiglu")
        self.activation = cfg.activation
        self.kernels = cfg.fused_kernels
        self.w1 = Linear(d, f, bias=cfg.bias, kernels=self.kernels)
        if cfg.activation == "swiglu":
            self.w3 = Linear(d, f, bias=cfg.bias, kernels=self.kernels)
        self.w2 = Linear(f, d, bias=cfg.bias, kernels=self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            if cpu_eager(x, self.kernels) and self.w1.weight.shape == self.w3.weight.shape:
                y = fused_product(x, (self.w1, self.w3), self.kernels)  # [gate | up]
                if y is not None:
                    return self.w2(PackedSwiGLUFunction.apply(y))
            gate, up = fused_projections(x, (self.w1, self.w3), self.kernels)
            return self.w2(swiglu(gate, up, self.kernels))
        approximate = "tanh" if self.activation == "gelu_tanh" else "none"
        if self.w1.bias is not None and use_triton(x, self.kernels):
            # x W1 without the bias, then GELU(. + b1) in one pass (w1 may be a column-parallel shard)
            h = bias_gelu(linear(x, self.w1.weight, None, self.kernels), self.w1.bias, approximate,
                          self.kernels)
        else:
            h = F.gelu(self.w1(x), approximate=approximate)
        return self.w2(h)
