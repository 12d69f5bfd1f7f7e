"""The ``model`` section: the decoder-only Transformer and its mixture-of-experts FFN."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megaformer.config.fields import option


@dataclass
class MoEConfig:
    """Mixture-of-Experts FFN (``model.moe``): token-choice top-k routing over E experts.

    Off unless ``interval`` > 0. docs/moe.md explains routing, the load-balancing terms and what
    each parallelism does with the experts."""

    interval: int = option(
        0,
        "An MoE FFN in every n-th block (block i, counting from 0, is MoE when (i + 1) % n == 0; "
        "1 = every block), a dense FFN elsewhere; 0 = no MoE (a dense model).",
    )
    num_experts: int = option(8, "Routed experts E per MoE block.")
    top_k: int = option(2, "Experts each token is routed to (1..8, at most num_experts).")
    score: Literal["softmax", "sigmoid"] = option(
        "softmax",
        "Router score s = softmax(logits) over the experts (Switch, Mixtral, Qwen-MoE) or "
        "sigmoid(logits) per expert (DeepSeek-V3).",
    )
    renormalize: bool = option(
        True,
        "Divide the k selected scores by their sum, so each token's expert weights sum to 1 "
        "(Mixtral, Qwen3-MoE norm_topk_prob, DeepSeek-V3).",
    )
    d_expert: Optional[int] = option(
        None,
        "Hidden width of each routed expert's FFN; null = the dense FFN width (model.d_ffn "
        "or its default).",
    )
    num_shared_experts: int = option(
        0,
        "Shared experts every token passes through besides its routed ones (DeepSeek-style); "
        "they run as one FFN of num_shared_experts * d_shared hidden units.",
    )
    d_shared: Optional[int] = option(
        None, "Hidden width of each shared expert; null = model.moe.d_expert."
    )
    shared_gate: bool = option(
        False,
        "Scale the shared experts' output per token by sigmoid(x w_g), w_g a learned [1, "
        "d_model] vector (Qwen2-MoE's shared_expert_gate); needs shared experts.",
    )
    dropless: bool = option(
        True,
        "Every routed token is computed (no capacity limit, nothing dropped; a token's output "
        "does not depend on the other tokens in the batch). false needs "
        "model.moe.capacity_factor.",
    )
    capacity_factor: Optional[float] = option(
        None,
        "With dropless=false: each expert takes at most ceil(capacity_factor * tokens * top_k "
        "/ num_experts) token assignments per micro-batch, first come first served in token "
        "order; the rest are dropped (that expert adds nothing for the token) and counted.",
    )
    aux_loss_coef: float = option(
        0.01,
        "Coefficient alpha of the load-balancing loss alpha * E * sum_e f_e P_e per MoE block "
        "(Switch Transformer / Mixtral; f_e the fraction of the top-k assignments sent to "
        "expert e, P_e its mean router probability; 1 when balanced), added to the training "
        "loss; 0 = off.",
    )
    z_loss_coef: float = option(
        0.0,
        "Coefficient of the router z-loss mean_tokens(logsumexp(logits)^2) per MoE block "
        "(ST-MoE), added to the training loss; 0 = off.",
    )
    bias_update_rate: float = option(
        0.0,
        "Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias b_e is added to "
        "the scores for the top-k selection only (not to the expert weights), and after each "
        "optimizer step b_e += rate * sign(mean load - load_e), the load counted over the "
        "step's tokens on all data-parallel ranks; 0 = no updates (a bias already learned, "
        "or imported with the weights, keeps choosing the experts).",
    )
    num_groups: int = option(
        1,
        "Group-limited routing (DeepSeek-V3's node-limited routing): the experts form this many "
        "equal groups of consecutive ids; each token first keeps the top_groups groups whose "
        "two best scores (plus the bias) sum highest, then picks its top_k experts inside "
        "them. 1 = no groups.",
    )
    top_groups: Optional[int] = option(
        None,
        "Groups each token may route to with num_groups > 1 (DeepSeek-V3: 4 of 8); "
        "null = all of them.",
    )
    routed_scaling_factor: float = option(
        1.0,
        "The routed experts' weights are multiplied by this factor after any renormalisation "
        "(DeepSeek-V3: 2.5).",
    )
    first_dense: int = option(
        0,
        "The first n blocks keep a dense FFN whatever the interval picks (DeepSeek-V3's "
        "first_k_dense_replace: 3).",
    )


@dataclass
class MLAConfig:
    """Multi-head latent attention (``model.attention: mla``; DeepSeek-V2 section 2.1).

    Per token h_t: an optional query latent c^Q = RMSNorm(W^DQ h_t) of q_lora_rank dimensions,
    a key/value latent c^KV = RMSNorm(W^DKV h_t) of kv_lora_rank dimensions and one rotary key
    k^R = RoPE(W^KR h_t) of qk_rope_head_dim dimensions shared by every head; head i's key is
    [W^UK_i c^KV ; k^R] (qk_nope_head_dim + qk_rope_head_dim) and its value W^UV_i c^KV
    (v_head_dim). docs/deepseek.md explains the equations."""

    q_lora_rank: Optional[int] = option(
        None,
        "Width of the query latent c^Q (DeepSeek-V3: 1536); null = queries projected from the "
        "hidden state directly (DeepSeek-V2-Lite).",
    )
    kv_lora_rank: int = option(512, "Width of the key/value latent c^KV (DeepSeek-V3: 512).")
    qk_nope_head_dim: int = option(
        128, "Per-head query/key dimensions without rotary positions (DeepSeek-V3: 128)."
    )
    qk_rope_head_dim: int = option(
        64,
        "Per-head query dimensions rotated by RoPE, and the width of the rotary key shared by "
        "all heads (DeepSeek-V3: 64).",
    )
    v_head_dim: int = option(128, "Per-head value width (DeepSeek-V3: 128).")


@dataclass
class ModelKeys:
    """The ``model`` keys as declared: what a YAML file sets and the reference documents.
    :class:`ModelConfig` adds the widths derived from them."""

    vocab_size: Optional[int] = option(
        None, "Vocabulary size of the embedding and output layer; null takes it from the tokenizer."
    )
    d_model: int = option(256, "Width of the residual stream (d_model).")
    n_layers: int = option(4, "Number of Transformer blocks.")
    n_heads: int = option(4, "Attention heads h; each has d_k = d_model / h (or model.head_dim).")
    n_kv_heads: Optional[int] = option(
        None, "Key/value heads for grouped-query attention; null = n_heads (MHA), 1 = MQA."
    )
    d_ffn: Optional[int] = option(
        None,
        "Hidden width of the FFN; null = 4*d_model for gelu, and 2/3 of that rounded up to a "
        "multiple of 64 for swiglu (same parameter count, Llama's convention).",
    )
    head_dim: Optional[int] = option(
        None,
        "Width d_k of each attention head; null = d_model / n_heads. Set where a model's "
        "heads are wider or narrower than that (Qwen3: n_heads * head_dim != d_model).",
    )
    max_seq_len: int = option(
        256, "Longest sequence the model accepts (size of the position table)."
    )
    position: Literal["sinusoidal", "learned", "rope", "none"] = option(
        "rope", "Positional encoding."
    )
    rope_theta: float = option(10000.0, "Base theta of rotary embeddings.")
    rope_scaling: Optional[dict] = option(
        None,
        "Scaled rotary frequencies for a longer context, as transformers computes them: "
        "null (unscaled), {rope_type: llama3, factor, low_freq_factor, high_freq_factor, "
        "original_max_position_embeddings} (Llama 3.1+), or {rope_type: yarn, factor, "
        "original_max_position_embeddings, and optionally beta_fast, beta_slow, mscale, "
        "mscale_all_dim, attention_factor, truncate} (YaRN, whose attention factor scales "
        "cos and sin). docs/checkpoints.md explains the keys.",
    )
    rotary_fraction: float = option(
        1.0,
        "Fraction of each head's dimensions that rotary embeddings rotate (GPT-NeoX uses 0.25).",
    )
    norm: Literal["layernorm", "rmsnorm"] = option("rmsnorm", "Normalisation layer.")
    norm_eps: float = option(1e-5, "Epsilon of the normalisation layers.")
    activation: Literal["gelu", "gelu_tanh", "swiglu"] = option(
        "swiglu",
        "FFN form: gelu (exact erf GELU, two matrices), gelu_tanh (GPT-2's tanh "
        "approximation) or swiglu (three matrices).",
    )
    residual: Literal["sequential", "parallel"] = option(
        "sequential",
        "Pre-norm residual form: sequential (x += attn(ln(x)); x += mlp(ln(x))) or "
        "parallel (x += attn(ln1(x)) + mlp(ln2(x))).",
    )
    tie_embeddings: bool = option(True, "Share the token embedding with the output layer.")
    bias: bool = option(False, "Biases in the linear layers (and LayerNorm).")
    qkv_bias: Optional[bool] = option(
        None,
        "Biases in the query/key/value projections; null = model.bias (Qwen2: true with "
        "model.bias false).",
    )
    qk_norm: bool = option(
        False,
        "RMSNorm over each head's d_k dimensions of the queries and keys, before rotary "
        "embeddings (Qwen3).",
    )
    sliding_window: Optional[int] = option(
        None,
        "Each token attends to at most this many most recent positions, itself included "
        "(Mistral 7B v0.1: 4096); null = the whole causal context. flash-attn's window_size "
        "on CUDA, a banded mask elsewhere (the native CPU attention kernel is not used).",
    )
    dropout: float = option(0.0, "Dropout on embeddings and on each residual write.")
    attention_dropout: float = option(0.0, "Dropout on the attention probabilities.")
    init_std: float = option(
        0.02,
        "Std of the normal initialisation; residual-output projections "
        "use init_std / sqrt(2 * n_layers).",
    )
    attention_backend: Literal["auto", "flash", "sdpa", "reference"] = option(
        "auto",
        "Attention kernel: auto (flash-attn on CUDA fp16/bf16; megaformer's native CPU "
        "FlashAttention-2 kernel on fp32 CPU in eager mode without attention dropout, "
        "document mask or sliding window, head_dim a multiple of 16; else torch SDPA, whose own backend "
        "choice MEGAFORMER_SDPA_BACKENDS can override), or force one.",
    )
    kernels: Literal["auto", "torch"] = option(
        "auto",
        "Which implementation runs each op (norms, activations, rotary embeddings, "
        "cross-entropy, dropout, GEMMs): auto, the fastest that runs here (Triton, apex, "
        "oneDNN, megaformer's native CPU kernels); torch, plain torch ops everywhere "
        "(model.attention_backend chooses attention's). The trainer logs which one runs "
        "per op; docs/kernels.md lists them. Formerly model.fused_kernels.",
    )
    loss_chunk_tokens: int = option(
        0,
        "0 = logits then cross-entropy (materialises [tokens, vocab] fp32 logits); N > 0 = the "
        "output projection fused with the cross-entropy over N tokens at a time (its gradients "
        "computed chunk by chunk in forward), so only [N, vocab] logits exist at once (vocab-parallel under TP; "
        "on the last pipeline stage under parallel.pipeline > 1).",
    )
    document_mask: bool = option(
        False,
        "Packed documents do not attend to each other: a token attends only to earlier tokens "
        "of its own document (documents end at the tokenizer's EOD token). Varlen flash-attn "
        "on CUDA when installed, else a block-diagonal causal mask (SDPA/reference). Under "
        "parallel.pipeline > 1 the stages pass the token ids on and rebuild the mask.",
    )
    init_from: Optional[str] = option(
        None,
        "A Hugging Face model folder (safetensors, a config.json of a class megaformer "
        "convert reads) to start training from, read without a converted copy: its "
        "config.json gives every key that shapes the weights, each rank reads only its "
        "shards; null = initialise from train.seed. Ignored when the run directory holds "
        "a checkpoint (it resumes). megaformer train CONFIG --init-from DIR sets it.",
    )
    mtp_depth: int = option(
        0,
        "Multi-token prediction (DeepSeek-V3): this many extra modules after the blocks, module "
        "k predicting the token k + 1 ahead from module k - 1's output and the embedding of the "
        "token k ahead (one block each, sharing the embedding and the output head); training "
        "only: evaluation, generation and export use the main model. 0 = off.",
    )
    mtp_loss_coef: float = option(
        0.3,
        "Weight lambda of the multi-token prediction loss lambda / D * sum_k L_k added to the "
        "training loss (DeepSeek-V3: 0.3, then 0.1); logged apart as mtp/loss.",
    )
    attention: Literal["mha", "mla"] = option(
        "mha",
        "Attention form: mha (multi-head attention, grouped-query with model.n_kv_heads) or mla "
        "(multi-head latent attention, DeepSeek-V2/V3: keys and values from one compressed "
        "latent, see the model.mla.* keys; model.head_dim and model.n_kv_heads are not used).",
    )
    mla: MLAConfig = option(
        None, "Multi-head latent attention: see the model.mla.* keys.", factory=MLAConfig
    )
    moe: MoEConfig = option(
        None, "Mixture-of-Experts FFN: see the model.moe.* keys.", factory=MoEConfig
    )


class ModelConfig(ModelKeys):
    """The decoder-only Transformer (Vaswani et al. 2017 and its modern descendants): the
    declared keys (:class:`ModelKeys`) and the widths derived from them."""

    @property
    def head_dim(self) -> int:
        """d_k: ``model.head_dim`` when set, else d_model / n_heads.

        The configured value (null stays null) is kept in the instance's ``__dict__``, so
        ``ModelConfig(**cfg.__dict__)`` and :meth:`configured_head_dim` reproduce the config."""
        explicit = self.configured_head_dim
        return explicit if explicit is not None else self.d_model // self.n_heads

    @head_dim.setter
    def head_dim(self, value: Optional[int]) -> None:
        self.__dict__["head_dim"] = value

    @property
    def configured_head_dim(self) -> Optional[int]:
        """``model.head_dim`` as configured (None: derived from d_model / n_heads)."""
        return self.__dict__.get("head_dim")

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's queries and keys: d_k, or under MLA qk_nope + qk_rope."""
        if self.attention == "mla":
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        """Width of one head's values: d_k, or under MLA ``model.mla.v_head_dim``."""
        return self.mla.v_head_dim if self.attention == "mla" else self.head_dim

    @property
    def rope_dim(self) -> int:
        """Dimensions per head the rotary tables cover: under MLA the shared rotary part."""
        return self.mla.qk_rope_head_dim if self.attention == "mla" else self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def attn_bias(self) -> bool:
        """Whether the q/k/v projections have biases (``qkv_bias``, else ``bias``)."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def ffn_dim(self) -> int:
        if self.d_ffn is not None:
            return self.d_ffn
        if self.activation == "swiglu":
            return 64 * math.ceil(2 * 4 * self.d_model / 3 / 64)
        return 4 * self.d_model

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` (from 0) has an MoE FFN (``model.moe.interval``, after the first
        ``model.moe.first_dense`` blocks)."""
        n = self.moe.interval
        return n > 0 and (i + 1) % n == 0 and i >= self.moe.first_dense

    @property
    def moe_layers(self) -> int:
        """How many blocks have an MoE FFN."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def expert_dim(self) -> int:
        """Hidden width of one routed expert (``model.moe.d_expert``, else the dense FFN's)."""
        return self.moe.d_expert if self.moe.d_expert is not None else self.ffn_dim

    @property
    def shared_dim(self) -> int:
        """Total hidden width of the shared experts (0 without them)."""
        per = self.moe.d_shared if self.moe.d_shared is not None else self.expert_dim
        return self.moe.num_shared_experts * per


ROPE_SCALING_KEYS = {
    "llama3": (
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
        set(),
    ),
    "yarn": (
        {"factor", "original_max_position_embeddings"},
        {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"},
    ),
}
