"""Typed, validated configuration: one YAML file, one namespace.

A config has the sections ``model``, ``parallel``, ``data``, ``train``, ``eval``, ``checkpoint``,
``log`` and a pass-through ``deepspeed`` dict. Every key is declared below with its type, default and
documentation (``doc`` in the field metadata); ``megaformer train --help-config`` and docs/configuration.md
are generated from these declarations, so they cannot drift.

Loading goes YAML (safe loader, no anchors/aliases, bounded size) -> dotted overrides
(``train.steps=50``) -> type checks per key -> cross-key checks. Any problem raises
:class:`~megaformer.errors.ConfigError` with one line naming the key, the value and what is
allowed, before any process group starts. The ``deepspeed`` section is an allowlist of reviewed
keys (:data:`DEEPSPEED_ALLOWED`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

from megaformer.errors import ConfigError


def option(default: Any, doc: str, choices: Optional[tuple] = None, factory: Any = None) -> Any:
    """A dataclass field carrying its documentation (and allowed values) in metadata."""
    meta = {"doc": doc, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class MoEConfig:
    """Mixture-of-Experts FFN (``model.moe``): token-choice top-k routing over E experts.

    Off unless ``interval`` > 0. docs/moe.md explains routing, the load-balancing terms and what
    each parallelism does with the experts."""

    interval: int = option(
        0, "An MoE FFN in every n-th block (block i, counting from 0, is MoE when (i + 1) % n == 0; "
           "1 = every block), a dense FFN elsewhere; 0 = no MoE (a dense model).")
    num_experts: int = option(8, "Routed experts E per MoE block.")
    top_k: int = option(2, "Experts each token is routed to (1..8, at most num_experts).")
    score: str = option(
        "softmax", "Router score s = softmax(logits) over the experts (Switch, Mixtral, Qwen-MoE) or "
                   "sigmoid(logits) per expert (DeepSeek-V3).", ("softmax", "sigmoid"))
    renormalize: bool = option(
        True, "Divide the k selected scores by their sum, so each token's expert weights sum to 1 "
              "(Mixtral, Qwen3-MoE norm_topk_prob, DeepSeek-V3).")
    d_expert: Optional[int] = option(
        None, "Hidden width of each routed expert's FFN; null = the dense FFN width (model.d_ffn "
              "or its default).")
    num_shared_experts: int = option(
        0, "Shared experts every token passes through besides its routed ones (DeepSeek-style); "
           "they run as one FFN of num_shared_experts * d_shared hidden units.")
    d_shared: Optional[int] = option(
        None, "Hidden width of each shared expert; null = model.moe.d_expert.")
    shared_gate: bool = option(
        False, "Scale the shared experts' output per token by sigmoid(x w_g), w_g a learned [1, "
               "d_model] vector (Qwen2-MoE's shared_expert_gate); needs shared experts.")
    dropless: bool = option(
        True, "Every routed token is computed (no capacity limit, nothing dropped; a token's output "
              "does not depend on the other tokens in the batch). false needs "
              "model.moe.capacity_factor.")
    capacity_factor: Optional[float] = option(
        None, "With dropless=false: each expert takes at most ceil(capacity_factor * tokens * top_k "
              "/ num_experts) token assignments per micro-batch, first come first served in token "
              "order; the rest are dropped (that expert adds nothing for the token) and counted.")
    aux_loss_coef: float = option(
        0.01, "Coefficient alpha of the load-balancing loss alpha * E * sum_e f_e P_e per MoE block "
              "(Switch Transformer / Mixtral; f_e the fraction of the top-k assignments sent to "
              "expert e, P_e its mean router probability; 1 when balanced), added to the training "
              "loss; 0 = off.")
    z_loss_coef: float = option(
        0.0, "Coefficient of the router z-loss mean_tokens(logsumexp(logits)^2) per MoE block "
             "(ST-MoE), added to the training loss; 0 = off.")
    bias_update_rate: float = option(
        0.0, "Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias b_e is added to "
             "the scores for the top-k selection only (not to the expert weights), and after each "
             "optimizer step b_e += rate * sign(mean load - load_e), the load counted over the "
             "step's tokens on all data-parallel ranks; 0 = off.")


@dataclass
class ModelConfig:
    """The decoder-only Transformer (Vaswani et al. 2017 and its modern descendants)."""

    vocab_size: Optional[int] = option(
        None, "Vocabulary size of the embedding and output layer; null takes it from the tokenizer.")
    d_model: int = option(256, "Width of the residual stream (d_model).")
    n_layers: int = option(4, "Number of Transformer blocks.")
    n_heads: int = option(4, "Attention heads h; each has d_k = d_model / h (or model.head_dim).")
    n_kv_heads: Optional[int] = option(
        None, "Key/value heads for grouped-query attention; null = n_heads (MHA), 1 = MQA.")
    d_ffn: Optional[int] = option(
        None, "Hidden width of the FFN; null = 4*d_model for gelu, and 2/3 of that rounded up to a "
              "multiple of 64 for swiglu (same parameter count, Llama's convention).")
    head_dim: Optional[int] = option(
        None, "Width d_k of each attention head; null = d_model / n_heads. Set where a model's "
              "heads are wider or narrower than that (Qwen3: n_heads * head_dim != d_model).")
    max_seq_len: int = option(256, "Longest sequence the model accepts (size of the position table).")
    position: str = option("rope", "Positional encoding.", ("sinusoidal", "learned", "rope", "none"))
    rope_theta: float = option(10000.0, "Base theta of rotary embeddings.")
    rope_scaling: Optional[dict] = option(
        None, "Scaled rotary frequencies for a longer context, as transformers computes them: "
              "null (unscaled), {rope_type: llama3, factor, low_freq_factor, high_freq_factor, "
              "original_max_position_embeddings} (Llama 3.1+), or {rope_type: yarn, factor, "
              "original_max_position_embeddings, and optionally beta_fast, beta_slow, mscale, "
              "mscale_all_dim, attention_factor, truncate} (YaRN, whose attention factor scales "
              "cos and sin). docs/checkpoints.md explains the keys.")
    rotary_fraction: float = option(
        1.0, "Fraction of each head's dimensions that rotary embeddings rotate (GPT-NeoX uses 0.25).")
    norm: str = option("rmsnorm", "Normalisation layer.", ("layernorm", "rmsnorm"))
    norm_eps: float = option(1e-5, "Epsilon of the normalisation layers.")
    activation: str = option(
        "swiglu", "FFN form: gelu (exact erf GELU, two matrices), gelu_tanh (GPT-2's tanh "
                  "approximation) or swiglu (three matrices).", ("gelu", "gelu_tanh", "swiglu"))
    residual: str = option(
        "sequential", "Pre-norm residual form: sequential (x += attn(ln(x)); x += mlp(ln(x))) or "
                      "parallel (x += attn(ln1(x)) + mlp(ln2(x))).", ("sequential", "parallel"))
    tie_embeddings: bool = option(True, "Share the token embedding with the output layer.")
    bias: bool = option(False, "Biases in the linear layers (and LayerNorm).")
    qkv_bias: Optional[bool] = option(
        None, "Biases in the query/key/value projections; null = model.bias (Qwen2: true with "
              "model.bias false).")
    qk_norm: bool = option(
        False, "RMSNorm over each head's d_k dimensions of the queries and keys, before rotary "
               "embeddings (Qwen3).")
    sliding_window: Optional[int] = option(
        None, "Each token attends to at most this many most recent positions, itself included "
              "(Mistral 7B v0.1: 4096); null = the whole causal context. flash-attn's window_size "
              "on CUDA, a banded mask elsewhere (the native CPU attention kernel is not used).")
    dropout: float = option(0.0, "Dropout on embeddings and on each residual write.")
    attention_dropout: float = option(0.0, "Dropout on the attention probabilities.")
    init_std: float = option(0.02, "Std of the normal initialisation; residual-output projections "
                                   "use init_std / sqrt(2 * n_layers).")
    attention_backend: str = option(
        "auto", "Attention kernel: auto (flash-attn on CUDA fp16/bf16; megaformer's native CPU "
                "FlashAttention-2 kernel on fp32 CPU in eager mode without attention dropout, "
                "document mask or sliding window, head_dim a multiple of 16; else torch SDPA, whose own backend "
                "choice MEGAFORMER_SDPA_BACKENDS can override), or force one.",
        ("auto", "flash", "sdpa", "reference"))
    fused_kernels: str = option(
        "auto", "auto: the fastest implementation of each op that runs here (Triton, apex, oneDNN, "
                "megaformer's native CPU kernels); torch: plain torch ops everywhere. The trainer "
                "logs which one runs per op; docs/kernels.md lists them.", ("auto", "torch"))
    loss_chunk_tokens: int = option(
        0, "0 = logits then cross-entropy (materialises [tokens, vocab] fp32 logits); N > 0 = the "
           "output projection fused with the cross-entropy over N tokens at a time (its gradients "
           "computed chunk by chunk in forward), so only [N, vocab] logits exist at once (vocab-parallel under TP; not with "
           "parallel.pipeline > 1).")
    document_mask: bool = option(
        False, "Packed documents do not attend to each other: a token attends only to earlier tokens "
               "of its own document (documents end at the tokenizer's EOD token). Varlen flash-attn "
               "on CUDA when installed, else a block-diagonal causal mask (SDPA/reference). Not with "
               "parallel.pipeline > 1.")
    moe: MoEConfig = option(None, "Mixture-of-Experts FFN: see the model.moe.* keys.",
                            factory=MoEConfig)

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
        """Whether block ``i`` (from 0) has an MoE FFN (``model.moe.interval``)."""
        n = self.moe.interval
        return n > 0 and (i + 1) % n == 0

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


def _head_dim(self: ModelConfig) -> int:
    """d_k: ``model.head_dim`` when set, else d_model / n_heads."""
    explicit = self.__dict__.get("head_dim")
    return explicit if explicit is not None else self.d_model // self.n_heads


def _set_head_dim(self: ModelConfig, value: Optional[int]) -> None:
    self.__dict__["head_dim"] = value  # the value as configured (null stays null)


# ``cfg.head_dim`` reads the resolved width d_k; the configured value (possibly null) is kept in
# the instance's __dict__, so ``ModelConfig(**cfg.__dict__)`` reproduces the config.
ModelConfig.head_dim = property(_head_dim, _set_head_dim)  # type: ignore[assignment]

ROPE_SCALING_KEYS = {
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
               set()),
    "yarn": ({"factor", "original_max_position_embeddings"},
             {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}),
}


def check_rope_scaling(scaling: Optional[dict]) -> None:
    """One-line ConfigError unless ``model.rope_scaling`` is null or a complete llama3/yarn spec."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    _require(kind in ROPE_SCALING_KEYS, f"model.rope_scaling.rope_type={kind!r}: must be one of "
                                        f"{', '.join(ROPE_SCALING_KEYS)} (or rope_scaling: null)")
    required, optional = ROPE_SCALING_KEYS[kind]
    missing = sorted(required - set(scaling))
    _require(not missing, f"model.rope_scaling: rope_type {kind} needs {', '.join(missing)}")
    unknown = sorted(set(scaling) - required - optional - {"rope_type"})
    _require(not unknown, f"model.rope_scaling.{unknown[0] if unknown else ''}: unknown for "
                          f"rope_type {kind} (known: {', '.join(sorted(required | optional))})")
    for key in sorted((required | optional) & set(scaling)):
        value = scaling[key]
        if key == "truncate":
            _require(isinstance(value, bool), f"model.rope_scaling.truncate={value!r}: expected bool")
        elif value is not None or key in required:
            _require(isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                     f"model.rope_scaling.{key}={value!r}: expected a positive number")
    if kind == "llama3":
        _require(scaling["high_freq_factor"] > scaling["low_freq_factor"],
                 "model.rope_scaling: high_freq_factor must exceed low_freq_factor")


@dataclass
class ParallelConfig:
    """How the world is split. Data parallelism is world_size / (tensor * context * pipeline)."""

    tensor: int = option(1, "Tensor-parallel degree: each layer's matrices split over this many "
                            "adjacent ranks (Megatron-style); must divide heads, KV heads, d_ffn.")
    pipeline: int = option(1, "Pipeline-parallel degree: stages of consecutive blocks, run by "
                              "DeepSpeed's pipeline engine (1F1B over the micro-batches).")
    pipeline_partition: str = option(
        "layers", "How blocks are split over stages: 'layers' (equal block counts), 'parameters' "
                  "(balanced parameter counts) or an explicit list of blocks per stage, e.g. '3,3,2'. "
                  "The embedding goes with the first stage, the final norm and head with the last.")
    context: int = option(
        1, "Context-parallel degree: each sequence split into this many parts over adjacent ranks "
           "(after the tensor-parallel ranks); attention exchanges keys/values or heads between "
           "them (parallel.context_mode). Gradients are averaged over data x context ranks.")
    context_mode: str = option(
        "ring", "How attention sees the whole sequence under context parallelism: 'ring' (K/V "
                "blocks passed around the context group, online softmax, two opposite chunks per "
                "rank so causal work is balanced; sequence divisible by 2 * context) or "
                "'all_to_all' (DeepSpeed-Ulysses: sequence-sharded to head-sharded around the "
                "attention core and back; heads per tensor-parallel rank divisible by context).",
        ("ring", "all_to_all"))
    expert: int = option(
        1, "Expert-parallel degree (model.moe): the routed experts split over this many "
           "data-parallel ranks, tokens sent to their experts' ranks and back with all-to-all; "
           "expert gradients are averaged over the remaining data-parallel ranks. Must divide "
           "model.moe.num_experts and the data-parallel size.")
    zero_stage: int = option(0, "DeepSpeed ZeRO stage: 0 (off), 1 (optimizer states), 2 (+gradients), "
                                "3 (+parameters).", (0, 1, 2, 3))
    sequence_parallel: bool = option(
        False, "Split the residual stream along the sequence across the tensor-parallel group "
               "(all-gather / reduce-scatter instead of all-reduce); no effect when tensor = 1.")
    vocab_multiple: int = option(
        128, "Pad the vocabulary to a multiple of vocab_multiple * tensor rows; the padding never "
             "reaches the loss, generation or exported weights.")
    collective_timeout_minutes: float = option(
        30.0, "Timeout of the process group's collectives (init_process_group(timeout=...)): a rank "
              "waiting longer than this for the others fails instead of hanging.")


@dataclass
class DataConfig:
    """Where the tokens come from."""

    source: str = option(
        "stdlib", "Training text: 'stdlib' (the .py files of the running Python's standard library, "
                  "always present), a folder (its .txt/.md/.py/.json/.jsonl files), or one .txt or "
                  ".jsonl file.")
    tokenizer: str = option(
        "byte", "'byte' (256 byte values + end-of-document), 'bpe:N' (byte-level BPE with N tokens "
                "trained on the source with HF tokenizers), or a path to a HF tokenizer.json.")
    text_field: str = option("text", "Field holding the text in .json/.jsonl records.")
    seq_len: Optional[int] = option(None, "Training sequence length; null = model.max_seq_len.")
    valid_fraction: float = option(0.05, "Fraction of documents held out for validation.")
    max_bytes: Optional[int] = option(
        None, "Read at most this many characters of text (null = all): of data.source, and of "
              "each data.paths source prepared on the fly (not of already prepared .bin/.idx).")
    paths: Optional[list[str]] = option(
        None, "The Megatron-style pipeline: a list of prepared datasets (PREFIX of PREFIX.bin + "
              "PREFIX.idx, from `megaformer prepare-data`, Megatron-LM or GPT-NeoX) or sources that are "
              "prepared on the fly with data.tokenizer and cached under data.cache_dir (local "
              ".json/.jsonl/.parquet/.txt/.arrow files, globs or folders, 'stdlib', or a Hugging Face "
              "hub dataset hf:NAME[:CONFIG][@SPLIT], streamed: only the hf: prefix reaches the "
              "network, an entry naming nothing local is an error). Samples of "
              "seq_len + 1 tokens are packed across documents and shuffled per epoch. "
              "null or [] = the in-memory path over data.source.")
    weights: Optional[list[float]] = option(
        None, "Blend weights, one per data.paths entry (normalised to sum 1; each dataset's count in "
              "any prefix of the sample stream stays within one sample of weight * length); null = "
              "proportional to each dataset's tokens.")
    split: Optional[str] = option(
        None, "data.paths only: train,valid,test ratios over each dataset's documents (contiguous "
              "ranges, Megatron style, e.g. '969,30,1'); null = (1 - valid_fraction), valid_fraction, 0.")
    cache_dir: Optional[str] = option(
        None, "data.paths only: folder for the cached document/sample/shuffle indices and the data "
              "prepared on the fly (keyed by a hash of the settings; share it between runs); "
              "null = RUN_DIR/data_cache.")
    prefetch: int = option(
        2, "Optimizer steps of batches a background thread reads ahead (0 = read in the loop).")

    def __post_init__(self) -> None:
        if self.paths is not None and any(not p.strip() for p in self.paths):
            raise ConfigError(f"data.paths={self.paths!r}: entries must be non-empty")
        if self.weights is not None:
            n = len(self.paths or [])
            if len(self.weights) != n:
                raise ConfigError(f"data.weights={self.weights!r}: needs one weight per data.paths "
                                  f"entry ({n})")
            if any(w < 0 for w in self.weights) or sum(self.weights) <= 0:
                raise ConfigError(f"data.weights={self.weights!r}: weights must be >= 0 with a "
                                  "positive sum")
        if self.split is not None:
            try:
                ratios = [float(x) for x in self.split.split(",")]
            except ValueError:
                ratios = []
            if not 1 <= len(ratios) <= 3 or any(r < 0 for r in ratios) or sum(ratios) <= 0:
                raise ConfigError(f"data.split={self.split!r}: expected up to three non-negative "
                                  "ratios train,valid,test, e.g. '969,30,1'")
        if self.prefetch < 0:
            raise ConfigError(f"data.prefetch={self.prefetch}: must be >= 0")


@dataclass
class TrainConfig:
    """Optimisation."""

    steps: int = option(100, "Optimizer steps to train for.")
    seed: int = option(1234, "Seed for initialisation, data order and dropout.")
    micro_batch_size: int = option(8, "Sequences per micro-batch per data-parallel rank.")
    global_batch_size: int = option(
        8, "Sequences per optimizer step over all ranks = micro_batch_size * grad. accumulation * DP.")
    lr: float = option(3e-4, "Peak learning rate.")
    min_lr: float = option(0.0, "Final learning rate of the cosine/linear/wsd decay.")
    lr_schedule: str = option("cosine", "LR schedule after warmup.",
                              ("cosine", "linear", "wsd", "constant"))
    warmup_steps: int = option(0, "Linear warmup steps from 0 to lr.")
    decay_fraction: float = option(0.2, "wsd only: fraction of the steps spent in the final decay.")
    weight_decay: float = option(0.1, "AdamW weight decay (not applied to norms, biases, embeddings).")
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.95, "AdamW beta2.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    adam_impl: str = option(
        "auto", "AdamW implementation: fused (torch's one-pass kernel per parameter: reads p, g, m, v "
                "once), foreach (torch's multi-tensor "
                "ops, one pass per operation) or auto (fused when every parameter is a floating "
                "tensor on CPU or CUDA, else foreach). Same update either way up to rounding.",
        ("auto", "fused", "foreach"))
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value; 0 disables.")
    recompute: str = option(
        "none", "Activation checkpointing: none; full (keep only each checkpointed block's input, "
                "recompute the block in backward); selective (recompute only the attention core "
                "softmax(QK^T)V, Megatron's selective recomputation).", ("none", "full", "selective"))
    recompute_every: int = option(
        1, "full recompute only: checkpoint every k-th block (1 = every block).")
    precision: str = option("fp32", "Training precision (bf16/fp16 with fp32 master weights; fp16 "
                                    "with dynamic loss scaling).", ("fp32", "bf16", "fp16"))
    device: str = option("auto", "auto (CUDA when available, else CPU), cpu or cuda.",
                         ("auto", "cpu", "cuda"))
    cpu_malloc: str = option(
        "tuned", "CPU runs on glibc: tuned keeps freed memory in the process heap (mallopt: no mmap-ed "
                 "chunks, no trimming) so each step reuses the last step's pages instead of faulting "
                 "in fresh zero-filled ones (~100k page faults per quickstart step otherwise); "
                 "default leaves glibc's settings. No effect on CUDA runs.", ("tuned", "default"))
    compile: bool = option(
        False, "torch.compile each Transformer block (off by default: the first steps pay the "
               "compilation; measure with tools/bench_gpu.py before turning it on).")
    max_bad_steps: int = option(
        5, "A step whose loss or gradient norm is inf/NaN on any rank is skipped (no update; its data "
           "is consumed, the LR schedule does not advance) and counted as skipped_steps; this many "
           "in a row stop the run with an error (1 = stop at the first).")
    exit_after_minutes: Optional[float] = option(
        None, "Save a checkpoint and exit 0 at the first step boundary after this many minutes, as on "
              "SIGTERM/SIGUSR1 (null = no time limit).")
    watchdog_factor: float = option(
        20.0, "Hang watchdog: a step running longer than max(watchdog_min_seconds, watchdog_factor x "
              "median step time) dumps every thread's stack to RUN_DIR/logs/rank_N.log and exits "
              "with code 3 (0 = no watchdog).")
    watchdog_min_seconds: float = option(
        600.0, "Hang watchdog: the least time a step may take before the watchdog fires.")
    fp8: str = option(
        "off", "FP8 training of the blocks' linear layers (q/k/v, attention output, FFN and shared "
               "experts; not the embedding, output head, router or routed experts) through "
               "torchao's float8 casts: tensorwise (one dynamic scale per tensor) or rowwise (one "
               "per row, power-of-two scales). Master weights, optimizer and everything else stay "
               "in train.precision. Needs a GPU with FP8 GEMMs (CUDA capability >= 8.9) unless "
               "train.fp8_emulate=true; see docs/fp8.md.", ("off", "tensorwise", "rowwise"))
    fp8_emulate: bool = option(
        False, "train.fp8 without FP8 hardware: the same casts and scales, the GEMMs dequantised "
               "and run in fp32 (same numbers as FP8 GEMMs up to accumulation order, no speed-up; "
               "for tests and CPU runs). No effect when train.fp8=off.")


@dataclass
class EvalConfig:
    """Validation loss and perplexity; downstream tasks through lm-evaluation-harness."""

    interval: int = option(50, "Evaluate every N steps (0 = only at the end).")
    iters: int = option(10, "Global batches (train.global_batch_size sequences each) of validation "
                            "data per evaluation.")
    at_end: bool = option(True, "Evaluate after the last step.")
    tasks: Optional[list[str]] = option(
        None, "lm-evaluation-harness tasks to score the live model on during training, e.g. "
              "[hellaswag, arc_easy] (null = off; needs pip install megaformer[eval]); requests "
              "are split over the data-parallel ranks, scores logged as eval/TASK/METRIC. See "
              "docs/evaluation.md.")
    tasks_interval: int = option(
        0, "Run eval.tasks every N steps (0 = only after the last step, when eval.at_end).")
    tasks_limit: Optional[int] = option(
        None, "At most this many documents per task in eval.tasks (null = all).")
    tasks_include_path: Optional[str] = option(
        None, "Folder of extra lm-evaluation-harness task YAMLs for eval.tasks (local tasks). It is "
              "code (lm-eval runs the Python files its YAMLs name): accepted on the command line, "
              "or in a config file only when MEGAFORMER_TRUST_TASKS_DIR names the same folder.")


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval: int = option(0, "Save every N steps (0 = only at the end).")
    save_at_end: bool = option(True, "Save after the last step.")
    keep_last: Optional[int] = option(None, "Keep only the newest N checkpoints (null = keep all).")
    resume: bool = option(
        True, "Resume from the latest complete checkpoint in the run directory if there is one "
              "(half-written ones are ignored with a warning); false refuses a run directory that "
              "already holds checkpoints rather than overwrite or silently ignore them.")
    async_save: bool = option(
        False, "Write checkpoint files on a background thread: each rank copies its own shard of "
               "the state to host memory (the only stall), then training goes on while the shards "
               "are written, flushed and sealed (the next save and the end of training wait for "
               "it).")
    export_weights: bool = option(
        False, "Also write consolidated release weights (model.safetensors) into every checkpoint. "
               "This gathers the whole model onto rank 0 at each save; leave it off at scale and "
               "build them when needed with megaformer convert CKPT --to hf.")


@dataclass
class LogConfig:
    """Console, TensorBoard, metrics.jsonl and Weights & Biases."""

    interval: int = option(10, "Log metrics every N steps.")
    tensorboard: bool = option(True, "Write TensorBoard events to RUN_DIR/tensorboard.")
    progress_bar: bool = option(True, "Show a tqdm progress bar on rank 0.")
    all_ranks: bool = option(False, "Every rank also logs to RUN_DIR/logs/rank_N.log.")
    sample_prompt: str = option("def ", "Prompt of the text sample printed after training.")
    sample_tokens: int = option(200, "Tokens of the sample printed after training (0 = none).")
    gpu: Optional[str] = option(
        None, "Accelerator name for MFU/HFU (a name from the peak table, e.g. H100-SXM, A100, MI300X); "
              "null = the CUDA device's own name when the table knows it. CPUs have no peak: MFU is "
              "then not logged unless log.peak_tflops is set.")
    peak_tflops: Optional[float] = option(
        None, "Peak dense TFLOP/s per device for the training dtype; overrides log.gpu's table value.")
    diagnostics: bool = option(
        False, "Residual-stream diagnostics every log.diagnostics_interval steps on a fixed held-out "
               "micro-batch: per layer the RMS of the residual stream and of the attention and MLP "
               "writes, the largest attention logit and the logit-lens loss; per head the norm of "
               "its write and its attention entropy (metrics.jsonl and TensorBoard: resid/*, "
               "attn_write/*, mlp_write/*, attn/*, logit_lens/*). Off: no cost at all.")
    diagnostics_interval: int = option(
        100, "Steps between diagnostics passes when log.diagnostics is on (one extra no-grad "
             "forward of one micro-batch each).")
    wandb: bool = option(
        False, "Also log to Weights & Biases (rank 0): the metrics.jsonl scalars, the resolved "
               "config, and the report plots found in RUN_DIR/report at the end (needs pip install "
               "megaformer[wandb]; never imported when off).")
    wandb_project: str = option("megaformer", "W&B project of the run.")
    wandb_mode: str = option(
        "online", "online (sync as it runs) or offline (files only; wandb sync uploads them "
                  "later).", ("online", "offline"))
    wandb_dir: Optional[str] = option(
        None, "Folder under which W&B writes its files (null = the run directory: RUN_DIR/wandb).")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
}

# DeepSpeed keys megaformer derives itself; setting them in the pass-through section is refused.
DERIVED_DEEPSPEED_KEYS = {
    "train_batch_size": "train.global_batch_size",
    "train_micro_batch_size_per_gpu": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size / (train.micro_batch_size * DP)",
    "gradient_clipping": "train.grad_clip",
    "optimizer": "train.lr / train.adam_* / train.weight_decay",
    "scheduler": "train.lr_schedule",
    "fp16": "train.precision",
    "bf16": "train.precision",
}


# The DeepSpeed keys megaformer has reviewed and passes through: a key maps to None (any scalar
# value), to a set of allowed scalar values, or to a nested allowlist. Everything else is refused by
# name: DeepSpeed keys can load pickles (checkpoint.load_universal), write files anywhere
# (flops_profiler.output_file, monitors, NVMe offload paths), import modules
# (torch_autocast.lower_precision_safe_modules) or reach the network (wandb, comet).
_OFFLOAD = {"device": {"cpu", "none"}, "pin_memory": None}
DEEPSPEED_ALLOWED: dict = {
    "zero_optimization": {
        "reduce_bucket_size": None, "allgather_bucket_size": None, "overlap_comm": None,
        "contiguous_gradients": None, "reduce_scatter": None, "allgather_partitions": None,
        "round_robin_gradients": None, "sub_group_size": None, "stage3_prefetch_bucket_size": None,
        "stage3_param_persistence_threshold": None, "stage3_max_live_parameters": None,
        "stage3_max_reuse_distance": None, "stage3_gather_16bit_weights_on_model_save": None,
        "offload_optimizer": _OFFLOAD, "offload_param": _OFFLOAD,
    },
    "communication_data_type": None, "prescale_gradients": None, "gradient_predivide_factor": None,
    "zero_allow_untested_optimizer": None, "zero_force_ds_cpu_optimizer": None,
    "steps_per_print": None, "wall_clock_breakdown": None, "memory_breakdown": None,
    "pipeline": {"pipe_partitioned": None, "grad_partitioned": None},
    "data_types": {"grad_accum_dtype": None},
    "comms_logger": {"enabled": None, "verbose": None, "prof_all": None, "debug": None},
    "flops_profiler": {"enabled": None, "profile_step": None, "module_depth": None,
                       "top_modules": None, "detailed": None},
}


def deepspeed_keys_doc(allowed: Optional[dict] = None, prefix: str = "") -> str:
    """The accepted ``deepspeed:`` keys, dotted, for the config reference."""
    allowed = DEEPSPEED_ALLOWED if allowed is None else allowed
    out = []
    for key, rule in allowed.items():
        if isinstance(rule, dict):
            out.append(deepspeed_keys_doc(rule, f"{prefix}{key}."))
        elif isinstance(rule, set):
            out.append(f"{prefix}{key} ({'/'.join(sorted(rule))})")
        else:
            out.append(f"{prefix}{key}")
    return ", ".join(out)


def check_deepspeed_section(ds: Any, allowed: Optional[dict] = None,
                            prefix: str = "deepspeed") -> None:
    """Raise ConfigError naming the first ``deepspeed:`` key (or value) that is not reviewed."""
    allowed = DEEPSPEED_ALLOWED if allowed is None else allowed
    if not isinstance(ds, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(ds).__name__}")
    for key, value in ds.items():
        name = f"{prefix}.{key}"
        if key not in allowed:
            raise ConfigError(f"{name}: not a DeepSpeed key megaformer accepts (accepted here: "
                              f"{', '.join(allowed)})")
        rule = allowed[key]
        if isinstance(rule, dict):
            check_deepspeed_section(value, rule, name)
            continue
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ConfigError(f"{name}={value!r}: expected a single value, got "
                              f"{type(value).__name__}")
        if isinstance(rule, set) and value not in rule:
            raise ConfigError(f"{name}={value!r}: must be one of {', '.join(sorted(rule))}")


@dataclass
class Config:
    """The whole run: see each section's class for its keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    deepspeed: dict = field(default_factory=dict)
    name: str = "megaformer"

    @property
    def seq_len(self) -> int:
        return self.data.seq_len if self.data.seq_len is not None else self.model.max_seq_len

    def to_dict(self) -> dict:
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["model"]["head_dim"] = self.model.__dict__.get("head_dim")  # as configured (null: d/h)
        out["deepspeed"] = dict(self.deepspeed)
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------- type checking

def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return f"{_type_name(args[0])} or null"
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, choices: Optional[tuple]) -> Any:
    """Check ``value`` against the declared type ``tp`` (ints are accepted for floats)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _coerce(key, value, inner, choices)
    if origin is list:  # a single scalar is a one-element list
        items = value if isinstance(value, list) else [value]
        return [_coerce(f"{key}[{i}]", v, typing.get_args(tp)[0], choices) for i, v in enumerate(items)]
    if dataclasses.is_dataclass(tp):  # a nested section, e.g. model.moe
        return _build_section(key, tp, value)
    ok = False
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif tp is str:
        if value is False and choices is not None and "off" in choices:  # YAML 1.1 reads off as false
            value = "off"
        ok = isinstance(value, str)
    elif tp is dict:
        ok = isinstance(value, dict)
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}, got {type(value).__name__}")
    if choices is not None and value not in choices:
        allowed = ", ".join(str(c) for c in choices)
        raise ConfigError(f"{key}={value!r}: must be one of {allowed}")
    return value


def _did_you_mean(word: str, candidates: Any, prefix: str = "") -> str:
    """", did you mean 'x'?" for the closest candidate of a likely typo, else ""."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f", did you mean '{prefix}{close[0]}'?" if close else ""


def _build_section(name: str, cls: type, values: Any) -> Any:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown config key '{name}.{key}'{_did_you_mean(key, fields, name + '.')} "
                              f"(known keys in '{name}': {', '.join(fields)})")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key], fields[key].metadata.get("choices"))
    return cls(**kwargs)


MAX_CONFIG_BYTES = 4 * 1024 * 1024


class _SafeNoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors and aliases (``&a`` / ``*a``): a config never needs
    them, and nested aliases expand exponentially (an "alias bomb")."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None, None, "YAML anchors and aliases (&name / *name) are not accepted in configs",
                event.start_mark)
        return super().compose_node(parent, index)


def safe_yaml_load(text: str, where: str) -> Any:
    """``yaml.safe_load`` without anchors/aliases; errors as ConfigError naming ``where``."""
    try:
        return yaml.load(text, Loader=_SafeNoAliasLoader)
    except (RecursionError, ValueError) as e:  # nesting deeper than Python recurses, huge ints
        from megaformer.safe_files import unreadable_reason

        raise ConfigError(f"{where}: {unreadable_reason(e)}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None)
        if problem and "anchors and aliases" in problem:
            raise ConfigError(f"{where}: {problem}{at}") from None
        raise ConfigError(f"{where}: not valid YAML{at}") from None


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. train.steps=50")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override '{item}': key must be dotted, SECTION.KEY (e.g. train.steps)")
    try:
        value = yaml.load(raw, Loader=_SafeNoAliasLoader) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` strings to a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = raw
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{p}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw


def config_from_dict(raw: dict, name: str = "megaformer") -> Config:
    """Build and validate a :class:`Config` from a nested dict."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    known = list(SECTIONS) + ["deepspeed"]
    for key in raw:
        if key not in known:
            raise ConfigError(f"unknown config section '{key}'{_did_you_mean(key, known)} "
                              f"(known sections: {', '.join(known)})")
    sections = {n: _build_section(n, cls, raw.get(n)) for n, cls in SECTIONS.items()}
    ds = raw.get("deepspeed") or {}
    if not isinstance(ds, dict):
        raise ConfigError(f"deepspeed: expected a mapping, got {type(ds).__name__}")
    cfg = Config(**sections, deepspeed=ds, name=name)
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> Config:
    """Read a YAML config (safe loader), apply dotted overrides, validate."""
    from megaformer.safe_files import read_bounded, refuse_code_folders

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = read_bounded(p, MAX_CONFIG_BYTES, ConfigError).decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file") from None
    raw = safe_yaml_load(text, str(p)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    refuse_code_folders(raw, p, ConfigError)
    raw = apply_overrides(raw, list(overrides or []))
    return config_from_dict(raw, name=p.stem)


# ----------------------------------------------------------------------------- cross-key checks

def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _positive(key: str, value: Optional[float], allow_zero: bool = False) -> None:
    if value is None:
        return
    ok = value >= 0 if allow_zero else value > 0
    _require(ok, f"{key}={value}: must be {'>= 0' if allow_zero else '> 0'}")


def _check_pipeline(cfg: Config) -> None:
    p, n = cfg.parallel, cfg.model.n_layers
    spec = p.pipeline_partition
    if spec not in ("layers", "parameters"):
        try:
            counts = [int(c) for c in spec.split(",")]
        except ValueError:
            counts = []
        _require(len(counts) == p.pipeline and all(c >= 1 for c in counts) and sum(counts) == n,
                 f"parallel.pipeline_partition={spec!r}: expected 'layers', 'parameters' or "
                 f"{p.pipeline} positive block counts summing to model.n_layers={n}")
    if p.pipeline == 1:
        return
    _require(n >= p.pipeline, f"parallel.pipeline={p.pipeline}: more stages than model.n_layers={n}")
    _require(p.zero_stage <= 1,
             f"parallel.zero_stage={p.zero_stage} with parallel.pipeline={p.pipeline}: DeepSpeed's "
             "pipeline engine does not support ZeRO-2/3; use parallel.zero_stage=1 (or 0)")
    _require(not (cfg.train.precision == "bf16" and p.zero_stage == 0),
             f"train.precision=bf16 with parallel.pipeline={p.pipeline} needs parallel.zero_stage=1: "
             "DeepSpeed accumulates bf16 micro-batch gradients in fp32 only in its ZeRO-1 optimizer")


def _check_tensor_parallel(cfg: Config) -> None:
    m, tp = cfg.model, cfg.parallel.tensor
    if tp == 1:
        return
    _require(m.n_heads % tp == 0, f"parallel.tensor={tp}: must divide model.n_heads={m.n_heads}")
    _require(m.kv_heads % tp == 0,
             f"parallel.tensor={tp}: must divide the key/value heads (model.n_kv_heads="
             f"{m.kv_heads}); replicating KV heads across TP ranks is not supported")
    _require(m.ffn_dim % tp == 0, f"parallel.tensor={tp}: must divide the FFN width {m.ffn_dim}")
    if cfg.parallel.sequence_parallel:
        _require(cfg.seq_len % tp == 0, f"parallel.sequence_parallel=true: sequence length "
                                        f"{cfg.seq_len} must be divisible by parallel.tensor={tp}")
    _require(cfg.parallel.zero_stage < 3,
             f"parallel.zero_stage=3 with parallel.tensor={tp}: ZeRO-3 does not partition "
             "tensor-parallel shards here; use zero_stage 0, 1 or 2")


def _check_context(cfg: Config) -> None:
    p, m = cfg.parallel, cfg.model
    cp = p.context
    if cp == 1:
        return
    if p.context_mode == "ring":
        _require(cfg.seq_len % (2 * cp) == 0,
                 f"parallel.context={cp} (ring): sequence length {cfg.seq_len} must be divisible by "
                 f"2 * context = {2 * cp} (each rank holds two opposite chunks)")
    else:
        _require(cfg.seq_len % cp == 0, f"parallel.context={cp}: sequence length {cfg.seq_len} must "
                                        f"be divisible by the context degree")
        local_heads = m.n_heads // p.tensor
        _require(local_heads % cp == 0,
                 f"parallel.context={cp} (all_to_all): the {local_heads} attention heads per "
                 "tensor-parallel rank must be divisible by the context degree; use "
                 "parallel.context_mode=ring")
    _require(m.moe.interval == 0,
             f"parallel.context={cp} with model.moe: the router's load-balancing losses and expert "
             "loads are per-sequence statistics that context parallelism would split; use "
             "parallel.context=1 for mixture-of-experts models")
    _require(not cfg.train.compile,
             f"parallel.context={cp} with train.compile=true: the context-parallel attention "
             "communicates inside the blocks, which are not compiled; set train.compile=false")
    if p.context_mode == "ring":
        _require(m.attention_backend in ("auto", "reference"),
                 f"parallel.context={cp} (ring) with model.attention_backend="
                 f"{m.attention_backend}: ring attention merges blocks by their log-sum-exp with its "
                 "own blockwise kernel; set attention_backend=auto or use "
                 "parallel.context_mode=all_to_all (any backend)")
        _require(m.attention_dropout == 0,
                 f"parallel.context={cp} (ring) with model.attention_dropout="
                 f"{m.attention_dropout}: ring attention has no attention dropout; use "
                 "parallel.context_mode=all_to_all or attention_dropout=0")
    if p.sequence_parallel and p.tensor > 1:
        _require(cfg.seq_len % (cp * p.tensor) == 0,
                 f"parallel.sequence_parallel=true: sequence length {cfg.seq_len} must be divisible "
                 f"by context * tensor = {cp * p.tensor}")


def _check_expert(cfg: Config) -> None:
    ep, moe = cfg.parallel.expert, cfg.model.moe
    if ep == 1:
        return
    _require(moe.interval > 0, f"parallel.expert={ep}: needs a mixture-of-experts model "
                               "(model.moe.interval > 0)")
    _require(moe.num_experts % ep == 0, f"parallel.expert={ep}: must divide "
                                        f"model.moe.num_experts={moe.num_experts}")
    _require(cfg.parallel.context == 1,
             f"parallel.expert={ep} with parallel.context={cfg.parallel.context}: expert and "
             "context parallelism are not supported together; use one of them")
    _require(cfg.train.precision != "fp16",
             f"parallel.expert={ep} with train.precision=fp16: the fp16 optimizer's checkpoints "
             "cannot hold split experts; use train.precision=bf16")


def _check_fp8(cfg: Config) -> None:
    """FP8 GEMMs (torch._scaled_mm) need both matrix dimensions of every converted linear layer's
    tensor-parallel shard to be multiples of 16 (emulation has no such constraint)."""
    t, m, tp = cfg.train, cfg.model, cfg.parallel.tensor
    if t.fp8 == "off" or t.fp8_emulate:
        return
    dims = {"model.d_model": m.d_model, "query width n_heads*head_dim / TP": m.n_heads * m.head_dim // tp,
            "key/value width kv_heads*head_dim / TP": m.kv_heads * m.head_dim // tp,
            "FFN width / TP": m.ffn_dim // tp}
    if m.moe_layers and m.shared_dim:
        dims["shared-expert width / TP"] = m.shared_dim // tp
    for what, n in dims.items():
        _require(n % 16 == 0, f"train.fp8={t.fp8}: the {what} = {n} is not a multiple of 16, which "
                              "FP8 GEMMs need; change the model's widths or use train.fp8=off")


def _check_moe(cfg: Config) -> None:
    m, moe = cfg.model, cfg.model.moe
    _positive("model.moe.interval", moe.interval, allow_zero=True)
    if moe.interval == 0:
        return
    _require(moe.interval <= m.n_layers, f"model.moe.interval={moe.interval}: no block would be "
                                         f"MoE with model.n_layers={m.n_layers}")
    _positive("model.moe.num_experts", moe.num_experts)
    _require(1 <= moe.top_k <= 8, f"model.moe.top_k={moe.top_k}: must be in 1..8")
    _require(moe.top_k <= moe.num_experts, f"model.moe.top_k={moe.top_k}: more than "
                                           f"model.moe.num_experts={moe.num_experts}")
    for key in ("d_expert", "d_shared"):
        _positive(f"model.moe.{key}", getattr(moe, key))
    for key in ("num_shared_experts", "aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        _positive(f"model.moe.{key}", getattr(moe, key), allow_zero=True)
    _require(not moe.shared_gate or moe.num_shared_experts > 0,
             "model.moe.shared_gate=true: gates the shared experts; set "
             "model.moe.num_shared_experts > 0")
    if moe.dropless:
        _require(moe.capacity_factor is None,
                 f"model.moe.capacity_factor={moe.capacity_factor}: a capacity drops tokens; set "
                 "model.moe.dropless=false to use it (or capacity_factor: null)")
    else:
        _require(moe.capacity_factor is not None,
                 "model.moe.dropless=false: needs model.moe.capacity_factor (e.g. 1.25)")
        _positive("model.moe.capacity_factor", moe.capacity_factor)
    tp = cfg.parallel.tensor
    if tp > 1:
        _require(m.expert_dim % tp == 0, f"parallel.tensor={tp}: must divide the expert FFN width "
                                         f"{m.expert_dim} (model.moe.d_expert)")
        _require(m.shared_dim % tp == 0, f"parallel.tensor={tp}: must divide the shared experts' "
                                         f"FFN width {m.shared_dim}")
    if cfg.parallel.pipeline > 1:
        _require(moe.aux_loss_coef == 0 and moe.z_loss_coef == 0,
                 f"model.moe.aux_loss_coef/z_loss_coef with parallel.pipeline="
                 f"{cfg.parallel.pipeline}: the pipeline stages pass only the hidden states, so "
                 "the router losses cannot reach the loss; set both to 0 (the auxiliary-loss-free "
                 "model.moe.bias_update_rate works under pipeline parallelism)")
    _require(cfg.parallel.zero_stage < 3,
             "model.moe with parallel.zero_stage=3: experts are not partitioned by ZeRO-3 here; "
             "use zero_stage 0, 1 or 2")
    _require(not cfg.log.diagnostics,
             "log.diagnostics=true with model.moe: the residual-stream diagnostics do not cover "
             "MoE blocks yet; switch one of them off")


def _check_eval_tasks(cfg: Config) -> None:
    e = cfg.eval
    _positive("eval.tasks_interval", e.tasks_interval, allow_zero=True)
    _positive("eval.tasks_limit", e.tasks_limit)
    if e.tasks is None:
        return
    _require(len(e.tasks) > 0 and all(t.strip() for t in e.tasks),
             f"eval.tasks={e.tasks!r}: a non-empty list of task names (or null for none)")
    _require(cfg.parallel.context == 1,
             f"eval.tasks with parallel.context={cfg.parallel.context}: the task evaluation runs "
             "whole sequences on each rank; use parallel.context=1 or evaluate the checkpoint "
             "with megaformer eval")


def validate(cfg: Config) -> None:
    """Cross-key checks that do not depend on the world size."""
    m, t, d = cfg.model, cfg.train, cfg.data
    for key in ("d_model", "n_layers", "n_heads", "max_seq_len", "vocab_size", "n_kv_heads", "d_ffn",
                "sliding_window"):
        _positive(f"model.{key}", getattr(m, key))
    _positive("model.head_dim", m.__dict__.get("head_dim"))
    _require(m.__dict__.get("head_dim") is not None or m.d_model % m.n_heads == 0,
             f"model.d_model={m.d_model}: must be divisible by model.n_heads={m.n_heads} "
             "(or set model.head_dim)")
    _require(m.n_heads % m.kv_heads == 0,
             f"model.n_heads={m.n_heads}: must be divisible by model.n_kv_heads={m.kv_heads}")
    if m.position == "rope":
        rot = int(m.head_dim * m.rotary_fraction)
        _require(0 < m.rotary_fraction <= 1,
                 f"model.rotary_fraction={m.rotary_fraction}: must be in (0, 1]")
        _require(rot >= 2 and rot % 2 == 0,
                 f"model.rotary_fraction={m.rotary_fraction}: rotary dims per head "
                 f"({m.head_dim} * fraction = {rot}) must be even and >= 2")
        _positive("model.rope_theta", m.rope_theta)
        check_rope_scaling(m.rope_scaling)
    else:
        _require(m.rope_scaling is None, f"model.rope_scaling: needs model.position=rope, "
                                         f"not {m.position}")
    if m.position == "sinusoidal":
        _require(m.d_model % 2 == 0, f"model.d_model={m.d_model}: sinusoidal positions need an even width")
    for key in ("dropout", "attention_dropout"):
        v = getattr(m, key)
        _require(0 <= v < 1, f"model.{key}={v}: must be in [0, 1)")
    _positive("model.norm_eps", m.norm_eps)
    _positive("model.init_std", m.init_std)
    _positive("model.loss_chunk_tokens", m.loss_chunk_tokens, allow_zero=True)
    for key, on in (("model.loss_chunk_tokens", m.loss_chunk_tokens > 0),
                    ("model.document_mask", m.document_mask)):
        _require(not (on and cfg.parallel.pipeline > 1),
                 f"{key}: not supported with parallel.pipeline={cfg.parallel.pipeline} "
                 "(the pipeline stages pass only the hidden states); use pipeline 1 or turn it off")

    _check_moe(cfg)

    p = cfg.parallel
    _positive("parallel.tensor", p.tensor)
    _positive("parallel.pipeline", p.pipeline)
    _positive("parallel.vocab_multiple", p.vocab_multiple)
    _positive("parallel.context", p.context)
    _positive("parallel.expert", p.expert)
    _check_tensor_parallel(cfg)
    _check_pipeline(cfg)
    _check_context(cfg)
    _check_expert(cfg)
    _check_fp8(cfg)

    _positive("data.seq_len", d.seq_len)
    _require(cfg.seq_len <= m.max_seq_len,
             f"data.seq_len={cfg.seq_len}: longer than model.max_seq_len={m.max_seq_len} "
             "(the position table)")
    _require(0 < d.valid_fraction < 1, f"data.valid_fraction={d.valid_fraction}: must be in (0, 1)")
    _positive("data.max_bytes", d.max_bytes)

    for key in ("steps", "micro_batch_size", "global_batch_size", "lr"):
        _positive(f"train.{key}", getattr(t, key))
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "adam_eps"):
        _positive(f"train.{key}", getattr(t, key), allow_zero=True)
    _positive("train.recompute_every", t.recompute_every)
    _positive("train.max_bad_steps", t.max_bad_steps)
    _positive("train.exit_after_minutes", t.exit_after_minutes)
    _positive("train.watchdog_factor", t.watchdog_factor, allow_zero=True)
    _positive("train.watchdog_min_seconds", t.watchdog_min_seconds)
    _positive("parallel.collective_timeout_minutes", p.collective_timeout_minutes)
    _require(t.global_batch_size % t.micro_batch_size == 0,
             f"train.global_batch_size={t.global_batch_size}: must be a multiple of "
             f"train.micro_batch_size={t.micro_batch_size}")
    _require(t.min_lr <= t.lr, f"train.min_lr={t.min_lr}: must not exceed train.lr={t.lr}")
    _require(0 <= t.decay_fraction <= 1, f"train.decay_fraction={t.decay_fraction}: must be in [0, 1]")
    for key in ("adam_beta1", "adam_beta2"):
        v = getattr(t, key)
        _require(0 <= v < 1, f"train.{key}={v}: must be in [0, 1)")

    _positive("eval.interval", cfg.eval.interval, allow_zero=True)
    _positive("eval.iters", cfg.eval.iters)
    _check_eval_tasks(cfg)
    _positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    _positive("log.interval", cfg.log.interval)
    _positive("log.sample_tokens", cfg.log.sample_tokens, allow_zero=True)
    _positive("log.peak_tflops", cfg.log.peak_tflops)
    _positive("log.diagnostics_interval", cfg.log.diagnostics_interval)
    _require(not (cfg.log.diagnostics and cfg.parallel.zero_stage == 3),
             "log.diagnostics=true with parallel.zero_stage=3: ZeRO-3 partitions the weights the "
             "diagnostics pass runs with; use parallel.zero_stage<=2 or switch diagnostics off")
    _require(not (cfg.log.diagnostics and cfg.model.document_mask),
             "log.diagnostics=true with model.document_mask=true: the diagnostics pass measures "
             "plain causal attention, not attention within documents; switch one of them off")
    if cfg.log.gpu is not None and cfg.log.peak_tflops is None:
        from megaformer.accelerators import UnknownGPUError, find_accelerator

        try:
            find_accelerator(cfg.log.gpu).peak(t.precision)
        except UnknownGPUError as e:
            raise ConfigError(f"log.gpu={cfg.log.gpu!r}: {e}") from None

    for key in cfg.deepspeed:
        if key in DERIVED_DEEPSPEED_KEYS:
            raise ConfigError(f"deepspeed.{key}: derived by megaformer; set "
                              f"{DERIVED_DEEPSPEED_KEYS[key]} instead")
    zo = cfg.deepspeed.get("zero_optimization")
    if isinstance(zo, dict) and "stage" in zo:
        raise ConfigError("deepspeed.zero_optimization.stage: set parallel.zero_stage instead")
    check_deepspeed_section(cfg.deepspeed)


def validate_for_training(cfg: Config) -> None:
    """Checks of what ``megaformer train`` runs through DeepSpeed (not needed by bench, flops or
    plan, which read the same config without DeepSpeed)."""
    _require(not (cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 0),
             "train.precision=bf16 with parallel.zero_stage=0: DeepSpeed accumulates bf16 gradients "
             "in bf16 (with loss scaling) without ZeRO; use parallel.zero_stage=1 (fp32 "
             "accumulation; at one data-parallel rank it partitions nothing)")


def validate_for_world(cfg: Config, world_size: int) -> int:
    """Checks that need the world size; returns the gradient-accumulation steps."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * p.context
    what = "parallel.tensor * parallel.pipeline" + (" * parallel.context" if p.context > 1 else "")
    _require(world_size % model_parallel == 0,
             f"world size {world_size}: not divisible by {what} = {model_parallel}")
    dp = world_size // model_parallel
    _require(dp % p.expert == 0,
             f"parallel.expert={p.expert}: must divide the data-parallel size {dp} (world size "
             f"{world_size} / {what} = {model_parallel})")
    per_step = t.micro_batch_size * dp
    _require(t.global_batch_size % per_step == 0,
             f"train.global_batch_size={t.global_batch_size}: must be a multiple of "
             f"train.micro_batch_size * data-parallel size = {t.micro_batch_size} * {dp} = {per_step}")
    return t.global_batch_size // per_step


def describe_keys() -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every config key, in declaration order."""
    rows = []

    def add(prefix: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):  # a nested section: its keys, dotted
                add(f"{prefix}.{f.name}", hints[f.name])
                continue
            choices = f.metadata.get("choices")
            doc = f.metadata.get("doc", "")
            if choices:
                doc += " One of: " + ", ".join(str(c) for c in choices) + "."
            default = f.default
            rows.append((f"{prefix}.{f.name}", _type_name(hints[f.name]),
                         "null" if default is None else repr(default).strip("'"), doc))

    for section, cls in SECTIONS.items():
        add(section, cls)
    rows.append(("deepspeed", "dict", "{}", "Passed through into the derived DeepSpeed config "
                 "(deep-merged); batch, precision, clipping and ZeRO-stage keys are derived from the "
                 "sections above and refused here. Only these reviewed keys are accepted (any other, "
                 "e.g. checkpoint, monitors, NVMe offload or torch_autocast, is refused by name; "
                 "DeepSpeed's universal-checkpoint loading is always off): "
                 + deepspeed_keys_doc() + "."))
    return rows
