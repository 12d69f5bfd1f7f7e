"""Multi-head self-attention with grouped-query key/value heads (Vaswani et al. 2017; Ainslie et al. 2023).

    head_i       = Attention(X W^Q_i, X W^K_{g(i)}, X W^V_{g(i)}),   g(i) = i // (h / h_kv)
    MultiHead(X) = Concat(head_1, ..., head_h) W^O
    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k) + M) V,           d_k = d_model / h (or model.head_dim)

h_kv = h is multi-head attention, 1 < h_kv < h grouped-query, h_kv = 1 multi-query. The causal mask M
hides future positions (and, with a sliding window W, positions W or more back: Mistral). With
rotary positions, q and k are rotated before the product; with ``qk_norm`` each head's q and k are
first RMS-normalised over their d_k dimensions (Qwen3: q_i = RMSNorm(X W^Q_i), one gain vector
shared by all heads). The q/k/v projections may carry biases while the other linears do not
(``qkv_bias``, Qwen2). The number of local heads is read from the projection width
(``view(B, T, -1, d_k)``), so a tensor-parallel plan can shard wq/wk/wv by columns and wo by rows
without this file knowing the degree. q, k and v come from one GEMM over the concatenated weights
(:func:`megaformer.model.linear.fused_projections`).

The core softmax(Q K^T / sqrt(d_k) + M) V is a child module, ``Attention.core``
(:class:`AttentionCore`: the kernel table's attention backend on this process's tensors). What
runs around it is swapped in from outside and shows in ``print(model)``: a tensor-parallel plan's
per-rank dropout stream, recomputation (:mod:`megaformer.parallel.recompute`), context
parallelism (:mod:`megaformer.parallel.context`: ring or all-to-all over the whole sequence),
the diagnostics' probe. Every core takes the same call: ``core(q, k, v, causal=, dropout_p=,
backend=, doc_ids=, window=)``.

``positions`` (the tokens' absolute positions, default start_pos..start_pos+T-1) select the
rotary tables when none are passed in: under context parallelism x holds this rank's part of
each sequence, at its tokens' global positions.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.kernels.attention import DocumentMask, attention
from megaformer.model.linear import Linear, fused_projections
from megaformer.model.norms import RMSNorm
from megaformer.model.positions import RotaryEmbedding, apply_rotary


class LayerKVCache:
    """Keys and values of one layer for positions [0, max_len): k, v of shape [B, h_kv, max_len, d_k].

    Storage is allocated at the first write, with the batch size, device and dtype of the keys
    (so it follows autocast and the model's placement without being told).
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None

    def update(
        self, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, h_kv, T, d_k] at positions start_pos.. and return keys/values [0, start_pos + T)."""
        end = start_pos + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions; cannot write up to {end}")
        if self.k is None or self.k.shape[0] != k.shape[0] or self.k.dtype != k.dtype:
            if start_pos != 0:
                raise ValueError(
                    "KV cache is empty (or for another batch/dtype): start at position 0"
                )
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.k = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.k[:, :, start_pos:end] = k
        self.v[:, :, start_pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """Per-layer key/value caches for incremental decoding (``layers[i]`` belongs to block i);
    ``layer_cache(max_len)`` makes one layer's (multi-head latent attention caches latents)."""

    def __init__(
        self, n_layers: int, max_len: int, layer_cache: Optional[Callable[[int], Any]] = None
    ) -> None:
        self.max_len = max_len
        make = layer_cache or LayerKVCache
        self.layers = [make(max_len) for _ in range(n_layers)]


class AttentionCore(nn.Module):
    """softmax(Q K^T * scale + M) V for q [B, h, T, d_k], k, v [B, h_kv, S, d_k] -> [B, h, T, d_k],
    by the implementation the kernel table picks for ``backend`` (:func:`megaformer.kernels.
    attention.attention`). No parameters."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        dropout_p: float = 0.0,
        backend: str = "auto",
        doc_ids: Optional[DocumentMask] = None,
        window: Optional[int] = None,
    ) -> torch.Tensor:
        return attention(
            q,
            k,
            v,
            causal=causal,
            dropout_p=dropout_p,
            backend=backend,
            doc_ids=doc_ids,
            window=window,
        )


class Attention(nn.Module):
    """MultiHead(X) = Concat(head_1..head_h) W^O with GQA key/value sharing; see the module docstring."""

    def __init__(self, cfg: ModelConfig, causal: bool = True) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.causal = causal
        self.attention_dropout = cfg.attention_dropout
        self.backend = cfg.attention_backend
        self.window = cfg.sliding_window
        d, dk = cfg.d_model, cfg.head_dim
        self.wq = Linear(d, cfg.n_heads * dk, bias=cfg.attn_bias)
        self.wk = Linear(d, cfg.kv_heads * dk, bias=cfg.attn_bias)
        self.wv = Linear(d, cfg.kv_heads * dk, bias=cfg.attn_bias)
        self.wo = Linear(cfg.n_heads * dk, d, bias=cfg.bias)
        if cfg.qk_norm:  # one gain over d_k, shared by the heads (replicated under TP)
            self.q_norm = RMSNorm(dk, eps=cfg.norm_eps)
            self.k_norm = RMSNorm(dk, eps=cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = (
            RotaryEmbedding(dk, cfg.rotary_fraction, cfg.rope_theta, cfg.rope_scaling)
            if cfg.position == "rope"
            else None
        )
        self.core: nn.Module = AttentionCore()  # softmax(QK^T/sqrt(d_k))V; swapped from outside

    def forward(
        self,
        x: torch.Tensor,
        rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        cache: Optional[LayerKVCache] = None,
        start_pos: int = 0,
        doc_ids: Optional[DocumentMask] = None,
        positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x [B, T, d_model] at absolute positions start_pos..start_pos+T-1 (or ``positions``
        [T]) -> [B, T, d_model].

        rope: precomputed (cos, sin) for those positions (looked up here when None and position=rope).
        cache: this layer's KV cache; keys/values of earlier positions are read from it.
        doc_ids: the batch's document boundaries (packed documents attend only within).
        """
        q, k, v = fused_projections(x, (self.wq, self.wk, self.wv))
        if self.rotary is not None:
            # q and k are replaced by their rotations below; a view of v kept for backward would
            # keep the whole [q | k | v] product alive, so v gets its own storage
            v = v.contiguous()
        B, T = q.shape[:2]  # a sequence-parallel projection returns the whole sequence
        q = q.view(B, T, -1, self.head_dim)  # [B, T, h, d_k]
        k = k.view(B, T, -1, self.head_dim)  # [B, T, h_kv, d_k]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, h, T, d_k], [B, h_kv, T, d_k]
        v = v.view(B, T, -1, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            if rope is None and positions is not None:
                with torch.no_grad():
                    rope = self.rotary(positions)
            elif rope is None:
                rope = self.rotary.tables(start_pos, T, x.device)
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(start_pos, k, v)
        p = self.attention_dropout if self.training else 0.0
        y = self.core(
            q,
            k,
            v,
            causal=self.causal,
            dropout_p=p,
            backend=self.backend,
            doc_ids=doc_ids,
            window=self.window,
        )
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))
