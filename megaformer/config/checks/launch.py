"""Checks of a training launch beyond the static ones: the world size against the process grid
(W = TP x CP x DP x PP, EP inside DP) and DeepSpeed's rule for bf16. Run by
:func:`megaformer.config.preflight.preflight` (and ``megaformer train --dry-run``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaformer.config.checks.common import require
from megaformer.config.checks.parallel import check_pipeline_micro_batches

if TYPE_CHECKING:
    from megaformer.config.root import Config


def validate_for_world(cfg: Config, world_size: int) -> int:
    """Checks that need the world size; returns the gradient-accumulation steps
    global_batch_size / (micro_batch_size * DP), DP = world / (TP * CP * PP). A null
    ``train.micro_batch_size`` is set here to global_batch_size / DP (accumulation 1)."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor * p.pipeline * p.context
    what = "parallel.tensor * parallel.pipeline" + (" * parallel.context" if p.context > 1 else "")
    require(
        world_size % model_parallel == 0,
        f"world size {world_size}: not divisible by {what} = {model_parallel}",
    )
    dp = world_size // model_parallel
    require(
        dp % p.expert == 0,
        f"parallel.expert={p.expert}: must divide the data-parallel size {dp} (world size "
        f"{world_size} / {what} = {model_parallel})",
    )
    if t.micro_batch_size is None:
        require(
            t.global_batch_size % dp == 0,
            f"train.global_batch_size={t.global_batch_size}: must be a multiple of the "
            f"data-parallel size {dp} (train.micro_batch_size=null splits it evenly)",
        )
        t.micro_batch_size = t.global_batch_size // dp
    per_step = t.micro_batch_size * dp
    require(
        t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size}: must be a multiple of "
        f"train.micro_batch_size * data-parallel size = {t.micro_batch_size} * {dp} = {per_step}",
    )
    grad_accum = t.global_batch_size // per_step
    check_pipeline_micro_batches(cfg, grad_accum)
    return grad_accum


def validate_for_training(cfg: Config) -> None:
    """Checks of what ``megaformer train`` runs through DeepSpeed (not needed by bench, flops or
    plan, which read the same config without DeepSpeed)."""
    require(
        not (cfg.train.precision == "bf16" and cfg.parallel.zero_stage == 0),
        "train.precision=bf16 with parallel.zero_stage=0: DeepSpeed accumulates bf16 gradients "
        "in bf16 (with loss scaling) without ZeRO; use parallel.zero_stage=1 (fp32 "
        "accumulation; at one data-parallel rank it partitions nothing)",
    )
