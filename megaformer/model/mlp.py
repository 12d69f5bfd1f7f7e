"""Position-wise feed-forward network.

    GELU:   FFN(x) = GELU(x W1 + b1) W2 + b2                 (Vaswani et al. 2017 with GELU, GPT-2)
    SwiGLU: FFN(x) = (SiLU(x W1) * (x W3)) W2                 (Shazeer 2020; Llama)

W1: d_model -> d_ffn (SwiGLU: the gate), W3: d_model -> d_ffn (the up projection), W2: d_ffn -> d_model.
Where one GEMM over the concatenated gate and up weights pays (``fused_product``), SwiGLU reads
its packed output [x W1 | x W3] (under FP8: two GEMMs from one cast of x); the activations are :mod:`megaformer.kernels.activations`'
(which decide their own implementation).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaformer.config import ModelConfig
from megaformer.deepspeed_attrs import zero3_partitioned
from megaformer.kernels.activations import linear_gelu, swiglu, swiglu_packed
from megaformer.model.linear import Linear, fused_product, fused_projections


class MLP(nn.Module):
    """FFN(x) with GELU (w1, w2) or SwiGLU (w1 gate, w3 up, w2 down); d_ffn = cfg.ffn_dim unless
    given (an MoE block's shared experts), biases as cfg.bias unless given."""

    def __init__(
        self, cfg: ModelConfig, d_ffn: Optional[int] = None, bias: Optional[bool] = None
    ) -> None:
        super().__init__()
        d, f = cfg.d_model, d_ffn if d_ffn is not None else cfg.ffn_dim
        bias = cfg.bias if bias is None else bias
        # "gelu" is the exact erf form (GPT-NeoX); "gelu_tanh" (GPT-2's tanh approximation) is
        # accepted too, should the config ever offer it.
        if cfg.activation not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"model.activation={cfg.activation!r}: must be gelu or swiglu")
        self.activation = cfg.activation
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"
        self.w1 = Linear(d, f, bias=bias)
        if cfg.activation == "swiglu":
            self.w3 = Linear(d, f, bias=bias)
        self.w2 = Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate_up = fused_product(x, (self.w1, self.w3))  # [x W1 | x W3], or None
            if gate_up is not None:
                return self.w2(swiglu_packed(gate_up))
            return self.w2(swiglu(*fused_projections(x, (self.w1, self.w3))))
        if zero3_partitioned(self.w1.weight):  # ZeRO-3 gathers w1 only inside its own call
            return self.w2(F.gelu(self.w1(x), approximate=self.approximate))
        # GELU(x W1 + b1); w1 may be a column-parallel shard whose input region the plan entered
        return self.w2(linear_gelu(x, self.w1.weight, self.w1.bias, self.approximate))
