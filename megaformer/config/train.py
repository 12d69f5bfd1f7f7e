"""The ``train`` section: optimisation, precision, recomputation, fault handling; and the one map
from ``train.precision`` to a torch dtype."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional

from megaformer.config.fields import option

if TYPE_CHECKING:
    import torch

Precision = Literal["fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)


def precision_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a ``train.precision`` value (or any name in :data:`PRECISIONS`):
    fp32 -> float32, bf16 -> bfloat16, fp16 -> float16."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


@dataclass
class TrainConfig:
    """Optimisation."""

    steps: int = option(100, "Optimizer steps to train for.")
    seed: int = option(1234, "Seed for initialisation, data order and dropout.")
    micro_batch_size: Optional[int] = option(
        8,
        "Sequences per micro-batch per data-parallel rank; null = global_batch_size / DP (the "
        "largest micro-batch without gradient accumulation, so one config runs on any number "
        "of data-parallel ranks that divides the global batch).",
    )
    global_batch_size: int = option(
        8,
        "Sequences per optimizer step over all ranks = micro_batch_size * grad. accumulation * DP.",
    )
    lr: float = option(3e-4, "Peak learning rate.")
    min_lr: float = option(0.0, "Final learning rate of the cosine/linear/wsd decay.")
    lr_schedule: Literal["cosine", "linear", "wsd", "constant"] = option(
        "cosine", "LR schedule after warmup."
    )
    warmup_steps: int = option(0, "Linear warmup steps from 0 to lr.")
    decay_fraction: float = option(0.2, "wsd only: fraction of the steps spent in the final decay.")
    weight_decay: float = option(
        0.1, "AdamW weight decay (not applied to norms, biases, embeddings)."
    )
    adam_beta1: float = option(0.9, "AdamW beta1.")
    adam_beta2: float = option(0.95, "AdamW beta2.")
    adam_eps: float = option(1e-8, "AdamW epsilon.")
    adam_impl: Literal["auto", "fused", "foreach"] = option(
        "auto",
        "AdamW implementation: fused (torch's one-pass kernel per parameter: reads p, g, m, v "
        "once), foreach (torch's multi-tensor "
        "ops, one pass per operation) or auto (fused when every parameter is a floating "
        "tensor on CPU or CUDA, else foreach). Same update either way up to rounding.",
    )
    optimizer: Literal["adamw", "muon"] = option(
        "adamw",
        "adamw, or muon: momentum orthogonalised by Newton-Schulz on the blocks' matrices "
        "(attention and FFN weights, experts one matrix each), AdamW on the rest (embeddings, "
        "output head, norms, biases, router and train.muon_adamw_params); see "
        "docs/optimizers.md.",
    )
    muon_lr: Optional[float] = option(
        None,
        "Muon's peak learning rate (null = train.lr: the update is scaled to AdamW's RMS, "
        "0.2 sqrt(max(m, n)), so AdamW's rate carries over). Follows the same schedule.",
    )
    muon_momentum: float = option(0.95, "Muon's momentum mu (m <- mu m + g).")
    muon_nesterov: bool = option(True, "Muon orthogonalises g + mu m (Nesterov) instead of m.")
    muon_ns_steps: int = option(5, "Newton-Schulz iterations per Muon update.")
    muon_adamw_params: Optional[list[str]] = option(
        None,
        "Names containing any of these substrings go to AdamW even when they are block "
        "matrices (e.g. [attn.wo] or [mlp.experts]); embeddings, the output head, router, "
        "norms and biases always do (null = no others).",
    )
    optimizer_reset: bool = option(
        False,
        "On resume, start the optimizer state from zero, keeping the checkpoint's weights, step "
        "and data position; needed to resume a checkpoint written by another train.optimizer "
        "(that resume is an error otherwise).",
    )
    grad_clip: float = option(1.0, "Clip the global gradient norm to this value; 0 disables.")
    recompute: Literal["none", "full", "selective"] = option(
        "none",
        "Activation checkpointing: none; full (keep only each checkpointed block's input, "
        "recompute the block in backward); selective (recompute only the attention core "
        "softmax(QK^T)V, Megatron's selective recomputation).",
    )
    recompute_every: int = option(
        1, "full recompute only: checkpoint every k-th block (1 = every block)."
    )
    precision: Precision = option(
        "fp32",
        "Training precision (bf16/fp16 with fp32 master weights; fp16 with dynamic loss scaling).",
    )
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto", "auto (CUDA when available, else CPU), cpu or cuda."
    )
    cpu_malloc: Literal["tuned", "default"] = option(
        "tuned",
        "CPU runs on glibc: tuned keeps freed memory in the process heap (mallopt: no mmap-ed "
        "chunks, no trimming) so each step reuses the last step's pages instead of faulting "
        "in fresh zero-filled ones (~100k page faults per quickstart step otherwise); "
        "default leaves glibc's settings. No effect on CUDA runs.",
    )
    compile: bool = option(
        False,
        "torch.compile each Transformer block (off by default: the first steps pay the "
        "compilation; measure with tools/bench_gpu.py before turning it on).",
    )
    max_bad_steps: int = option(
        5,
        "A step whose loss or gradient norm is inf/NaN on any rank is skipped (no update; its data "
        "is consumed, the LR schedule does not advance) and counted as skipped_steps; this many "
        "in a row stop the run with an error (1 = stop at the first).",
    )
    exit_after_minutes: Optional[float] = option(
        None,
        "Save a checkpoint and exit 0 at the first step boundary after this many minutes, as on "
        "SIGTERM/SIGUSR1 (null = no time limit).",
    )
    watchdog_factor: float = option(
        20.0,
        "Hang watchdog: a step running longer than max(watchdog_min_seconds, watchdog_factor x "
        "median step time) dumps every thread's stack to RUN_DIR/logs/rank_N.log and exits "
        "with code 3 (0 = no watchdog).",
    )
    watchdog_min_seconds: float = option(
        600.0, "Hang watchdog: the least time a step may take before the watchdog fires."
    )
    fp8: Literal["off", "tensorwise", "rowwise"] = option(
        "off",
        "FP8 training of the blocks' linear layers (q/k/v, attention output, FFN, MoE shared "
        "and routed experts; not the embedding, output head or router): tensorwise (one "
        "dynamic scale per tensor) or rowwise (one per row, power-of-two scales; the routed "
        "experts are always rowwise). Each cast is a compiled function of its own, with or "
        "without train.compile. Master weights, optimizer and everything else stay in "
        "train.precision. Needs a GPU with FP8 GEMMs (CUDA capability >= 8.9) unless "
        "train.fp8_emulate=true; see docs/fp8.md.",
    )
    fp8_emulate: bool = option(
        False,
        "train.fp8 without FP8 hardware: the same casts and scales, the GEMMs dequantised "
        "and run in fp32 (same numbers as FP8 GEMMs up to accumulation order, no speed-up; "
        "for tests and CPU runs). No effect when train.fp8=off.",
    )
    fp8_demote_threshold: float = option(
        0.0,
        "Per-layer FP8 demotion (0: off): every log.diagnostics_interval steps each block runs "
        "the diagnostics micro-batch in FP8 and in high precision from the same input; a block "
        "whose gap (relative change of the residual RMS or of the largest attention logit) "
        "exceeds this at train.fp8_demote_intervals consecutive passes runs in high precision "
        "from then on (logged, kept in the checkpoint). Needs log.diagnostics=true.",
    )
    fp8_demote_intervals: int = option(
        2, "Consecutive diagnostics passes above train.fp8_demote_threshold that demote a block."
    )
