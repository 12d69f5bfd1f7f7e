"""Static checks of the run's other sections: data, train, eval, checkpoint, log, deepspeed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megaformer.config.checks.common import positive, require
from megaformer.config.deepspeed import DERIVED_DEEPSPEED_KEYS, check_deepspeed_section
from megaformer.errors import ConfigError

if TYPE_CHECKING:
    from megaformer.config.root import Config


def check_data(cfg: Config) -> None:
    """Sequence length against the position table, the held-out fraction."""
    m, d = cfg.model, cfg.data
    positive("data.seq_len", d.seq_len)
    require(
        cfg.seq_len <= m.max_seq_len,
        f"data.seq_len={cfg.seq_len}: longer than model.max_seq_len={m.max_seq_len} "
        "(the position table)",
    )
    require(0 < d.valid_fraction < 1, f"data.valid_fraction={d.valid_fraction}: must be in (0, 1)")
    positive("data.max_bytes", d.max_bytes)


def check_train(cfg: Config) -> None:
    """Steps, batch sizes, learning rate and optimizer, watchdog."""
    t = cfg.train
    for key in ("steps", "micro_batch_size", "global_batch_size", "lr"):
        positive(f"train.{key}", getattr(t, key))
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "adam_eps"):
        positive(f"train.{key}", getattr(t, key), allow_zero=True)
    positive("train.recompute_every", t.recompute_every)
    positive("train.max_bad_steps", t.max_bad_steps)
    positive("train.exit_after_minutes", t.exit_after_minutes)
    positive("train.watchdog_factor", t.watchdog_factor, allow_zero=True)
    positive("train.watchdog_min_seconds", t.watchdog_min_seconds)
    require(
        t.micro_batch_size is None or t.global_batch_size % t.micro_batch_size == 0,
        f"train.global_batch_size={t.global_batch_size}: must be a multiple of "
        f"train.micro_batch_size={t.micro_batch_size}",
    )
    require(t.min_lr <= t.lr, f"train.min_lr={t.min_lr}: must not exceed train.lr={t.lr}")
    require(
        0 <= t.decay_fraction <= 1, f"train.decay_fraction={t.decay_fraction}: must be in [0, 1]"
    )
    for key in ("adam_beta1", "adam_beta2"):
        v = getattr(t, key)
        require(0 <= v < 1, f"train.{key}={v}: must be in [0, 1)")
    check_muon(cfg)


def check_muon(cfg: Config) -> None:
    """Muon's hyperparameters, and the layouts its distributed update covers."""
    t = cfg.train
    positive("train.muon_lr", t.muon_lr)
    positive("train.muon_ns_steps", t.muon_ns_steps)
    require(0 <= t.muon_momentum < 1, f"train.muon_momentum={t.muon_momentum}: must be in [0, 1)")
    if t.optimizer != "muon":
        return
    require(
        cfg.parallel.zero_stage < 3,
        "train.optimizer=muon with parallel.zero_stage=3: Newton-Schulz needs each whole "
        "matrix on one rank, ZeRO-3 keeps only slices; use zero_stage 1 or 2 (Muon then "
        "assigns whole matrices to data-parallel ranks)",
    )
    require(
        t.precision == "fp32",
        f"train.optimizer=muon with train.precision={t.precision}: Muon keeps no separate "
        "fp32 master weights yet; use train.precision=fp32",
    )


def check_outputs(cfg: Config) -> None:
    """Evaluation, checkpoints and logging."""
    t = cfg.train
    positive("eval.interval", cfg.eval.interval, allow_zero=True)
    positive("eval.iters", cfg.eval.iters)
    check_eval_tasks(cfg)
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    positive("log.interval", cfg.log.interval)
    positive("log.sample_tokens", cfg.log.sample_tokens, allow_zero=True)
    positive("log.peak_tflops", cfg.log.peak_tflops)
    positive("log.diagnostics_interval", cfg.log.diagnostics_interval)
    positive("log.straggler_interval", cfg.log.straggler_interval, allow_zero=True)
    positive("log.straggler_threshold", cfg.log.straggler_threshold)
    positive("log.memory_snapshot_step", cfg.log.memory_snapshot_step)
    steps = cfg.log.profile_steps
    require(
        steps is None or (len(steps) == 2 and 1 <= steps[0] <= steps[1]),
        f"log.profile_steps={steps}: expected [FIRST, LAST] with 1 <= FIRST <= LAST",
    )
    require(
        all(r >= 0 for r in cfg.log.profile_ranks or []),
        f"log.profile_ranks={cfg.log.profile_ranks}: ranks are >= 0",
    )
    require(
        not (cfg.log.diagnostics and cfg.parallel.zero_stage == 3),
        "log.diagnostics=true with parallel.zero_stage=3: ZeRO-3 partitions the weights the "
        "diagnostics pass runs with; use parallel.zero_stage<=2 or switch diagnostics off",
    )
    require(
        not (cfg.log.diagnostics and cfg.model.document_mask),
        "log.diagnostics=true with model.document_mask=true: the diagnostics pass measures "
        "plain causal attention, not attention within documents; switch one of them off",
    )
    if cfg.log.gpu is not None and cfg.log.peak_tflops is None:
        from megaformer.accelerators import UnknownGPUError, find_accelerator

        try:
            find_accelerator(cfg.log.gpu).peak(t.precision)
        except UnknownGPUError as e:
            raise ConfigError(f"log.gpu={cfg.log.gpu!r}: {e}") from None


def check_deepspeed(cfg: Config) -> None:
    """The pass-through ``deepspeed`` section: no derived key, only reviewed ones."""
    for key in cfg.deepspeed:
        if key in DERIVED_DEEPSPEED_KEYS:
            raise ConfigError(
                f"deepspeed.{key}: derived by megaformer; set {DERIVED_DEEPSPEED_KEYS[key]} instead"
            )
    zo = cfg.deepspeed.get("zero_optimization")
    if isinstance(zo, dict) and "stage" in zo:
        raise ConfigError("deepspeed.zero_optimization.stage: set parallel.zero_stage instead")
    check_deepspeed_section(cfg.deepspeed)


def check_eval_tasks(cfg: Config) -> None:
    e = cfg.eval
    positive("eval.tasks_interval", e.tasks_interval, allow_zero=True)
    positive("eval.tasks_limit", e.tasks_limit)
    if e.tasks is None:
        return
    require(
        len(e.tasks) > 0 and all(t.strip() for t in e.tasks),
        f"eval.tasks={e.tasks!r}: a non-empty list of task names (or null for none)",
    )
