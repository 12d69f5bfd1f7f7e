"""``megaformer env``: what an issue report needs to know about this machine, in one table.

Like DeepSpeed's ``ds_report`` and ``python -m torch.utils.collect_env``: the versions of megaformer,
Python and the libraries it runs on (torch with its CUDA, cuDNN and NCCL builds; DeepSpeed,
flash-attn, Triton, NVIDIA apex, transformers), the GPUs this process sees with their entry in the
peak table (:mod:`megaformer.accelerators`), which implementation megaformer would run for each op
of a model (:func:`megaformer.kernels.selection.model_plan`) and the C compiler that builds the
native CPU kernels (:mod:`megaformer.kernels.native`).

Every row is filled from what is importable or on PATH; anything missing or failing becomes the
row's text ("not installed", the error), never a traceback: the report is most wanted exactly when
something is broken.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from typing import Callable, Optional

import torch

from megaformer import __version__

Row = tuple[str, str]


def _safe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as e:  # a broken installation is what this report is for
        return f"error: {type(e).__name__}: {e}".splitlines()[0]


def _dist_version(*names: str) -> Optional[str]:
    """The installed version of the first distribution of ``names`` that is installed."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _package(names: tuple[str, ...], module: str, note: str = "") -> str:
    version = _dist_version(*names)
    if version is None and importlib.util.find_spec(module) is None:
        return "not installed" + (f" ({note})" if note else "")
    return (version or "installed (version unknown)") + (f" ({note})" if note else "")


def _torch() -> str:
    build = f"CUDA build {torch.version.cuda}" if torch.version.cuda else "CPU build"
    if getattr(torch.version, "hip", None):
        build = f"ROCm build {torch.version.hip}"
    return f"{torch.__version__} ({build})"


def _cudnn() -> str:
    if not torch.backends.cudnn.is_available():
        return "not available"
    return str(torch.backends.cudnn.version())


def _nccl() -> str:
    if not torch.cuda.is_available() and not torch.version.cuda:
        return "not available (no CUDA)"
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _flash_attn() -> str:
    parts = []
    fa2 = _dist_version("flash-attn", "flash_attn")
    if fa2 is not None or importlib.util.find_spec("flash_attn") is not None:
        parts.append(f"flash_attn {fa2 or '(version unknown)'}")
    if importlib.util.find_spec("flash_attn_interface") is not None:
        parts.append(
            f"flash_attn_interface (FA3) {_dist_version('flash-attn-3', 'flash_attn_3') or ''}".strip()
        )
    if _dist_version("flash-attn-4", "flash_attn_4"):
        parts.append(f"flash-attn-4 {_dist_version('flash-attn-4', 'flash_attn_4')}")
    return ", ".join(parts) if parts else "not installed (torch SDPA runs)"


def _apex() -> str:
    if importlib.util.find_spec("apex") is None:
        return "not installed"
    fused = importlib.util.find_spec("fused_layer_norm_cuda") is not None
    return (
        "NVIDIA apex with fused_layer_norm_cuda (fused norms)"
        if fused
        else "an 'apex' without fused_layer_norm_cuda (not used: NVIDIA apex built with --cuda_ext "
        "is needed)"
    )


def gpu_rows() -> list[Row]:
    """One row per visible GPU: name, memory, and its peak-table entry."""
    from megaformer.accelerators import UnknownGPUError, find_accelerator

    if not torch.cuda.is_available():
        return [("GPUs", "none visible (torch.cuda.is_available() is False)")]
    rows = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        try:
            acc = find_accelerator(props.name)
            peaks = ", ".join(f"{k} {v:g}" for k, v in acc.peaks.items())
            entry = f"peak table: {acc.name} ({peaks} TFLOP/s dense)"
        except UnknownGPUError:
            entry = "not in the peak table (MFU needs --peak-tflops / log.peak_tflops)"
        rows.append(
            (
                f"GPU {i}",
                f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                f"compute capability {props.major}.{props.minor}; {entry}",
            )
        )
    return rows


def compiler_row() -> str:
    """``$CC`` (default ``cc``): the first line of ``--version``, or why there is none."""
    compiler = os.environ.get("CC") or "cc"
    path = shutil.which(compiler)
    if path is None:
        return f"{compiler}: not on PATH (the native CPU kernels cannot be built; torch ops run)"
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    first = (out.stdout or out.stderr).strip().splitlines()
    return f"{compiler} ({path}): {first[0] if first else 'no version output'}"


def kernel_plan(
    model_cfg: object = None, device: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> tuple[str, str]:
    """(heading, formatted plan): which implementation runs for each op of ``model_cfg`` (default:
    a default ModelConfig) on ``device`` (cuda when visible, else cpu) in ``dtype`` (bf16 on CUDA,
    fp32 on CPU)."""
    from megaformer.config import ModelConfig
    from megaformer.kernels.selection import format_plan, model_plan

    model_cfg = model_cfg if model_cfg is not None else ModelConfig()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
    autocast = dtype in (torch.bfloat16, torch.float16)
    plan = model_plan(model_cfg, device, dtype, autocast=autocast)
    return f"{device}, {str(dtype).replace('torch.', '')}", format_plan(plan)


def collect(
    model_cfg: object = None, device: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> tuple[list[Row], str, str]:
    """(rows, kernel heading, kernel plan): everything :func:`format_report` prints."""
    rows: list[Row] = [
        (
            "megaformer",
            f"{__version__} ({os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})",
        ),
        ("Python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", _safe(lambda: f"{platform.platform()}, {os.cpu_count()} CPUs")),
        ("torch", _safe(_torch)),
        ("CUDA available", _safe(lambda: str(torch.cuda.is_available()))),
        ("cuDNN", _safe(_cudnn)),
        ("NCCL", _safe(_nccl)),
        ("deepspeed", _safe(lambda: _package(("deepspeed",), "deepspeed"))),
        ("flash-attn", _safe(_flash_attn)),
        ("triton", _safe(lambda: _package(("triton",), "triton"))),
        ("apex", _safe(_apex)),
        ("transformers", _safe(lambda: _package(("transformers",), "transformers"))),
    ]
    try:
        rows.extend(gpu_rows())
    except Exception as e:  # a driver that torch cannot talk to
        rows.append(("GPUs", f"error: {type(e).__name__}: {e}".splitlines()[0]))
    rows.append(("C compiler", _safe(compiler_row)))

    def native() -> str:
        from megaformer.kernels import native as native_kernels

        text = native_kernels.status()
        return text.removeprefix("native CPU kernels: ")

    rows.append(("native CPU kernels", _safe(native)))
    try:
        heading, plan = kernel_plan(model_cfg, device, dtype)
    except Exception as e:
        heading, plan = "unavailable", f"  error: {type(e).__name__}: {e}".splitlines()[0]
    return rows, heading, plan


def format_report(rows: list[Row], heading: str, plan: str) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"kernels ({heading}):")
    lines.append(plan)
    return "\n".join(lines)
