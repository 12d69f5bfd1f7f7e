"""The pass-through ``deepspeed`` section: the keys megaformer derives itself (refused there) and
the allowlist of reviewed keys it passes on (:data:`DEEPSPEED_ALLOWED`)."""

from __future__ import annotations

from typing import Any, Optional

from megaformer.errors import ConfigError

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
        "reduce_bucket_size": None,
        "allgather_bucket_size": None,
        "overlap_comm": None,
        "contiguous_gradients": None,
        "reduce_scatter": None,
        "allgather_partitions": None,
        "round_robin_gradients": None,
        "sub_group_size": None,
        "stage3_prefetch_bucket_size": None,
        "stage3_param_persistence_threshold": None,
        "stage3_max_live_parameters": None,
        "stage3_max_reuse_distance": None,
        "stage3_gather_16bit_weights_on_model_save": None,
        "offload_optimizer": _OFFLOAD,
        "offload_param": _OFFLOAD,
    },
    "communication_data_type": None,
    "prescale_gradients": None,
    "gradient_predivide_factor": None,
    "zero_allow_untested_optimizer": None,
    "zero_force_ds_cpu_optimizer": None,
    "steps_per_print": None,
    "wall_clock_breakdown": None,
    "memory_breakdown": None,
    "pipeline": {"pipe_partitioned": None, "grad_partitioned": None},
    "data_types": {"grad_accum_dtype": None},
    "comms_logger": {"enabled": None, "verbose": None, "prof_all": None, "debug": None},
    "flops_profiler": {
        "enabled": None,
        "profile_step": None,
        "module_depth": None,
        "top_modules": None,
        "detailed": None,
    },
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


def check_deepspeed_section(
    ds: Any, allowed: Optional[dict] = None, prefix: str = "deepspeed"
) -> None:
    """Raise ConfigError naming the first ``deepspeed:`` key (or value) that is not reviewed."""
    allowed = DEEPSPEED_ALLOWED if allowed is None else allowed
    if not isinstance(ds, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(ds).__name__}")
    for key, value in ds.items():
        name = f"{prefix}.{key}"
        if key not in allowed:
            raise ConfigError(
                f"{name}: not a DeepSpeed key megaformer accepts (accepted here: "
                f"{', '.join(allowed)})"
            )
        rule = allowed[key]
        if isinstance(rule, dict):
            check_deepspeed_section(value, rule, name)
            continue
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise ConfigError(
                f"{name}={value!r}: expected a single value, got {type(value).__name__}"
            )
        if isinstance(rule, set) and value not in rule:
            raise ConfigError(f"{name}={value!r}: must be one of {', '.join(sorted(rule))}")
