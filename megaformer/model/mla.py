"""Multi-head latent attention (DeepSeek-V2, Liu et al. 2024, section 2.1; DeepSeek-V3).

For the hidden state h_t of token t and heads i = 1..n_h (d_n = qk_nope_head_dim, d_r =
qk_rope_head_dim, d_v = v_head_dim, d_c = kv_lora_rank, d_c' = q_lora_rank):

    c^Q_t      = RMSNorm(W^DQ h_t)                                  [d_c']  (or c^Q_t = h_t
                                                                             without q_lora_rank)
    [q^C_t,i ; q^R_t,i] = W^UQ_i c^Q_t,    q^R_t,i <- RoPE(q^R_t,i)  [d_n ; d_r] per head
    [c^KV_t ; k^R_t]    = [W^DKV ; W^KR] h_t,
    c^KV_t     = RMSNorm(c^KV_t),          k^R_t <- RoPE(k^R_t)      [d_c ; d_r], k^R shared
    [k^C_t,i ; v_t,i]   = W^UKV_i c^KV_t                             [d_n ; d_v] per head
    k_t,i      = [k^C_t,i ; k^R_t],        q_t,i = [q^C_t,i ; q^R_t,i]
    o_t,i      = sum_{s <= t} softmax_s(q_t,i . k_s,i * m^2 / sqrt(d_n + d_r)) v_s,i
    u_t        = W^O [o_t,1 ; ... ; o_t,n_h]

m is DeepSeek's YaRN attention scale 0.1 * mscale_all_dim * ln(s) + 1 (1 without YaRN; s the
context factor); it is folded into the queries, so the attention core sees plain q, k, v with
q/k heads of d_n + d_r dimensions and value heads of d_v (:class:`megaformer.model.attention.
AttentionCore`: every backend takes d_v != d_n + d_r; see docs/deepseek.md). The two latent norms
use DeepSeek's epsilon 1e-6.

Parameters (state-dict names): ``wq`` [n_h (d_n + d_r), d] without q LoRA, else ``wq_a``
[d_c', d], ``q_norm`` [d_c'], ``wq_b`` [n_h (d_n + d_r), d_c']; ``wkv_a`` [d_c + d_r, d],
``kv_norm`` [d_c], ``wkv_b`` [n_h (d_n + d_v), d_c]; ``wo`` [d, n_h d_v]. Each head's rows are
contiguous in wq / wq_b / wkv_b, so a tensor-parallel plan splits them by heads (column
parallel) and wo by rows, while wq_a, wkv_a and the norms are replicated; the number of local
heads is read from the projection width.

For generation the cache holds only what the equations need of the past: c^KV_s and the rotated
k^R_s, (d_c + d_r) numbers per token and layer instead of n_h (d_n + d_r + d_v)
(:class:`LatentKVCache`); keys and values are re-expanded by W^UKV at each step.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.kernels.attention import DocumentMask
from megaformer.model.attention import AttentionCore
from megaformer.model.linear import Linear, fused_projections
from megaformer.model.norms import RMSNorm
from megaformer.model.positions import RotaryEmbedding, apply_rotary

LATENT_NORM_EPS = 1e-6  # DeepSeek's, whatever model.norm_eps says


def yarn_softmax_scale(scaling: Optional[dict]) -> float:
    """m^2 with m = 0.1 * mscale_all_dim * ln(s) + 1 under YaRN with mscale_all_dim set (s > 1),
    else 1: DeepSeek's factor on the attention logits."""
    if not scaling or scaling.get("rope_type") != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    s = scaling["factor"]
    m = 1.0 if s <= 1 else 0.1 * scaling["mscale_all_dim"] * math.log(s) + 1.0
    return m * m


class LatentKVCache:
    """The latent c^KV [B, max_len, d_c] and the rotated shared key k^R [B, 1, max_len, d_r] of
    one layer for positions [0, max_len); storage is allocated at the first write, with the
    batch size, device and dtype of the latent."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.latent: Optional[torch.Tensor] = None
        self.k_rope: Optional[torch.Tensor] = None

    def update(
        self, start_pos: int, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store latent [B, T, d_c], k_rope [B, 1, T, d_r] at positions start_pos.. and return
        both for positions [0, start_pos + T)."""
        end = start_pos + latent.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot write up to {end}")
        B = latent.shape[0]
        if self.latent is None or self.latent.shape[0] != B or self.latent.dtype != latent.dtype:
            if start_pos != 0:
                raise ValueError(
                    "KV cache is empty (or for another batch/dtype): start at position 0"
                )
            self.latent = latent.new_zeros(B, self.max_len, latent.shape[2])
            self.k_rope = k_rope.new_zeros(B, 1, self.max_len, k_rope.shape[3])
        assert self.k_rope is not None
        self.latent[:, start_pos:end] = latent
        self.k_rope[:, :, start_pos:end] = k_rope
        return self.latent[:, :end], self.k_rope[:, :, :end]


class LatentAttention(nn.Module):
    """Multi-head latent attention; the equations are in the module docstring. The same call as
    :class:`megaformer.model.attention.Attention`: x [B, T, d] -> [B, T, d]."""

    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        mla, d, h = cfg.mla, cfg.d_model, cfg.n_heads
        self.causal = causal
        self.attention_dropout = cfg.attention_dropout
        self.backend = cfg.attention_backend
        self.nope_dim, self.rope_dim, self.v_dim = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.v_head_dim,
        )
        self.latent_dim = mla.kv_lora_rank
        qk = self.nope_dim + self.rope_dim
        if mla.q_lora_rank is None:
            self.wq: Optional[Linear] = Linear(d, h * qk, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = Linear(d, mla.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(mla.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = Linear(mla.q_lora_rank, h * qk, bias=False)
        self.wkv_a = Linear(d, self.latent_dim + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.latent_dim, eps=LATENT_NORM_EPS)
        self.wkv_b = Linear(self.latent_dim, h * (self.nope_dim + self.v_dim), bias=False)
        self.wo = Linear(h * self.v_dim, d, bias=False)
        self.rotary = RotaryEmbedding(self.rope_dim, 1.0, cfg.rope_theta, cfg.rope_scaling)
        self.softmax_scale = yarn_softmax_scale(cfg.rope_scaling)  # m^2
        self.core: nn.Module = (
            AttentionCore()
        )  # softmax(QK^T/sqrt(d_n + d_r))V; swapped from outside

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[LatentKVCache] = None,
        start_pos: int = 0,
        doc_ids: Optional[DocumentMask] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [B, T, d_model] at positions start_pos.. (or ``positions`` [T]) -> [B, T, d_model];
        ``rope``: the (cos, sin) of those positions over d_r dimensions (looked up when None)."""
        B, T = x.shape[:2]
        # c^Q (or the queries themselves) and [c^KV ; k^R]: one GEMM over the shared input
        if self.wq is not None:
            q, kv = fused_projections(x, (self.wq, self.wkv_a))
        else:
            c_q, kv = fused_projections(x, (self.wq_a, self.wkv_a))
            q = self.wq_b(self.q_norm(c_q))
        q = q.view(B, T, -1, self.nope_dim + self.rope_dim).transpose(1, 2)  # [B, h, T, d_n+d_r]
        q_nope, q_rope = q.split((self.nope_dim, self.rope_dim), dim=-1)
        latent, k_rope = kv.split((self.latent_dim, self.rope_dim), dim=-1)
        latent = self.kv_norm(latent)  # c^KV [B, T, d_c]
        k_rope = k_rope.unsqueeze(1)  # k^R [B, 1, T, d_r], shared by the heads
        if rope is None and positions is not None:
            with torch.no_grad():
                rope = self.rotary(positions)
        elif rope is None:
            rope = self.rotary.tables(start_pos, T, x.device)
        q_rope, k_rope = apply_rotary(q_rope, *rope), apply_rotary(k_rope, *rope)
        if cache is not None:
            latent, k_rope = cache.update(start_pos, latent, k_rope)
        S = latent.shape[1]
        kv = self.wkv_b(latent).view(B, S, -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split((self.nope_dim, self.v_dim), dim=-1)  # [B, h, S, d_n], [B, h, S, d_v]
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.softmax_scale != 1.0:
            q = q * self.softmax_scale
        p = self.attention_dropout if self.training else 0.0
        y = self.core(
            q,
            k,
            v.contiguous(),
            causal=self.causal,
            dropout_p=p,
            backend=self.backend,
            doc_ids=doc_ids,
            window=None,
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def extra_repr(self) -> str:
        return (
            f"qk_nope={self.nope_dim}, qk_rope={self.rope_dim}, v={self.v_dim}, "
            f"kv_lora_rank={self.latent_dim}"
        )
