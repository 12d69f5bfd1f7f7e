"""Memory per GPU: model states under ZeRO 0-3 and TP/PP/DP, activations per micro-batch.

Model states (Rajbhandari et al. 2020, ZeRO), P = parameters held by one TP x PP rank:

    bytes/param    weights  grads  optimizer (Adam m, v + fp32 master)
    fp32           4        4      8   (+4: DeepSpeed ZeRO >= 1 keeps an fp32 partition copy)
    bf16 / fp16    2        2      12
    Muon (fp32)    4        4      4 per block-matrix parameter (momentum), 8 per other (AdamW)
    ZeRO 1 divides the optimizer states by DP, 2 also the gradients, 3 also the weights.

P per rank: block matrices and vocabulary tables / TP, norms replicated; PP splits the blocks
(ceil(L / PP) on the worst stage), the embedding sits on the first stage, the final norm and the
output layer on the last (both when tied). MoE blocks hold ALL their experts (total parameters,
each expert / TP; the router replicated); the worst stage holds ceil(moe blocks / PP) of them.

Expert parallelism (EP) keeps E / EP experts per rank; ZeRO partitions their states over the DP / EP
ranks that hold the same experts, and the dense states over DP x CP; an MoE block also keeps the
rows it received and their expert-major copy (2 k d per token, balanced routing). Context parallelism (CP) splits
each sequence: a rank keeps the activations of its b*s/CP tokens, plus the attention's exchange
buffers (:func:`context_transient_bytes`).

Activations of one micro-batch of b sequences of s tokens, n = b*s, in elements per layer of this
implementation (e = bytes of the activation dtype; d, h_q, h_kv, f as in flops.py; t = TP):

    norm (each of 2)      input, output = 2d (+ the normalised x = 3d for torch's unfused RMSNorm:
                          model.kernels=torch, or bf16 autocast on CPU)
    attention (fused)     q, k, v, out (= the output projection's input) = 2 h_q + 2 h_kv,
                          + log-sum-exp: a heads in fp32 (FlashAttention / SDPA's fused kernels)
    mlp                   GELU: 2f (pre-activation, activation);  SwiGLU: 4f (gate, silu, up, product),
                          3f on fp32 CPU with kernels=auto (gate, up, product: SiLU recomputed)
    dropout (p > 0)       a 1-byte mask per residual write (2d bytes per layer; dtype-sized with
                          torch's CPU dropout, model.kernels=torch)
    output                final norm + log-probabilities n*V in fp32 (the native CPU loss,
                          megaformer/kernels/native.py: the padded logits n*Vp + one lse per token)
    backward transient    the larger of the output layer's (logits grad + fp32 log-prob grad; the
                          native loss: the logits grad alone) and one MLP's (SwiGLU: d[g | u] + an
                          f-wide temporary = 3f, 2f with the native kernel; GELU: f)

    moe mlp               per token: the k dispatched copies of its input, the expert outputs
                          and the weighted outputs the index-add keeps (3 k d, not divided by
                          TP), k expert FFNs' intermediates (as the MLP's with the expert width,
                          torch ops: SwiGLU 4 f_e, GELU 2 f_e), the shared experts' (as the
                          MLP's), the fp32 router logits, scores and loss-side probabilities
                          and the k weights (3 E + 3 k, 4 bytes each) and three int64 index
                          vectors of k entries (selection, sort order, token of each row)

    TP divides attention and MLP by t; sequence parallelism also divides the norm terms by t.
    full recompute keeps only each checkpointed block's input (d per token), and in backward one
    block's activations are live again; selective recompute keeps q, k, v and the output (the
    output projection needs it), so with fused attention it saves only the log-sum-exp: its gain is
    the s^2 softmax/dropout tensors of a non-fused kernel (Korthikanti's 5as/h term), which the
    fused kernels never store. Pipeline 1F1B: the first stage holds min(PP, micro-batches) micro-
    batches of its L/PP layers in flight; interleaved with v stages per rank: rank 0 holds
    min(2(PP-1) + (v-1) PP + 1, v m) chunks of L/(v PP) layers, (2(PP-1) + (v-1) PP + 1)/v
    micro-batches of its L/PP layers when m > PP (PP = 4, v = 2: 5.5), the embedding on rank 0 and
    the head on rank PP-1 as 1F1B; DualPipeV: every rank PP + 1/2 (:func:`pipeline_in_flight`),
    and rank 0 both the embedding and the head (tied: one table).

Checked against the CPU allocator's measured bytes (:mod:`megaformer.analysis.measure`) in
tests/unit/test_memory.py (MoE blocks: tests/unit/test_moe.py). For reference, Korthikanti et al. 2022 (Megatron, 16-bit, dropout masks,
non-fused softmax) give per layer s*b*h*(34 + 5*a*s/h) bytes, /t with TP+SP, 34*s*b*h/t with
selective recompute, 2*s*b*h with full recompute: :func:`korthikanti_layer_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch

from megaformer.config import ModelConfig, precision_dtype
from megaformer.parallel.topology import Degrees

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Layout:
    """One parallel layout and training setting of a model."""

    # the degrees, in the order of megaformer.parallel.topology.DEGREES
    tp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    dp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: routed experts split over ep of the dp ranks
    zero: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: str = "none"
    recompute_every: int = 1
    sequence_parallel: bool = False
    precision: str = "fp32"
    device: str = "cuda"  # cuda or cpu (which norm and dropout implementations run)
    cp_mode: str = "ring"  # ring or all_to_all
    schedule: str = "1f1b"  # the pipeline schedule (megaformer.analysis.schedules) under pp > 1
    virtual_stages: int = 1  # v, the stages per rank under the interleaved schedule (v >= 2)
    optimizer: str = "adamw"  # train.optimizer: adamw or muon

    @property
    def degrees(self) -> Degrees:
        return Degrees(self.tp, self.cp, self.dp, self.pp, self.ep)

    @property
    def replicas(self) -> int:
        """Ranks holding the same dense shard (DP x CP): ZeRO partitions dense states over them."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (DP / EP x CP): ZeRO partitions expert states over
        them."""
        return self.dp // self.ep * self.cp


# ----------------------------------------------------------------------------- model states


def params_per_rank(cfg: ModelConfig, layout: Layout, padded_vocab: Optional[int] = None) -> int:
    """Parameters held by the busiest TP x PP rank (before ZeRO-3 partitioning)."""
    from megaformer.analysis.params import attention_params, mlp_params, norm_params

    t, V = layout.tp, padded_vocab or cfg.vocab_size
    d = cfg.d_model
    block = (
        (attention_params(cfg) - (d if cfg.bias else 0) + mlp_params(cfg) - (d if cfg.bias else 0))
        // t
        + (2 * d if cfg.bias else 0)
        + 2 * norm_params(cfg)
    )  # row-parallel biases replicated
    layers = math.ceil(cfg.n_layers / layout.pp)
    if (
        cfg.moe_layers
    ):  # the worst stage's MoE blocks: its E / EP experts / TP, the router replicated
        from megaformer.analysis.params import moe_mlp_params

        router = d * cfg.moe.num_experts
        moe_delta = (
            (moe_mlp_params(cfg, cfg.moe.num_experts // layout.ep) - router) // t
            + router
            - (mlp_params(cfg) - (d if cfg.bias else 0)) // t
            - (d if cfg.bias else 0)
        )
        block_sum = layers * block + min(layers, math.ceil(cfg.moe_layers / layout.pp)) * moe_delta
    else:
        block_sum = layers * block
    emb = V * d // t + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
    # one rank holds embedding and head (1F1B and interleaved: rank 0 and rank PP-1)
    both = layout.pp == 1 or layout.schedule == "dualpipev"
    head = norm_params(cfg) + (V * d // t if (not cfg.tie_embeddings or not both) else 0)
    if both:
        return block_sum + emb + head
    return block_sum + max(emb, head)


def expert_params_per_rank(cfg: ModelConfig, layout: Layout) -> int:
    """Routed-expert parameters on the busiest rank: its stage's MoE blocks x E / EP experts / TP.
    They are replicated over DP / EP ranks only (the others hold other experts)."""
    if not cfg.moe_layers:
        return 0
    m = 3 if cfg.activation == "swiglu" else 2
    layers = math.ceil(cfg.n_layers / layout.pp)
    n_moe = min(layers, math.ceil(cfg.moe_layers / layout.pp))
    return (
        n_moe * (cfg.moe.num_experts // layout.ep) * m * cfg.d_model * cfg.expert_dim // layout.tp
    )


def muon_params_per_rank(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters of the busiest rank that Muon updates (the rest take AdamW): the blocks'
    matrices / TP (attention projections, the dense FFN's or the shared and routed experts'),
    not the router, the shared-expert gate, norms, biases, embeddings or the output head."""
    d, t = cfg.d_model, layout.tp
    kv, q = cfg.kv_heads * cfg.head_dim, cfg.n_heads * cfg.head_dim
    m = 3 if cfg.activation == "swiglu" else 2
    layers = math.ceil(cfg.n_layers / layout.pp)
    n_moe = min(layers, math.ceil(cfg.moe_layers / layout.pp)) if cfg.moe_layers else 0
    attention = (2 * d * q + 2 * d * kv) // t
    dense = m * d * cfg.ffn_dim // t
    shared = m * d * cfg.shared_dim // t if cfg.moe_layers else 0
    return (
        layers * attention
        + (layers - n_moe) * dense
        + n_moe * shared
        + expert_params_per_rank(cfg, layout)
    )


def largest_module_params(cfg: ModelConfig, padded_vocab: Optional[int] = None) -> int:
    """Parameters of the largest module the build gives its values whole, before it is split: a
    block (an MoE block with all E experts) or a vocabulary table."""
    from megaformer.analysis.params import attention_params, mlp_params, moe_mlp_params, norm_params

    dense = attention_params(cfg) + 2 * norm_params(cfg)
    block = dense + (
        moe_mlp_params(cfg, cfg.moe.num_experts) if cfg.moe_layers else mlp_params(cfg)
    )
    return max(block, (padded_vocab or cfg.vocab_size) * cfg.d_model)


def build_bytes(cfg: ModelConfig, layout: Layout, padded_vocab: Optional[int] = None) -> float:
    """Peak bytes of building this rank's model (:func:`megaformer.parallel.build.build_model`),
    before the engine allocates gradients and optimizer states.

    The build gives one module at a time its values, whole and in fp32 (M parameters: the largest
    block or vocabulary table), and keeps this rank's part of it: its TP shards, its stage's
    layers and its E / EP experts in fp32 (P, :func:`params_per_rank`), or under ZeRO-3 its
    partition, cast to the training precision (w bytes) first::

        ZeRO 0-2    4 P + 4 M
        ZeRO-3      w ((P - X) / (DP x CP) + X / (DP / EP)) + (4 + w) M     (w = 4 in fp32: 4 M)
    """
    P = params_per_rank(cfg, layout, padded_vocab)
    M = largest_module_params(cfg, padded_vocab)
    if layout.zero < 3:
        return 4.0 * (P + M)
    w = DTYPE_BYTES[layout.precision]
    X = expert_params_per_rank(cfg, layout)
    kept = ((P - X) / layout.replicas + X / layout.expert_replicas) * w
    return kept + (4 + (w if w != 4 else 0)) * M


def state_bytes(cfg: ModelConfig, layout: Layout, padded_vocab: Optional[int] = None) -> dict:
    """{'params', 'weights', 'grads', 'optimizer', 'total'} bytes per rank. ZeRO partitions the
    dense parameters' states over DP x CP and the routed experts' over DP / EP x CP.

    Muon (fp32): the weights are the masters; 4 bytes of momentum per Muon parameter (U), 8 of
    AdamW moments per other one; ZeRO-1/2 give each whole parameter's state to one rank, about
    1/(DP x CP) (experts 1/(DP x CP / EP)) each, and the busiest at least a vocabulary table's AdamW
    moments; gradients stay whole (all-reduced)."""
    P = params_per_rank(cfg, layout, padded_vocab)
    X = expert_params_per_rank(cfg, layout)
    if layout.optimizer == "muon":
        U = muon_params_per_rank(cfg, layout)
        dense, experts = 4 * (U - X) + 8 * (P - U), 4 * X
        if layout.zero >= 1:  # whole parameters per rank: at least the largest one's state
            table = 8 * (padded_vocab or cfg.vocab_size) * cfg.d_model // layout.tp
            dense = max(dense / layout.replicas, float(table))
            experts = experts / layout.expert_replicas
        return {
            "params": P,
            "weights": 4 * P,
            "grads": 4 * P,
            "optimizer": dense + experts,
            "total": 8 * P + dense + experts,
        }
    if layout.precision == "fp32":
        w, g, o = 4, 4, 8 + (4 if layout.zero >= 1 else 0)
    else:
        w, g, o = 2, 2, 12

    def share(bytes_per_param: int, partitioned: bool) -> float:
        if not partitioned:
            return P * bytes_per_param
        return ((P - X) / layout.replicas + X / layout.expert_replicas) * bytes_per_param

    weights, grads, optim = (
        share(w, layout.zero >= 3),
        share(g, layout.zero >= 2),
        share(o, layout.zero >= 1),
    )
    return {
        "params": P,
        "weights": weights,
        "grads": grads,
        "optimizer": optim,
        "total": weights + grads + optim,
    }


# ----------------------------------------------------------------------------- activations


def _plan(cfg: ModelConfig, layout: Layout) -> dict:
    """op -> the implementation that runs for this model and layout (the rule training follows,
    :func:`megaformer.kernels.selection.model_plan`, with this machine's optional packages)."""
    from megaformer.kernels.selection import model_plan

    autocast = layout.precision != "fp32"
    dtype = (
        precision_dtype(layout.precision)
        if layout.device == "cuda" or not autocast
        else torch.float32
    )
    return {op: c.impl for op, c in model_plan(cfg, layout.device, dtype, autocast=autocast)}


def _mask_bytes(layout: Layout, cfg: ModelConfig) -> int:
    """Dropout mask bytes per element: a bool on CUDA and with megaformer's CPU dropout, torch's
    dtype-sized Bernoulli sample otherwise (CPU, plain torch ops)."""
    if layout.device == "cuda" or _plan(cfg, layout).get("dropout", "torch") != "torch":
        return 1
    return DTYPE_BYTES[layout.precision]


def _norm_elems(cfg: ModelConfig, layout: Layout) -> int:
    """Elements per token one norm keeps: its input and its output (read by the next matmul), plus
    the normalised x of the unfused torch RMSNorm (the torch reference implementation)."""
    fused = cfg.norm != "rmsnorm" or _plan(cfg, layout)["rms_norm"] != "torch"
    return 2 * cfg.d_model if fused else 3 * cfg.d_model


def _mla_elems(cfg: ModelConfig, layout: Layout) -> float:
    """Elements per token multi-head latent attention keeps (per TP rank): the down-projections'
    output [c^Q | c^KV | k^R] (the latents' norms keep views of it; without the query latent, the
    fused product's queries too), the normalised latents, q and k (h (d_n + d_r) each), v and the
    output (h d_v each; where the kernel pads the values to the query width, flash-attn and
    native, v and the output at h (d_n + d_r) and the output again at h d_v for W^O; not under
    selective recomputation)."""
    mla, h, t = cfg.mla, cfg.n_heads, layout.tp
    plan = _plan(cfg, layout)
    qk, v = h * cfg.qk_head_dim / t, h * cfg.v_head_dim / t
    latents = (mla.q_lora_rank or 0) + mla.kv_lora_rank
    down = latents + mla.qk_rope_head_dim
    if mla.q_lora_rank is None and plan["projections"] == "fused":
        down += qk
    normed = latents * (2 if plan["rms_norm"] == "torch" else 1)  # + the unfused norm's x / rms
    padded = (
        cfg.v_head_dim < cfg.qk_head_dim
        and plan["attention"] in ("flash", "native")
        and layout.recompute != "selective"  # the recomputed core keeps only its inputs
    )
    values = 2 * qk + v if padded else 2 * v
    return down + normed + 2 * qk + values


def _mlp_elems(cfg: ModelConfig, layout: Layout) -> int:
    """Elements per token the MLP keeps (per TP rank before /t): see the module docstring."""
    f = cfg.ffn_dim
    if cfg.activation != "swiglu":
        return 2 * f
    plan = _plan(cfg, layout)
    packed = plan["projections"] == "fused" and plan["swiglu"] in ("native", "cpu")
    return 3 * f if packed else 4 * f


def _native_cpu(cfg: ModelConfig, layout: Layout) -> bool:
    """The native CPU kernels run: the loss keeps the padded logits and one lse per token, and its
    backward writes only d(logits)."""
    from megaformer.kernels.selection import choose, kernel_mode

    if layout.device != "cpu" or layout.precision != "fp32":
        return False
    with kernel_mode(cfg.kernels):
        return choose("cross_entropy", "cpu", torch.float32, chunked=False).impl == "native"


def _moe_mlp_bytes(cfg: ModelConfig, n: int, layout: Layout, e: int) -> float:
    """Bytes an MoE block's FFN keeps for n tokens (see the module docstring)."""
    k, d, E, t = cfg.moe.top_k, cfg.d_model, cfg.moe.num_experts, layout.tp
    expert = (4 if cfg.activation == "swiglu" else 2) * cfg.expert_dim
    shared = _mlp_elems(cfg, layout) * cfg.shared_dim // cfg.ffn_dim if cfg.shared_dim else 0
    received = (
        2 * k * d * e if layout.ep > 1 else 0
    )  # expert parallelism: received + reordered rows
    return n * (
        3 * k * d * e + received + (k * expert + shared) * e / t + (3 * E + 3 * k) * 4 + 3 * k * 8
    )


def layer_activation_bytes(
    cfg: ModelConfig, seq_len: int, layout: Layout, moe: bool = False
) -> dict:
    """Bytes one block keeps for backward for one micro-batch, by part (fused attention); ``moe``:
    a block with the MoE FFN."""
    e = DTYPE_BYTES[layout.precision]
    n = layout.micro_batch * seq_len // layout.cp  # the tokens of this context rank
    t = layout.tp
    sp = t if layout.sequence_parallel and t > 1 else 1
    d = cfg.d_model
    hq, hkv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_norm = _norm_elems(cfg, layout)
    norms = 2 * per_norm - (d if cfg.residual == "parallel" else 0)  # parallel: one shared input
    lse = n * cfg.n_heads * 4 / t  # fp32 log-sum-exp
    if cfg.attention == "mla":
        core = _mla_elems(cfg, layout) * n * e
    else:
        core = n * (2 * hq + 2 * hkv) * e / t
        core += n * (hq + hkv) * e / t if cfg.qk_norm else 0  # q, k before their norms
    parts = {
        "norms": n * norms * e / sp,
        "attention": core
        + (0 if layout.recompute == "selective" else lse)
        + context_saved_bytes(cfg, seq_len, layout),
        "mlp": _moe_mlp_bytes(cfg, n, layout, e) if moe else n * _mlp_elems(cfg, layout) * e / t,
        "dropout_masks": (2 * n * d * _mask_bytes(layout, cfg) / sp) if cfg.dropout > 0 else 0,
    }
    parts["total"] = sum(parts.values())
    return parts


def pipeline_in_flight(layout: Layout) -> float:
    """Micro-batches whose activations (of this rank's L/PP layers) the busiest rank holds at
    once: min(PP, m) under 1F1B (the first stage); interleaved min(2(PP-1) + (v-1) PP + 1, v m)
    chunks of 1/v of the layers (rank 0); PP + 1/2 under DualPipeV (2 PP + 1 chunks of half the
    layers, on every rank); from the schedule's pass order."""
    if layout.pp == 1:
        return 1.0
    from megaformer.analysis.schedules import simulate

    t = simulate(layout.schedule, layout.pp, layout.grad_accum, v=layout.virtual_stages)
    return max(t.in_flight)


def activation_bytes(
    cfg: ModelConfig, seq_len: int, layout: Layout, padded_vocab: Optional[int] = None
) -> dict:
    """Activation bytes held at the end of a micro-batch's forward on the busiest rank, and the
    extra live during its backward; see the module docstring for the terms."""
    e = DTYPE_BYTES[layout.precision]
    n = layout.micro_batch * seq_len // layout.cp  # the tokens of this context rank
    t = layout.tp
    sp = t if layout.sequence_parallel and t > 1 else 1
    d, V = cfg.d_model, cfg.vocab_size
    layer = layer_activation_bytes(cfg, seq_len, layout)["total"]
    layers = math.ceil(cfg.n_layers / layout.pp)
    n_moe = min(layers, math.ceil(cfg.moe_layers / layout.pp))  # on the busiest stage
    moe_layer = layer_activation_bytes(cfg, seq_len, layout, moe=True)["total"] if n_moe else 0.0
    if layout.recompute == "full":
        ckpt = math.ceil(layers / layout.recompute_every)
        kept = ckpt * n * d * e / sp + (layers - ckpt) * max(layer, moe_layer)
        recompute_live = max(layer, moe_layer)  # one block rebuilt at a time in backward
    else:
        kept, recompute_live = (layers - n_moe) * layer + n_moe * moe_layer, 0.0
    in_flight = pipeline_in_flight(layout)
    per_norm = _norm_elems(cfg, layout)
    rot = (
        (cfg.rope_dim if cfg.attention == "mla" else int(cfg.head_dim * cfg.rotary_fraction))
        if cfg.position == "rope"
        else 0
    )
    Vp = padded_vocab or V
    native_loss = _native_cpu(cfg, layout) and t == 1 and cfg.loss_chunk_tokens == 0
    # final norm + what the loss keeps: fp32 log-probs, or (native kernel) the padded logits + lse
    output = n * per_norm * e / sp + (n * (Vp + 1) * 4 if native_loss else n * V * 4 / t)
    tables = 2 * rot * seq_len * 4  # RoPE cos/sin, once per forward
    dropout_emb = n * d * _mask_bytes(layout, cfg) / sp if cfg.dropout > 0 else 0
    mtp = mtp_activation_bytes(cfg, seq_len, layout, native_loss, padded_vocab)
    total = kept * in_flight + output + tables + dropout_emb + mtp
    # backward transient: at the output layer the logits grad (padded, dtype e) + fp32 log-prob
    # grad (native loss: the logits grad alone); in each MLP the gradient of the up-projection's
    # output (SwiGLU: d[g | u], 2f, and an f-wide temporary of the torch ops; GELU: f) while the
    # MLP's saved tensors are still held
    swiglu_grad = 2 * cfg.ffn_dim if _native_cpu(cfg, layout) else 3 * cfg.ffn_dim
    mlp_grad = swiglu_grad if cfg.activation == "swiglu" else cfg.ffn_dim
    head_grad = n * Vp * e if native_loss else n * (Vp * e + V * 4) / t
    transient = max(head_grad, n * mlp_grad * e / t, context_transient_bytes(cfg, seq_len, layout))
    return {
        "per_layer": layer,
        "layers": kept * in_flight,
        "output": output + tables + dropout_emb,
        "mtp": mtp,
        "total": total,
        "backward_transient": transient,
        "recompute_live": recompute_live,
    }


def mtp_activation_bytes(
    cfg: ModelConfig,
    seq_len: int,
    layout: Layout,
    native_loss: bool,
    padded_vocab: Optional[int] = None,
) -> float:
    """Bytes the multi-token prediction modules keep for backward: module k on n_k = b (s - k)
    tokens keeps one block's activations (as block L + k - 1, not recomputed), the inputs of its two norms and of
    M_k (4 d), its head norm and what the loss keeps (fp32 log-probs, or with the native loss the
    padded logits and the lse)."""
    e, t = DTYPE_BYTES[layout.precision], layout.tp
    d, V, Vp = cfg.d_model, cfg.vocab_size, padded_vocab or cfg.vocab_size
    total = 0.0
    for k in range(1, cfg.mtp_depth + 1):
        s_k = seq_len - k
        n = layout.micro_batch * s_k
        moe = cfg.is_moe_layer(cfg.n_layers + k - 1)
        plain = replace(layout, recompute="none")  # the modules are not recomputed
        total += layer_activation_bytes(cfg, s_k, plain, moe=moe)["total"]
        total += n * (4 * d + _norm_elems(cfg, layout)) * e
        total += n * (Vp + 1) * 4 if native_loss else n * V * 4 / t
    return total


def _kv_repeat(cfg: ModelConfig, layout: Layout) -> int:
    """all_to_all: how many times each local KV head is repeated so the context ranks can split
    them (1 when the local KV heads divide by CP)."""
    kv = cfg.kv_heads // layout.tp
    return 1 if kv % layout.cp == 0 else math.lcm(kv, layout.cp) // kv


def _context_sizes(cfg: ModelConfig, seq_len: int, layout: Layout) -> tuple[int, int, float, float]:
    """(bytes per element, local tokens b s / cp, query width and KV width per TP rank)."""
    return (
        DTYPE_BYTES[layout.precision],
        layout.micro_batch * seq_len // layout.cp,
        cfg.n_heads * cfg.head_dim / layout.tp,
        cfg.kv_heads * cfg.head_dim / layout.tp,
    )


def context_saved_bytes(cfg: ModelConfig, seq_len: int, layout: Layout) -> float:
    """Bytes per layer context-parallel attention keeps beyond the plain attention's: the ring
    none (q, k, v, its output in the training dtype and the fp32 log-sum-exp, as a fused kernel
    keeps); all_to_all keeps k and v with repeated heads when the local KV heads do not divide by
    CP (2 n h_kv (r - 1) e)."""
    if layout.cp == 1 or layout.cp_mode == "ring":
        return 0.0
    e, n, hq, hkv = _context_sizes(cfg, seq_len, layout)
    return 2 * n * hkv * (_kv_repeat(cfg, layout) - 1) * e


def context_transient_bytes(cfg: ModelConfig, seq_len: int, layout: Layout) -> float:
    """Bytes the context-parallel attention of one layer holds briefly besides the saved tensors.

    ring (the larger of forward and backward): the K/V block being used and the one arriving
    (2 x 2 h_kv per local token, dtype e); forward the fp32 output accumulator (h_q x 4) and one
    chunk pair's kernel output (h_q e / 2); backward the travelling fp32 dK/dV accumulators
    (2 x 2 h_kv x 4), the fp32 dq accumulator (h_q x 4) and one chunk pair's kernel gradients
    ((h_q + 2 h_kv) e / 2);
    all_to_all: the head-sharded copies of q, k, v and the output while exchanged (2 h_q + 2 h_kv r
    per local token)."""
    if layout.cp == 1:
        return 0.0
    e, n, hq, hkv = _context_sizes(cfg, seq_len, layout)
    if layout.cp_mode == "ring":
        blocks = n * 2 * 2 * hkv * e
        forward = n * hq * 4 + n * hq * e / 2
        backward = n * 2 * 2 * hkv * 4 + n * hq * 4 + n * (hq + 2 * hkv) * e / 2
        return blocks + max(forward, backward)
    return n * (2 * hq + 2 * hkv * _kv_repeat(cfg, layout)) * e


def context_comm_bytes(cfg: ModelConfig, seq_len: int, layout: Layout) -> float:
    """Bytes one rank sends for context parallelism per layer per micro-batch (forward + backward).

    ring: the K and V blocks of n_local = b s / cp tokens (2 h_kv elements per token) pass cp - 1
    times forward and cp - 1 times again in backward; the fp32 dK/dV accumulators travel cp times,
    back to their owner: (cp - 1) n_local 2 h_kv 2 e + cp n_local 2 h_kv 4.
    all_to_all: q, k, v go to head-sharded and the output back, each rank keeping 1/cp:
    (cp - 1)/cp n_local (2 h_q + 2 h_kv r) e forward, the same in backward (r: the KV-head repeat)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    e, n, hq, hkv = _context_sizes(cfg, seq_len, layout)
    if layout.cp_mode == "ring":
        return (cp - 1) * n * 2 * hkv * 2 * e + cp * n * 2 * hkv * 4
    return 2 * (cp - 1) / cp * n * (2 * hq + 2 * hkv * _kv_repeat(cfg, layout)) * e


def expert_comm_bytes(cfg: ModelConfig, seq_len: int, layout: Layout) -> float:
    """Bytes one rank sends in the expert all-to-alls of one MoE block per micro-batch: the k
    copies of each of its tokens' d-wide inputs go out and their outputs come back, forward and
    backward (4 exchanges), to the EP - 1 other ranks, plus the per-expert counts (two int64
    vectors of E). Each TP rank sends its 1 / TP share of the micro-batch's tokens n. The
    exchange is ``parallel.expert_dispatch=auto``'s on a GPU: the fixed-size one (C rows to each
    rank, C = n min(k, L), or at most L capacity with a capacity factor; L = E / EP) when that
    costs at most twice the rows, else the uneven one ((EP - 1) / EP of the n k rows when routing
    is balanced)."""
    if layout.ep == 1 or not cfg.moe_layers:
        return 0.0
    e = DTYPE_BYTES[layout.precision]
    m, ep = cfg.moe, layout.ep
    n = layout.micro_batch * seq_len / layout.cp  # tokens routed by this TP group
    mine = n / layout.tp
    L = m.num_experts // ep
    rows = (ep - 1) / ep * mine * m.top_k  # uneven, balanced
    if not m.dropless and m.capacity_factor is not None:
        cap = math.ceil(m.capacity_factor * n * m.top_k / m.num_experts)
        rows = (ep - 1) * min(mine * min(m.top_k, L), L * cap)
    elif ep * min(m.top_k, L) <= 2 * m.top_k:
        rows = (ep - 1) * mine * min(m.top_k, L)
    return 4 * rows * cfg.d_model * e + 2 * 8 * m.num_experts


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Korthikanti et al. 2022, table 2: activation bytes per layer (16-bit, Megatron kernels)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attn_core = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attn_core) / t
    return s * b * h * (10 + (24 + attn_core) / t)


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak = weights + optimizer + max(start of backward, end of backward):

    start: activations + the larger backward transient, output layer or one MLP (+ all
           gradients when accumulating, as they live from the first micro-batch on);
    end (full recompute only): gradients + one recomputed block + the (small) kept checkpoint
           inputs.
    Gradients are freed by the optimizer step (set_to_none), so with one micro-batch they do not
    coexist with a whole forward's activations. ``total`` is the larger of that and ``build``, the
    model's build before the engine exists (:func:`build_bytes`).
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    recompute_live: float
    grads_during_forward: bool
    build: float = 0.0  # the model's build, before the step's states exist (build_bytes)

    @property
    def total(self) -> float:
        start = self.activations + self.transient + (self.grads if self.grads_during_forward else 0)
        end = self.grads + (self.recompute_live + self.activations if self.recompute_live else 0)
        return max(self.weights + self.optimizer + max(start, end), self.build)

    def as_dict(self) -> dict:
        return dict(asdict(self), total=self.total)


def estimate(
    cfg: ModelConfig, seq_len: int, layout: Layout, padded_vocab: Optional[int] = None
) -> MemoryEstimate:
    """Peak bytes per GPU: the larger of a training step's (states + activations + the backward
    transient) and the model's build (:func:`build_bytes`)."""
    st = state_bytes(cfg, layout, padded_vocab)
    act = activation_bytes(cfg, seq_len, layout, padded_vocab)
    return MemoryEstimate(
        st["weights"],
        st["grads"],
        st["optimizer"],
        act["total"],
        act["backward_transient"],
        act["recompute_live"],
        layout.grad_accum > 1,
        build_bytes(cfg, layout, padded_vocab),
    )
