"""The DeepSpeed config, derived from megaformer's config (never written twice by hand)."""

from __future__ import annotations

import copy
import gc
from typing import Any, Callable, Optional

import torch.nn as nn

from megaformer.config import Config, check_deepspeed_section


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_deepspeed_config(cfg: Config, grad_accum: int) -> dict:
    """ZeRO stage, batch sizes, precision and clipping from ``cfg``; ``cfg.deepspeed`` (its reviewed
    keys only) merged on top; universal-checkpoint loading forced off."""
    t = cfg.train
    ds = {
        # DeepSpeed counts every context-parallel rank as a data-parallel replica (they average
        # gradients together), so its batch holds each sequence once per context rank
        "train_batch_size": t.global_batch_size * cfg.parallel.context,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": t.grad_clip,
        # Muon distributes its own state (whole matrices per data-parallel rank,
        # megaformer.runtime.muon): DeepSpeed then only averages the gradients
        "zero_optimization": {"stage": cfg.parallel.zero_stage if t.optimizer == "adamw" else 0},
        # megaformer passes torch's AdamW; DeepSpeed's ZeRO wraps it (it only "tests" its own).
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {
            "enabled": t.precision == "fp16",
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    p = cfg.parallel
    if p.pipeline > 1 and ((p.sequence_parallel and p.tensor > 1) or p.pipeline_schedule != "1f1b"):
        # DeepSpeed splits the activations it sends between stages over the TP group, assuming
        # they are replicated there; under sequence parallelism each TP rank holds its own part.
        # DualPipeV and the interleaved schedule send whole activations.
        ds["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    if t.precision == "bf16":  # zero_stage >= 1 (config validation refuses bf16 without ZeRO)
        # DeepSpeed accumulates bf16 gradients over micro-batches in bf16 unless told: fp32 takes
        # ZeRO-1 (and the pipeline engine) to its bf16 optimizer and ZeRO-2/3 to fp32 accumulators
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    check_deepspeed_section(cfg.deepspeed)  # also for a Config built without validate()
    merged = deep_merge(ds, cfg.deepspeed)
    # the pass-through section is an allowlist (megaformer.config.check_deepspeed_section); loading
    # DeepSpeed's universal checkpoints (which unpickle arbitrary objects) stays off whatever it holds
    merged["checkpoint"] = {"load_universal": False}
    return merged


def zero3_partitioner(
    cfg: Config, ds_config: dict, mpu: Any
) -> Optional[Callable[[nn.Module], None]]:
    """Under ZeRO-3: what hands each module of the model, once it holds its values, to DeepSpeed's
    ``zero.Init(module=...)`` (:func:`megaformer.parallel.build.build_model`'s ``partition``), so
    a rank keeps 1/D of every parameter as the model is built, never the whole model. None below
    ZeRO-3.

    It does what ``deepspeed.initialize`` would do to a whole model: cast the parameters to the
    training precision, then partition them over the data-parallel group of ``mpu`` (the one the
    engine is given) with ``ds_config``'s settings. Each partition is a slice of the very tensor a
    one-process build holds, so the values are the same."""
    if cfg.parallel.zero_stage != 3:
        return None
    import deepspeed

    from megaformer.config import precision_dtype
    from megaformer.deepspeed_attrs import zero3_partitioned

    dtype = precision_dtype(cfg.train.precision)
    offload = ds_config.get("zero_optimization", {}).get("offload_param") or {}
    group = mpu.get_data_parallel_group() if mpu is not None else None

    def partition(module: nn.Module) -> None:
        for p in module.parameters():
            if not zero3_partitioned(p) and p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        deepspeed.zero.Init(
            module=module,
            data_parallel_group=group,
            dtype=dtype,
            config_dict_or_path=ds_config,
            mpu=mpu,
            remote_device=offload.get("device"),
            pin_memory=bool(offload.get("pin_memory", False)),
        )
        # the converted parameters and DeepSpeed's functions on them form reference cycles that
        # keep the whole tensors alive until the collector runs: free them before the next module
        gc.collect()

    return partition
