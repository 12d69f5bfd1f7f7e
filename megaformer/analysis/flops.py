"""Exact matmul FLOPs of one training step of the decoder-only Transformer.

Convention (that of every published MFU formula): a multiply-add is 2 FLOPs and only matrix
products are counted. Norms, activations, softmax, RoPE, residual and bias adds, dropout, the
embedding lookup and the loss are elementwise (O(s*h) per layer against O(s*h^2)) and excluded.

Forward FLOPs of one sequence of s tokens, with d = d_model, h_q = n_heads * d_k, h_kv = kv_heads * d_k,
f = d_ffn, V = vocabulary rows of the output layer, L = n_layers:

    q, k, v     2*s*d*h_q + 2 * 2*s*d*h_kv                    (GQA/MQA: h_kv < h_q)
    out proj    2*s*h_q*d
    scores      2*P*h_q        Q K^T,  P = s(s+1)/2 query-key pairs if causal, s^2 if not
    values      2*P*h_q        softmax(.) V

Multi-head latent attention (``model.attention: mla``): q, k, v is 2*s times the weights of its
down- and up-projections (:func:`megaformer.analysis.params.attention_weights`), scores
2*P*h*(d_n + d_r), values 2*P*h*d_v, out proj 2*s*h*d_v*d.
    mlp         gelu: 2 * 2*s*d*f;   swiglu: 3 * 2*s*d*f        (three matrices)
    logits      2*s*d*V

    forward = L * (q,k,v + out + scores + values + mlp) + logits (+ mtp)

Multi-token prediction (``model.mtp_depth`` = D): module k on the s - k tokens it predicts for,
its projection [2d -> d], one block and the shared output head (:func:`mtp_flops`).

Mixture of Experts (``model.moe``): FLOPs count the ACTIVE parameters, what each token multiplies:
an MoE block's mlp term is its router 2*s*d*E plus top_k routed experts and the shared experts,

    moe mlp     2*s*d*E + m * 2*s*d*(k*f_e + f_s)               (m = 3 swiglu, 2 gelu)

so MFU compares a sparse model with the dense model of its active size. Dropped tokens (a capacity
factor) are not subtracted: MFU counts the work the model asks for. Parameter and memory counts
(:mod:`.params`, :mod:`.memory`) use the TOTAL parameters.

Backward = 2 x forward, exactly: every product Y = X W needs dX = dY W^T and dW = X^T dY (the first
layer's dX too, because the embedding is trained; scores and values need both operands' gradients).

Recomputation adds forward work that the *hardware* executes but the *model* does not need:

    none        0
    selective   L * (scores + values)                         (Korthikanti et al. 2022: the attention core)
    full        n_ckpt * per-layer forward, n_ckpt = ceil(L / recompute_every) checkpointed blocks
                (blocks i with i % recompute_every == 0; the output layer is never recomputed)

    model FLOPs    = 3 * forward                 -> MFU  (Chowdhery et al. 2022, PaLM, appendix B)
    hardware FLOPs = 3 * forward + recompute     -> HFU

Vocabulary: model FLOPs use the real vocabulary V (the padding rows are not useful work; PaLM's and
the MFU convention); hardware FLOPs use the padded table (``padded_vocab``, what the GPU multiplies;
Megatron-LM's reported TFLOPs count the padded vocabulary too).

Causal attention: by default only the s(s+1)/2 visible query-key pairs are counted (what a causal
FlashAttention kernel computes). ``causal=False`` counts all s^2, the convention of the closed forms:

    Narayanan et al. 2021 (SC21), full recompute:  96 * B*s*L*d^2 * (1 + s/(6d) + V/(16*L*d))
    Korthikanti et al. 2022, no recompute:         72 * B*s*L*d^2 * (1 + s/(6d) + V/(12*L*d))
    PaLM per token (model FLOPs):                  6*N + 12*L*h_q*s,  N = matmul weights incl. logits

(for MHA, GELU, f = 4d, no biases). Note: the *no-recompute* form with V/(16 L d) that is sometimes
quoted scales the logit layer by 3/4 too; the exact count is 6*B*s*d*V = 72*B*s*L*d^2 * V/(12 L d).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from megaformer.analysis.params import attention_weights
from megaformer.config import Config, ModelConfig

RECOMPUTE_MODES = ("none", "selective", "full")


def attention_pairs(seq_len: int, causal: bool = True, window: Optional[int] = None) -> int:
    """Query-key pairs of one head: s(s+1)/2 under a causal mask, s^2 without; with a sliding
    window W < s (causal), W(W+1)/2 + (s - W) W (query i sees min(i + 1, W) keys)."""
    if causal and window is not None and window < seq_len:
        return window * (window + 1) // 2 + (seq_len - window) * window
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def checkpointed_blocks(n_layers: int, every: int = 1) -> int:
    """Blocks recomputed by full recomputation: i in [0, L) with i % every == 0, ceil(L / every)."""
    return math.ceil(n_layers / every)


@dataclass(frozen=True)
class ForwardFlops:
    """Forward matmul FLOPs of one sequence, by component (summed over layers)."""

    qkv: int
    attn_scores: int
    attn_values: int
    attn_out: int
    mlp: int
    logits: int
    mtp: int = 0  # the multi-token prediction modules (model.mtp_depth), their logits included

    @property
    def layers(self) -> int:
        return self.qkv + self.attn_scores + self.attn_values + self.attn_out + self.mlp

    @property
    def total(self) -> int:
        return self.layers + self.logits + self.mtp


def forward_flops(
    cfg: ModelConfig, seq_len: int, causal: bool = True, vocab: Optional[int] = None
) -> ForwardFlops:
    """Forward FLOPs of one sequence of ``seq_len`` tokens; ``vocab`` defaults to cfg.vocab_size."""
    V = cfg.vocab_size if vocab is None else vocab
    if not isinstance(V, int) or isinstance(V, bool):
        raise ValueError(f"model.vocab_size must be an int to count FLOPs, got {V!r}")
    s, d, L = seq_len, cfg.d_model, cfg.n_layers
    attn_in, attn_out = attention_weights(cfg)
    pairs = attention_pairs(s, causal, cfg.sliding_window)
    moe = cfg.moe_layers
    return ForwardFlops(
        qkv=L * 2 * s * attn_in,
        attn_scores=L * 2 * pairs * cfg.n_heads * cfg.qk_head_dim,
        attn_values=L * 2 * pairs * cfg.n_heads * cfg.v_head_dim,
        attn_out=L * 2 * s * attn_out,
        mlp=(L - moe) * _mlp_flops(cfg, s, False) + moe * _mlp_flops(cfg, s, True),
        logits=2 * s * d * V,
        mtp=mtp_flops(cfg, s, causal, V),
    )


def _mlp_flops(cfg: ModelConfig, s: int, moe: bool) -> int:
    """One FFN on s tokens: m 2 s d f dense; 2 s d E + m 2 s d (k f_e + f_s) MoE (router, top_k
    routed experts, shared experts; m = 3 swiglu, 2 gelu)."""
    n_mats, d = (3 if cfg.activation == "swiglu" else 2), cfg.d_model
    if not moe:
        return n_mats * 2 * s * d * cfg.ffn_dim
    return 2 * s * d * (cfg.moe.num_experts + cfg.moe.shared_gate) + n_mats * 2 * s * d * (
        cfg.moe.top_k * cfg.expert_dim + cfg.shared_dim
    )


def mtp_flops(
    cfg: ModelConfig, seq_len: int, causal: bool = True, vocab: Optional[int] = None
) -> int:
    """Forward FLOPs of the multi-token prediction modules on one sequence: module k works on
    s_k = s - k tokens, its projection 2 s_k (2d) d, one block (as block L + k - 1) and the
    shared output head 2 s_k d V."""
    V = cfg.vocab_size if vocab is None else vocab
    d, h = cfg.d_model, cfg.n_heads
    attn_in, attn_out = attention_weights(cfg)
    total = 0
    for k in range(1, cfg.mtp_depth + 1):
        sk = seq_len - k
        if sk < 1:
            break
        pairs = attention_pairs(sk, causal, cfg.sliding_window)
        total += (
            2 * sk * 2 * d * d
            + 2 * sk * (attn_in + attn_out)
            + 2 * pairs * h * (cfg.qk_head_dim + cfg.v_head_dim)
            + _mlp_flops(cfg, sk, cfg.is_moe_layer(cfg.n_layers + k - 1))
            + 2 * sk * d * V
        )
    return total


def recompute_flops(fwd: ForwardFlops, n_layers: int, recompute: str, every: int = 1) -> int:
    """Extra forward FLOPs of one sequence spent recomputing activations in backward."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r}: must be one of {', '.join(RECOMPUTE_MODES)}")
    if recompute == "none":
        return 0
    if recompute == "selective":
        return fwd.attn_scores + fwd.attn_values
    return fwd.layers * checkpointed_blocks(n_layers, every) // n_layers


@dataclass(frozen=True)
class StepFlops:
    """Training FLOPs of one optimizer step of ``tokens`` tokens (all ranks together)."""

    tokens: int
    seq_len: int
    model: int  # 3 x forward, real vocabulary: the numerator of MFU
    hardware: int  # + recomputation, padded vocabulary: the numerator of HFU
    forward: int  # model forward only
    recompute: int  # hardware-only recomputation

    @property
    def model_per_token(self) -> float:
        return self.model / self.tokens

    @property
    def hardware_per_token(self) -> float:
        return self.hardware / self.tokens

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(model_per_token=self.model_per_token, hardware_per_token=self.hardware_per_token)
        return out


def step_flops(
    cfg: ModelConfig,
    seq_len: int,
    sequences: int,
    *,
    causal: bool = True,
    recompute: str = "none",
    recompute_every: int = 1,
    padded_vocab: Optional[int] = None,
) -> StepFlops:
    """Model and hardware FLOPs of a step of ``sequences`` sequences of ``seq_len`` tokens."""
    real = forward_flops(cfg, seq_len, causal)
    padded = forward_flops(cfg, seq_len, causal, padded_vocab) if padded_vocab else real
    extra = recompute_flops(padded, cfg.n_layers, recompute, recompute_every)
    return StepFlops(
        tokens=sequences * seq_len,
        seq_len=seq_len,
        model=3 * real.total * sequences,
        hardware=(3 * padded.total + extra) * sequences,
        forward=real.total * sequences,
        recompute=extra * sequences,
    )


def config_step_flops(cfg: Config, causal: bool = True) -> StepFlops:
    """:func:`step_flops` of one optimizer step of a full config (global batch, recompute mode,
    vocabulary padded as the tensor-parallel plan pads it)."""
    from megaformer.parallel.plan import padded_vocab_size

    p, t = cfg.parallel, cfg.train
    padded = padded_vocab_size(cfg.model.vocab_size, p.tensor, p.vocab_multiple)
    return step_flops(
        cfg.model,
        cfg.seq_len,
        t.global_batch_size,
        causal=causal,
        recompute=t.recompute,
        recompute_every=t.recompute_every,
        padded_vocab=padded,
    )


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights that take part in matrix products per token: all block matrices plus the output
    layer (V*d, tied or not); excludes norms, biases and position tables. PaLM's N in 6N. In
    MoE blocks the active ones: router, top_k routed experts, shared experts."""
    d, f = cfg.d_model, cfg.ffn_dim
    n_mats = 3 if cfg.activation == "swiglu" else 2
    block = sum(attention_weights(cfg)) + n_mats * d * f
    moe = cfg.moe_layers
    moe_mlp = d * (cfg.moe.num_experts + cfg.moe.shared_gate) + n_mats * d * (
        cfg.moe.top_k * cfg.expert_dim + cfg.shared_dim
    )
    return cfg.n_layers * block + moe * (moe_mlp - n_mats * d * f) + cfg.vocab_size * d


# ----------------------------------------------------------------------------- FP8 share


def fp8_forward_flops(cfg: ModelConfig, seq_len: int, routed: bool = True) -> int:
    """Forward FLOPs of one sequence in the GEMMs ``train.fp8`` runs in FP8: q, k, v and the
    attention output of every block, the dense FFNs, the MoE blocks' shared experts and (when
    ``routed``) their routed experts

        fp8 = L * (2 s d (h_q + 2 h_kv) + 2 s h_q d) + (L - L_moe) * m * 2 s d f
              (every projection of multi-head latent attention: its q, k, v and out FLOPs)
              + L_moe * m * 2 s d (f_s + k f_e)                         (m = 3 swiglu, 2 gelu)

    The rest (attention scores and values, router, logits) stays in the training precision."""
    s, d, L, f = seq_len, cfg.d_model, cfg.n_layers, cfg.ffn_dim
    n_mats = 3 if cfg.activation == "swiglu" else 2
    moe = cfg.moe_layers
    experts = (cfg.shared_dim + (cfg.moe.top_k * cfg.expert_dim if routed else 0)) if moe else 0
    return (
        L * 2 * s * sum(attention_weights(cfg))
        + (L - moe) * n_mats * 2 * s * d * f
        + moe * n_mats * 2 * s * d * experts
    )


def fp8_share(cfg: ModelConfig, seq_len: int, causal: bool = True, routed: bool = True) -> float:
    """The fraction of the model FLOPs (forward, hence also of 3 x forward) that run in FP8
    (``routed``: the MoE routed experts among them)."""
    return fp8_forward_flops(cfg, seq_len, routed) / forward_flops(cfg, seq_len, causal).total


def mixed_peak(share: float, fp8_peak: float, hp_peak: float) -> float:
    """The peak of a step whose FLOPs run ``share`` in FP8 and the rest in high precision, each at
    its own dtype's peak: 1 / (share / P_fp8 + (1 - share) / P_hp). What MFU against the bf16
    peak can at most reach is mixed_peak / P_bf16 (> 1 when FP8 pays)."""
    return 1.0 / (share / fp8_peak + (1.0 - share) / hp_peak)


# ----------------------------------------------------------------------------- closed forms


def narayanan_full_recompute(B: int, s: int, L: int, h: int, V: int) -> float:
    """Narayanan et al. 2021 (SC21), eq. (3): 96 B s L h^2 (1 + s/(6h) + V/(16 L h)), full recompute."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def korthikanti_no_recompute(B: int, s: int, L: int, h: int, V: int) -> float:
    """Korthikanti et al. 2022, sec. 6.3: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) model FLOPs."""
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def palm_per_token(N: int, L: int, heads: int, head_dim: int, s: int) -> float:
    """Chowdhery et al. 2022 (PaLM), appendix B: 6N + 12 L H Q T model FLOPs per token."""
    return 6 * N + 12 * L * heads * head_dim * s


# ----------------------------------------------------------------------------- utilisation


def utilisation(
    flops: StepFlops, step_time_s: float, world_size: int, peak_tflops: Optional[float]
) -> dict:
    """tokens/s, TFLOPs per device (model and hardware) and, when a peak is known, MFU and HFU.

    TFLOPs/GPU = model FLOPs per step / step time / world size / 1e12
    MFU        = TFLOPs/GPU / peak;   HFU = hardware TFLOPs/GPU / peak
    """
    model_tf = flops.model / step_time_s / world_size / 1e12
    hw_tf = flops.hardware / step_time_s / world_size / 1e12
    out = {
        "tokens_per_s": flops.tokens / step_time_s,
        "tflops_per_gpu": model_tf,
        "hw_tflops_per_gpu": hw_tf,
    }
    if peak_tflops:
        out.update(mfu=model_tf / peak_tflops, hfu=hw_tf / peak_tflops)
    return out
