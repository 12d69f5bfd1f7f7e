"""One pre-norm Transformer block writing additively onto the residual stream.

Attn is multi-head attention (:mod:`.attention`) or multi-head latent attention (:mod:`.mla`,
``model.attention: mla``); MLP is the dense FFN, or in an MoE block (``model.moe``) the Mixture-of-Experts FFN.

    sequential:  h   = x + Dropout(Attn(Norm_a(x)))
                 out = h + Dropout(MLP(Norm_m(h)))
    parallel:    out = x + Dropout(Attn(Norm_a(x))) + Dropout(MLP(Norm_m(x)))     (GPT-J / GPT-NeoX)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.kernels.attention import DocumentMask
from megaformer.kernels.dropout import Dropout
from megaformer.model.attention import Attention, LayerKVCache
from megaformer.model.mla import LatentAttention, LatentKVCache
from megaformer.model.mlp import MLP
from megaformer.model.moe import MoE
from megaformer.model.norms import build_norm


class Block(nn.Module):
    """Pre-norm block: attn_norm -> attn, mlp_norm -> mlp, sequential or parallel residual."""

    def __init__(self, cfg: ModelConfig, causal: bool = True, layer: int = 0) -> None:
        super().__init__()
        if cfg.residual not in ("sequential", "parallel"):
            raise ValueError(f"model.residual={cfg.residual!r}: must be sequential or parallel")
        self.parallel = cfg.residual == "parallel"
        self.attn_norm = build_norm(cfg)
        # multi-head (grouped-query) attention, or multi-head latent attention (model.attention)
        self.attn = (
            LatentAttention(cfg, causal=causal)
            if cfg.attention == "mla"
            else Attention(cfg, causal=causal)
        )
        self.mlp_norm = build_norm(cfg)
        # the FFN: dense, or a Mixture of Experts in the blocks model.moe.interval picks
        self.mlp = MoE(cfg, layer) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.drop = Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[LayerKVCache | LatentKVCache] = None,
        start_pos: int = 0,
        doc_ids: Optional[DocumentMask] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]; ``positions``: the tokens' absolute positions when ``rope``
        is not given (default start_pos..start_pos+T-1)."""
        a = self.drop(
            self.attn(
                self.attn_norm(x),
                rope=rope,
                cache=cache,
                start_pos=start_pos,
                doc_ids=doc_ids,
                positions=positions,
            )
        )
        if self.parallel:
            return x + a + self.drop(self.mlp(self.mlp_norm(x)))
        h = x + a
        return h + self.drop(self.mlp(self.mlp_norm(h)))


def compile_blocks(blocks: nn.ModuleList, backend: str = "inductor") -> None:
    """torch.compile each block in place (``train.compile``): one graph per block (no graph
    breaks: kernel dispatch is resolved at trace time), the same code reused by every block; the
    first call pays the compilation. Inside the compiled graph inductor fuses the norms and
    activations itself, so the Triton kernels of megaformer.kernels are not called there."""
    from megaformer.kernels.selection import mark_constant_for_compile

    mark_constant_for_compile()
    for block in blocks:
        block.compile(backend=backend)
