"""Throughput metrics of a training run: TFLOP/s per device, MFU, HFU and peak memory.

    TFLOPs/GPU = model FLOPs per step / mean step time / world size / 1e12      (all ranks' work)
    MFU = TFLOPs/GPU / peak,   HFU = hardware TFLOPs/GPU / peak                 (only with a peak)

The peak comes from ``log.peak_tflops``, else from ``log.gpu`` looked up in the peak table (an
unknown name is a config error), else, on CUDA, from the device's own name when the table knows it.
Without a peak (every CPU, an unlisted GPU) MFU/HFU are not logged: there is no silent default.

FP8 training (``train.fp8``): MFU and HFU stay against the **bf16** peak (the convention: FP8 GEMMs
do not change the model's FLOPs, they make a step faster, so MFU can pass what bf16 would reach),
and the log says "MFU vs bf16 peak". The model TFLOP/s are also split by dtype, from the FLOPs
each does (:func:`megaformer.analysis.flops.fp8_share`; one step time, not per-kernel timings):

    fp8_tflops_per_gpu = share * TFLOPs/GPU,   hp_tflops_per_gpu = (1 - share) * TFLOPs/GPU
    mfu_mixed          = TFLOPs/GPU / mixed_peak(share, fp8 peak, bf16 peak)   (peak table only)

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` since the previous record (the caching
allocator's tensor bytes; reset after each record). On CPU, where PyTorch keeps no allocator
statistics, the process's peak resident set size (``getrusage(RUSAGE_SELF).ru_maxrss``): measured,
monotone, and including the interpreter and libraries (a few hundred MB), so an upper bound.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from megaformer.accelerators import UnknownGPUError, find_accelerator
from megaformer.analysis.flops import (
    StepFlops,
    config_step_flops,
    fp8_share,
    mixed_peak,
    utilisation,
)
from megaformer.config import Config
from megaformer.errors import ConfigError

GB = 1e9


def peak_memory_bytes(device: torch.device, reset: bool = True) -> int:
    """CUDA: max allocated bytes since the last reset (then reset); CPU: peak RSS of the process."""
    if device.type == "cuda":
        value = torch.cuda.max_memory_allocated(device)
        if reset:
            torch.cuda.reset_peak_memory_stats(device)
        return int(value)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def mfu_dtype(cfg: Config) -> str:
    """The peak column MFU is measured against: train.precision, bf16 under train.fp8."""
    return "bf16" if getattr(cfg.train, "fp8", "off") != "off" else cfg.train.precision


def fp8_peak(cfg: Config, device: torch.device) -> Optional[float]:
    """The FP8 dense peak of log.gpu (or the CUDA device), None when unknown or fp8 is off."""
    if getattr(cfg.train, "fp8", "off") == "off" or getattr(cfg.log, "peak_tflops", None):
        return None
    name = getattr(cfg.log, "gpu", None)
    if name is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    try:
        return find_accelerator(name).peaks.get("fp8") if name else None
    except UnknownGPUError:
        return None


def resolve_peak(cfg: Config, device: torch.device) -> tuple[Optional[float], str]:
    """(peak TFLOP/s or None, where it came from) for the run's precision (bf16 under fp8)."""
    dtype = mfu_dtype(cfg)
    explicit = getattr(cfg.log, "peak_tflops", None)
    gpu = getattr(cfg.log, "gpu", None)
    if explicit is not None:
        return float(explicit), "log.peak_tflops"
    if gpu is not None:
        try:
            acc = find_accelerator(gpu)
            return acc.peak(dtype), f"{acc.name} {dtype} (log.gpu)"
        except UnknownGPUError as e:
            raise ConfigError(f"log.gpu={gpu!r}: {e}") from None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            acc = find_accelerator(name)
            return acc.peak(dtype), f"{acc.name} {dtype} (detected)"
        except UnknownGPUError:
            return None, f"{name!r} is not in the peak table: set log.peak_tflops for MFU"
    return None, "no peak for a CPU: MFU not logged (set log.peak_tflops to compare)"


@dataclass
class TrainingMeter:
    """FLOPs of one optimizer step and the peak, fixed for the run; turns step times into metrics."""

    flops: StepFlops
    world_size: int
    peak_tflops: Optional[float]
    peak_source: str
    device: torch.device
    fp8_share: float = 0.0  # of the model FLOPs, under train.fp8
    fp8_peak_tflops: Optional[float] = None

    @classmethod
    def for_run(cls, cfg: Config, device: torch.device, world_size: int) -> "TrainingMeter":
        peak, source = resolve_peak(cfg, device)
        share = 0.0
        if getattr(cfg.train, "fp8", "off") != "off":
            from megaformer.parallel.fp8 import routed_experts_in_fp8

            routed = routed_experts_in_fp8(cfg.train.fp8_emulate, cfg.parallel.tensor)
            share = fp8_share(cfg.model, cfg.seq_len, routed=routed)
        return cls(
            config_step_flops(cfg), world_size, peak, source, device, share, fp8_peak(cfg, device)
        )

    def record(self, mean_step_time_s: float) -> dict:
        """tflops_per_gpu, hw_tflops_per_gpu, [mfu, hfu], peak_mem_gb for an interval; under
        FP8 also fp8_tflops_per_gpu, hp_tflops_per_gpu [, mfu_mixed]."""
        u = utilisation(self.flops, mean_step_time_s, self.world_size, self.peak_tflops)
        u.pop("tokens_per_s")
        if self.fp8_share:
            tf = u["tflops_per_gpu"]
            u["fp8_tflops_per_gpu"] = self.fp8_share * tf
            u["hp_tflops_per_gpu"] = (1 - self.fp8_share) * tf
            if self.peak_tflops and self.fp8_peak_tflops:
                u["mfu_mixed"] = tf / mixed_peak(
                    self.fp8_share, self.fp8_peak_tflops, self.peak_tflops
                )
        u["peak_mem_gb"] = peak_memory_bytes(self.device) / GB
        return u

    def summary(self) -> str:
        f = self.flops
        return (
            f"FLOPs: {f.model_per_token / 1e6:,.2f} MFLOP/token model, "
            f"{f.hardware_per_token / 1e6:,.2f} hardware (recompute, padded vocabulary) | "
            f"{f.model / 1e12:,.4g} TFLOP/step | peak: "
            + (
                f"{self.peak_tflops:g} TFLOP/s ({self.peak_source})"
                if self.peak_tflops
                else self.peak_source
            )
            + (
                f" | FP8: {100 * self.fp8_share:.1f}% of the FLOPs, MFU vs bf16 peak"
                + (f", FP8 peak {self.fp8_peak_tflops:g} TFLOP/s" if self.fp8_peak_tflops else "")
                if self.fp8_share
                else ""
            )
        )
