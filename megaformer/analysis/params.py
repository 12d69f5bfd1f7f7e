"""Closed-form parameter count of the Transformer, equal to the module's count for every config.

With d = d_model, L = n_layers, h_kv key/value heads of width d_k = d / h, f = ffn_dim, V = vocab,
beta = 1 if biases else 0:

    attention  = d*d + 2*d*(h_kv*d_k) + d*d            + beta*(d + 2*h_kv*d_k + d)        (wq, wk, wv, wo)
    mlp        = gelu: 2*d*f + beta*(f + d);  swiglu: 3*d*f + beta*(2*f + d)
    norm       = d (+ d for a LayerNorm with bias)
    block      = attention + mlp + 2 * norm
    embedding  = V*d  (+ max_seq_len*d for learned positions)  (+ V*d for an untied lm_head)
    total      = embedding + L * block + norm
"""

from __future__ import annotations

from megaformer.config import ModelConfig


def _attention(cfg: ModelConfig) -> int:
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    q_out = cfg.n_heads * cfg.head_dim
    weights = d * q_out + 2 * d * kv + q_out * d
    biases = (q_out + 2 * kv + d) if cfg.bias else 0
    return weights + biases


def _mlp(cfg: ModelConfig) -> int:
    d, f = cfg.d_model, cfg.ffn_dim
    if cfg.activation == "swiglu":
        return 3 * d * f + ((2 * f + d) if cfg.bias else 0)
    return 2 * d * f + ((f + d) if cfg.bias else 0)


def _norm(cfg: ModelConfig) -> int:
    if cfg.norm == "layernorm" and cfg.bias:
        return 2 * cfg.d_model
    return cfg.d_model


def count_parameters(cfg: ModelConfig) -> dict:
    """{'total', 'embedding', 'non_embedding'} parameter counts for ``cfg`` (tied weights once).

    ``embedding`` is the token embedding, learned positions and an untied lm_head.
    """
    if not isinstance(cfg.vocab_size, int) or isinstance(cfg.vocab_size, bool):
        raise ValueError(f"model.vocab_size must be an int to count parameters, got {cfg.vocab_size!r}")
    d, V = cfg.d_model, cfg.vocab_size
    embedding = V * d
    if cfg.position == "learned":
        embedding += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        embedding += V * d
    block = _attention(cfg) + _mlp(cfg) + 2 * _norm(cfg)
    non_embedding = cfg.n_layers * block + _norm(cfg)
    return {"total": embedding + non_embedding, "embedding": embedding, "non_embedding": non_embedding}
