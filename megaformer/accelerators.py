"""Peak dense throughput per accelerator and dtype (TFLOP/s, no structured sparsity).

From the vendors' datasheets (dense figures; NVIDIA quotes sparse ones with "*", halved here).
``fp32`` is the non-tensor-core (CUDA core / vector) rate, what PyTorch's default fp32 matmul uses
(TF32 is off by default); ``tf32``, ``bf16``, ``fp16``, ``fp8`` are tensor-core (matrix) rates.
``fp8`` is the dense FP8 (e4m3/e5m2) tensor-core rate: under ``train.fp8`` MFU stays against the
bf16 peak and the FP8 peak enters only the mixed peak of the step's dtype mix
(:func:`megaformer.analysis.flops.mixed_peak`). An accelerator that is not in the table is an error (:class:`UnknownGPUError`) unless the caller
gives a peak explicitly: megaformer never falls back to an A100 figure silently.

Also per device: memory (GB) and the per-GPU unidirectional bandwidths the planner assumes
(GB/s): ``intra`` within a node (NVLink / Infinity Fabric / PCIe), ``inter`` between nodes (one
400 Gb/s NIC per GPU = 50 GB/s on Hopper/Blackwell/MI300X, 200 Gb/s HDR on A100/V100).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megaformer.errors import UserError

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")


class UnknownGPUError(UserError):
    """An accelerator name that is not in the peak table (and no explicit peak was given)."""


@dataclass(frozen=True)
class Accelerator:
    name: str
    peaks: dict  # dtype -> dense TFLOP/s
    memory_gb: float
    intra_gbps: float  # unidirectional per GPU, within a node
    inter_gbps: float  # unidirectional per GPU, between nodes
    source: str

    def peak(self, dtype: str) -> float:
        if dtype not in self.peaks:
            raise UnknownGPUError(
                f"no {dtype} peak for {self.name} in the table (it has "
                f"{', '.join(self.peaks)}); pass --peak-tflops"
            )
        return self.peaks[dtype]


def _a(name, fp32, tf32, bf16, fp8, mem, intra, inter, source) -> Accelerator:
    peaks = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": bf16}
    if fp8:
        peaks["fp8"] = fp8
    return Accelerator(name, {k: v for k, v in peaks.items() if v}, mem, intra, inter, source)


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a
    for a in (
        Accelerator(
            "V100-SXM2", {"fp32": 15.7, "fp16": 125.0}, 32, 150, 12.5, "NVIDIA V100 datasheet"
        ),
        _a("A100-SXM", 19.5, 156, 312, None, 80, 300, 25, "NVIDIA A100 datasheet (SXM4)"),
        _a("A100-PCIe", 19.5, 156, 312, None, 80, 32, 25, "NVIDIA A100 datasheet (PCIe Gen4 x16)"),
        _a("A10", 31.2, 62.5, 125, None, 24, 32, 12.5, "NVIDIA A10 datasheet"),
        _a("L4", 30.3, 60, 121, 242, 24, 32, 12.5, "NVIDIA L4 datasheet"),
        _a("L40S", 91.6, 183, 362, 733, 48, 32, 25, "NVIDIA L40S datasheet"),
        _a("H100-SXM", 67, 494.5, 989.5, 1979, 80, 450, 50, "NVIDIA H100 datasheet (SXM5)"),
        _a("H100-PCIe", 51, 378, 756, 1513, 80, 64, 50, "NVIDIA H100 datasheet (PCIe Gen5 x16)"),
        _a("H100-NVL", 60, 417.5, 835, 1670, 94, 300, 50, "NVIDIA H100 NVL datasheet (per GPU)"),
        _a("H200", 67, 494.5, 989.5, 1979, 141, 450, 50, "NVIDIA H200 datasheet (SXM)"),
        _a("H200-NVL", 60, 417.5, 835, 1670, 141, 450, 50, "NVIDIA H200 NVL datasheet"),
        _a("GH200", 67, 494.5, 989.5, 1979, 96, 450, 50, "NVIDIA GH200 datasheet (H100 part)"),
        _a("B200", 75, 1100, 2250, 4500, 180, 900, 50, "NVIDIA HGX B200 datasheet (per GPU)"),
        _a("MI250X", 95.7, None, 383, None, 128, 200, 25, "AMD Instinct MI250X datasheet (matrix)"),
        _a("MI300X", 163.4, 653.7, 1307.4, 2614.9, 192, 448, 50, "AMD Instinct MI300X datasheet"),
        _a("MI325X", 163.4, 653.7, 1307.4, 2614.9, 256, 448, 50, "AMD Instinct MI325X datasheet"),
    )
}

# Patterns over the normalised name (lower case, only [a-z0-9]); first match wins. They accept the
# table's names and what torch.cuda.get_device_name() reports ("NVIDIA H100 80GB HBM3",
# "NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe", "AMD Instinct MI300X").
_PATTERNS: list[tuple[str, str]] = [
    (r"v100", "V100-SXM2"),
    (r"a100.*pcie", "A100-PCIe"),
    (r"a100", "A100-SXM"),
    (r"a10g?$|a10g?\d*gb", "A10"),
    (r"l40s", "L40S"),
    (r"^l4$|^nvidial4$", "L4"),
    (r"gh200", "GH200"),
    (r"h100.*pcie", "H100-PCIe"),
    (r"h100.*nvl", "H100-NVL"),
    (r"h100", "H100-SXM"),
    (r"h200.*nvl", "H200-NVL"),
    (r"h200", "H200"),
    (r"b200", "B200"),
    (r"mi250x?", "MI250X"),
    (r"mi300x", "MI300X"),
    (r"mi325x", "MI325X"),
]


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_accelerator(name: str) -> Accelerator:
    """The table entry for ``name`` (case and punctuation ignored); UnknownGPUError if none."""
    key = _normalise(name)
    for pattern, target in _PATTERNS:
        if key and re.search(pattern, key):
            return ACCELERATORS[target]
    raise UnknownGPUError(
        f"unknown GPU {name!r}: not in the peak table "
        f"({', '.join(ACCELERATORS)}); give its peak with --peak-tflops "
        "(or log.peak_tflops in training)"
    )


def peak_tflops(
    gpu: Optional[str], dtype: str, explicit: Optional[float] = None
) -> Optional[float]:
    """Dense peak TFLOP/s: ``explicit`` when given, else the table's value for ``gpu``; None when
    neither is given (callers then report no MFU). An unknown ``gpu`` raises."""
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if explicit is not None:
        if explicit <= 0:
            raise UserError(f"peak TFLOP/s {explicit}: must be > 0")
        return float(explicit)
    if gpu is None:
        return None
    return find_accelerator(gpu).peak(dtype)


def table() -> list[tuple[str, dict, float]]:
    """(name, {dtype: peak}, memory GB) rows for printing."""
    return [(a.name, dict(a.peaks), a.memory_gb) for a in ACCELERATORS.values()]
