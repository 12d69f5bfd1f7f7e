"""Throughput metrics of a training run: TFLOP/s per device, MFU, HFU and peak memory.

    TFLOPs/GPU = model FLOPs per step / mean step time / world size / 1e12      (all ranks' work)
    MFU = TFLOPs/GPU / peak,   HFU = hardware TFLOPs/GPU / peak                 (only with a peak)

The peak comes from ``log.peak_tflops``, else from ``log.gpu`` looked up in the peak table (an
unknown name is a config error), else, on CUDA, from the device's own name when the table knows it.
Without a peak (every CPU, an unlisted GPU) MFU/HFU are not logged: there is no silent default.

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

from megaformer.analysis.flops import StepFlops, config_step_flops, utilisation
from megaformer.accelerators import UnknownGPUError, find_accelerator
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


def resolve_peak(cfg: Config, device: torch.device) -> tuple[Optional[float], str]:
    """(peak TFLOP/s or None, where it came from) for the run's precision."""
    dtype = cfg.train.precision
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

    @classmethod
    def for_run(cls, cfg: Config, device: torch.device, world_size: int) -> "TrainingMeter":
        peak, source = resolve_peak(cfg, device)
        return cls(config_step_flops(cfg), world_size, peak, source, device)

    def record(self, mean_step_time_s: float) -> dict:
        """tflops_per_gpu, hw_tflops_per_gpu, [mfu, hfu], peak_mem_gb for an interval."""
        u = utilisation(self.flops, mean_step_time_s, self.world_size, self.peak_tflops)
        u.pop("tokens_per_s")
        u["peak_mem_gb"] = peak_memory_bytes(self.device) / GB
        return u

    def summary(self) -> str:
        f = self.flops
        return (f"FLOPs: {f.model_per_token / 1e6:,.2f} MFLOP/token model, "
                f"{f.hardware_per_token / 1e6:,.2f} hardware (recompute, padded vocabulary) | "
                f"{f.model / 1e12:,.4g} TFLOP/step | peak: "
                + (f"{self.peak_tflops:g} TFLOP/s ({self.peak_source})" if self.peak_tflops
                   else self.peak_source))
