"""Closed-form parameter count of the Transformer, equal to the module's count for every config.

With d = d_model, L = n_layers, h heads and h_kv key/value heads of width d_k (d / h unless
model.head_dim), f = ffn_dim, V = vocab, beta = 1 if biases else 0, beta_qkv = 1 if q/k/v biases:

    attention  = d*(h*d_k) + 2*d*(h_kv*d_k) + (h*d_k)*d
                 + beta_qkv*(h*d_k + 2*h_kv*d_k) + beta*d                                 (wq, wk, wv, wo)
                 + 2*d_k with qk_norm                                                     (q_norm, k_norm)
    mla        = d*r_q + r_q + r_q*h*(d_n + d_r)     (wq_a, q_norm, wq_b; d*h*(d_n + d_r) without r_q)
                 + d*(r_kv + d_r) + r_kv + r_kv*h*(d_n + d_v) + h*d_v*d   (wkv_a, kv_norm, wkv_b, wo)
    mlp        = gelu: 2*d*f + beta*(f + d);  swiglu: 3*d*f + beta*(2*f + d)
    moe mlp    = d*E + E*m*d*f_e + m*d*f_s   (router, E experts of width f_e, shared experts of total
                 width f_s; m = 3 for swiglu, 2 for gelu; no biases) in the MoE blocks
                 (+ d for the shared experts' sigmoid gate, model.moe.shared_gate)
    active     = the same with top_k experts in place of E: what one token's forward multiplies
    norm       = d (+ d for a LayerNorm with bias)
    block      = attention + (mlp or moe mlp) + 2 * norm
    embedding  = V*d  (+ max_seq_len*d for learned positions)  (+ V*d for an untied lm_head)
    total      = embedding + L * block + norm
                 + D * (2*d + 2*d*d + block + norm)   (multi-token prediction, model.mtp_depth = D)
"""

from __future__ import annotations

from megaformer.config import ModelConfig


def attention_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(weights of the projections before the attention core, weights of the output projection)
    of one block: d (h_q + 2 h_kv) and h_q d; under multi-head latent attention the down- and
    up-projections (module docstring) and h d_v d."""
    d, h = cfg.d_model, cfg.n_heads
    if cfg.attention == "mla":
        mla = cfg.mla
        q_out = h * cfg.qk_head_dim
        q = d * q_out if mla.q_lora_rank is None else mla.q_lora_rank * (d + q_out)
        kv = d * (mla.kv_lora_rank + mla.qk_rope_head_dim) + mla.kv_lora_rank * h * (
            mla.qk_nope_head_dim + mla.v_head_dim
        )
        return q + kv, h * mla.v_head_dim * d
    q_out, kv_out = h * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return d * (q_out + 2 * kv_out), q_out * d


def attention_params(cfg: ModelConfig) -> int:
    inputs, out = attention_weights(cfg)
    if cfg.attention == "mla":  # + the latents' norms; no biases
        return inputs + out + (cfg.mla.q_lora_rank or 0) + cfg.mla.kv_lora_rank
    d, kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
    q_out = cfg.n_heads * cfg.head_dim
    biases = ((q_out + 2 * kv) if cfg.attn_bias else 0) + (d if cfg.bias else 0)
    qk_norm = 2 * cfg.head_dim if cfg.qk_norm else 0
    return inputs + out + biases + qk_norm


def mlp_params(cfg: ModelConfig) -> int:
    d, f = cfg.d_model, cfg.ffn_dim
    if cfg.activation == "swiglu":
        return 3 * d * f + ((2 * f + d) if cfg.bias else 0)
    return 2 * d * f + ((f + d) if cfg.bias else 0)


def moe_mlp_params(cfg: ModelConfig, experts: int) -> int:
    """An MoE block's FFN with ``experts`` routed experts counted (all E, or the top_k a token uses)."""
    d, m = cfg.d_model, (3 if cfg.activation == "swiglu" else 2)
    gate = d if cfg.moe.shared_gate else 0
    return (
        d * cfg.moe.num_experts + experts * m * d * cfg.expert_dim + m * d * cfg.shared_dim + gate
    )


def norm_params(cfg: ModelConfig) -> int:
    if cfg.norm == "layernorm" and cfg.bias:
        return 2 * cfg.d_model
    return cfg.d_model


def count_parameters(cfg: ModelConfig) -> dict:
    """{'total', 'embedding', 'non_embedding'} parameter counts for ``cfg`` (tied weights once),
    and for an MoE model 'active': the parameters one token uses (top_k of the E routed experts).

    ``embedding`` is the token embedding, learned positions and an untied lm_head.
    """
    if not isinstance(cfg.vocab_size, int) or isinstance(cfg.vocab_size, bool):
        raise ValueError(
            f"model.vocab_size must be an int to count parameters, got {cfg.vocab_size!r}"
        )
    d, V = cfg.d_model, cfg.vocab_size
    embedding = V * d
    if cfg.position == "learned":
        embedding += cfg.max_seq_len * d
    if not cfg.tie_embeddings:
        embedding += V * d
    block = attention_params(cfg) + mlp_params(cfg) + 2 * norm_params(cfg)
    non_embedding = cfg.n_layers * block + norm_params(cfg)
    # multi-token prediction: per module two RMSNorms, M_k [d, 2d], one block, the head's norm
    mtp_blocks = [cfg.n_layers + k for k in range(cfg.mtp_depth)]
    non_embedding += cfg.mtp_depth * (2 * d + 2 * d * d + block + norm_params(cfg))
    moe = cfg.moe_layers + sum(cfg.is_moe_layer(i) for i in mtp_blocks)
    if moe == 0:
        return {
            "total": embedding + non_embedding,
            "embedding": embedding,
            "non_embedding": non_embedding,
        }
    non_embedding += moe * (moe_mlp_params(cfg, cfg.moe.num_experts) - mlp_params(cfg))
    inactive = moe * (moe_mlp_params(cfg, cfg.moe.num_experts) - moe_mlp_params(cfg, cfg.moe.top_k))
    return {
        "total": embedding + non_embedding,
        "embedding": embedding,
        "non_embedding": non_embedding,
        "active": embedding + non_embedding - inactive,
    }
