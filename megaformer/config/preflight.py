"""Preflight: every check of a config against the world it runs in and the device it runs on, in
one call before ``megaformer train`` builds anything.

The static checks (:mod:`megaformer.config.checks`) hold for any run of a config; these need more:
the world size (W = TP x CP x DP x PP; the data-parallel size DP = W / (TP * CP * PP) must be a
multiple of EP and divide the global batch into micro-batches), the device (fp16 needs CUDA, FP8
GEMMs need hardware that has them, a forced attention backend must run there), the DeepSpeed engine
the trainer runs (bf16 needs ZeRO for fp32 gradient accumulation) and the optional packages a
feature needs (W&B, lm-evaluation-harness). Unlike the rest of :mod:`megaformer.config` this module
asks the layers above it (kernel selection, FP8) what the device can do: it is a layer of its own,
above ``parallel`` (tests/unit/test_layering.py), imported by those that run a config (the trainer,
the CLI) and never by the config's other modules, so ``from megaformer.config.preflight import
preflight``."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

import torch

from megaformer.config.checks.launch import validate_for_training, validate_for_world
from megaformer.config.train import precision_dtype
from megaformer.errors import ConfigError
from megaformer.kernels.selection import Choice, choose, model_plan
from megaformer.parallel.fp8 import check_fp8_device

if TYPE_CHECKING:
    from megaformer.config.root import Config


@dataclass(frozen=True)
class Preflight:
    """What the checks established: the gradient-accumulation steps per optimizer step and the
    implementation of each op of a training step on this device (the start-up kernel table)."""

    grad_accum: int
    kernel_plan: list[tuple[str, Choice]]


def preflight(cfg: Config, world: int, device: Union[str, torch.device]) -> Preflight:
    """Every world- and device-dependent check of ``cfg`` for training on ``world`` ranks with
    ``device``; one-line ConfigError on the first that fails."""
    device = torch.device(device)
    grad_accum = validate_for_world(cfg, world)
    check_device(cfg, device)
    validate_for_training(cfg)
    check_packages(cfg)
    return Preflight(grad_accum, kernel_plan(cfg, device))


def check_device(cfg: Config, device: torch.device) -> None:
    """fp16 runs on CUDA only; FP8 GEMMs need a device that has them (unless emulated); the
    fixed-size expert exchange needs the grouped expert GEMM on CUDA."""
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision=fp16: needs a CUDA device; use bf16 or fp32 on CPU")
    check_fp8_device(cfg.train, device)
    p, m = cfg.parallel, cfg.model
    if p.expert > 1 and p.expert_dispatch == "padded" and device.type == "cuda":
        experts = choose(
            "experts",
            device,
            precision_dtype(cfg.train.precision),
            d_model=m.d_model,
            d_ffn=m.expert_dim // p.tensor,
        )
        if experts.impl != "grouped":
            raise ConfigError(
                "parallel.expert_dispatch=padded: the fixed-size exchange runs the experts as "
                f"grouped GEMMs, which this device cannot ({experts.reason}); use "
                "parallel.expert_dispatch=auto or splits"
            )


def check_packages(cfg: Config) -> None:
    """The optional packages the config's features need are installed (each named with its
    extra); nothing is imported."""
    if cfg.log.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "log.wandb=true: Weights & Biases is not installed: pip install megaformer[wandb]"
        )
    if cfg.eval.tasks and importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "eval.tasks: lm-evaluation-harness is not installed: pip install megaformer[eval]"
        )


def kernel_plan(cfg: Config, device: torch.device) -> list[tuple[str, Choice]]:
    """The implementation of each op of a training step here; refuses a forced attention backend
    that cannot run on ``device`` before anything is built."""
    return model_plan(
        cfg.model, device, precision_dtype(cfg.train.precision), compiled=cfg.train.compile
    )
