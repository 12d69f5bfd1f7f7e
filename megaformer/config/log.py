"""The ``log`` section: console, TensorBoard, metrics.jsonl, Weights & Biases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megaformer.config.fields import option


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
        None,
        "Accelerator name for MFU/HFU (a name from the peak table, e.g. H100-SXM, A100, MI300X); "
        "null = the CUDA device's own name when the table knows it. CPUs have no peak: MFU is "
        "then not logged unless log.peak_tflops is set.",
    )
    peak_tflops: Optional[float] = option(
        None,
        "Peak dense TFLOP/s per device for the training dtype; overrides log.gpu's table value.",
    )
    diagnostics: bool = option(
        False,
        "Residual-stream diagnostics every log.diagnostics_interval steps on a fixed held-out "
        "micro-batch: per layer the RMS of the residual stream and of the attention and MLP "
        "writes, the largest attention logit and the logit-lens loss; per head the norm of "
        "its write and its attention entropy (metrics.jsonl and TensorBoard: resid/*, "
        "attn_write/*, mlp_write/*, attn/*, logit_lens/*). Off: no cost at all.",
    )
    diagnostics_interval: int = option(
        100,
        "Steps between diagnostics passes when log.diagnostics is on (one extra no-grad "
        "forward of one micro-batch each).",
    )
    straggler_interval: int = option(
        50,
        "Straggler detection: every N steps the ranks compare the time each spent per step "
        "outside collectives (its lower quartile over the interval; one all-gather of a few "
        "numbers); a rank or host more than log.straggler_threshold above the median is named in the log with its host and GPU, in "
        "metrics.jsonl/TensorBoard (straggler/*) and in RUN_DIR/stragglers.json. 0 = off.",
    )
    straggler_threshold: float = option(
        0.10, "Fraction above the median rank (or host) at which straggler detection names it."
    )
    profile_steps: Optional[list[int]] = option(
        None,
        "[FIRST, LAST]: record a torch.profiler trace of steps FIRST..LAST on the ranks of "
        "log.profile_ranks, written to RUN_DIR/profile/rank_N/ (TensorBoard's profiler plugin "
        "and Perfetto read it). null = no profiling.",
    )
    profile_ranks: Optional[list[int]] = option(
        None, "Ranks that record log.profile_steps and log.memory_snapshot_step (null = rank 0)."
    )
    memory_snapshot_step: Optional[int] = option(
        None,
        "Record the CUDA allocator's history from the start and write a memory snapshot after "
        "this step to RUN_DIR/profile/memory_rank_N.pickle on the ranks of log.profile_ranks (open it at pytorch.org/memory_viz); "
        "CUDA only: on a CPU run a one-line notice says so. null = none.",
    )
    wandb: bool = option(
        False,
        "Also log to Weights & Biases (rank 0): the metrics.jsonl scalars, the resolved "
        "config, and the report plots found in RUN_DIR/report at the end (needs pip install "
        "megaformer[wandb]; never imported when off).",
    )
    wandb_project: str = option("megaformer", "W&B project of the run.")
    wandb_mode: Literal["online", "offline"] = option(
        "online", "online (sync as it runs) or offline (files only; wandb sync uploads them later)."
    )
    wandb_dir: Optional[str] = option(
        None, "Folder under which W&B writes its files (null = the run directory: RUN_DIR/wandb)."
    )
