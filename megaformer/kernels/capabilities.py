"""What this process can run: optional packages and libraries, each probed once, lazily.

    onednn_available()   torch's oneDNN dense linear op runs (fp32 CPU GEMMs)
    triton_status()      triton imports (fused kernels on CUDA, or on CPU under its interpreter)
    interpreting()       Triton's interpreter is on (TRITON_INTERPRET=1, set before triton is imported)
    apex_status()        NVIDIA apex with its compiled CUDA extension (fused_layer_norm_cuda)
    flash_status()       the FlashAttention package to use: FA3 (Hopper), FA2 >= 2.1, flash-attn-4
    fp8_grouped_status() torchao's FP8 rowwise-scaled grouped GEMM (MoE experts under train.fp8)
    native.library()     megaformer's native CPU kernels (:mod:`megaformer.kernels.native`)

A probe that fails is a reason, never a crash: a broken optional package must not kill a run.
Which implementation of an op runs is decided from these facts by :mod:`megaformer.kernels.selection`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import os
from typing import Callable, Optional

import torch


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [""])[0]


def _try_import(module: str) -> tuple[Optional[object], str]:
    """(the module or None, why not)."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return None, f"{module} not installed"
        return importlib.import_module(module), ""
    except Exception as e:  # a broken build (ABI mismatch, missing CUDA libraries)
        return None, f"{module} failed to import: {type(e).__name__}: {_first_line(e)}"


# ----------------------------------------------------------------------------- oneDNN


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    """torch was built with oneDNN and its dense linear op gives the right answer (run once)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        return bool(torch.equal(op(x, w, None, "none", [], ""), torch.full((2, 4), 3.0)))
    except Exception:  # an op renamed or removed in another torch version: F.linear is used
        return False


# ----------------------------------------------------------------------------- torchao


@functools.lru_cache(maxsize=None)
def fp8_grouped_status() -> tuple[Optional[Callable], str]:
    """(torchao's differentiable FP8 grouped GEMM with rowwise scales, or None; why not):
    ``torchao.prototype.moe_training``'s ``_to_fp8_rowwise_then_scaled_grouped_mm`` (CUDA only;
    imported quietly: torchao reports its missing CUDA extensions on a CPU machine)."""
    import logging
    import warnings

    logger = logging.getLogger("torchao")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module, why = _try_import("torchao.prototype.moe_training.fp8_grouped_mm")
    finally:
        logger.setLevel(level)
    fn = getattr(module, "_to_fp8_rowwise_then_scaled_grouped_mm", None)
    if module is not None and fn is None:
        why = "torchao has no _to_fp8_rowwise_then_scaled_grouped_mm (torchao 0.18 or newer needed)"
    return fn, why


# ----------------------------------------------------------------------------- Triton


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """(importable, why)."""
    module, why = _try_import("triton")
    if module is None:
        return False, why
    return True, f"triton {getattr(module, '__version__', '?')}"


def interpreting() -> bool:
    """Triton's interpreter is on: its kernels run on CPU tensors (how the tests check them)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------- apex


@functools.lru_cache(maxsize=None)
def apex_status() -> tuple[Optional[object], str]:
    """(apex.normalization.fused_layer_norm or None, why). A Python-only apex build (or the
    unrelated PyPI package called "apex") lacks the ``fused_layer_norm_cuda`` extension and would
    crash at the first norm, so the extension itself must import."""
    ext, why = _try_import("fused_layer_norm_cuda")
    if ext is None:
        return None, f"NVIDIA apex with CUDA extensions not available ({why})"
    module, why = _try_import("apex.normalization.fused_layer_norm")
    if module is None:
        return None, why
    return module, "NVIDIA apex fused_layer_norm_cuda"


# ----------------------------------------------------------------------------- FlashAttention


@dataclasses.dataclass(frozen=True)
class FlashImpl:
    """One FlashAttention package: its dense and varlen entry points (layout [B, T, H, D]), and
    what they take (read once here, never inside a compiled region)."""

    name: str
    func: Callable
    varlen: Optional[Callable]
    dropout: bool  # whether it implements attention dropout
    func_window: bool = False  # whether func takes window_size (FA2 >= 2.3, FA3)
    varlen_window: bool = False

    @classmethod
    def of(
        cls, name: str, func: Callable, varlen: Optional[Callable], dropout: bool
    ) -> "FlashImpl":
        return cls(
            name,
            func,
            varlen,
            dropout,
            _takes_window(func),
            varlen is not None and _takes_window(varlen),
        )


def _takes_window(func: Callable) -> bool:
    """Whether a FlashAttention entry point takes ``window_size``."""
    import inspect

    try:
        return "window_size" in inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False


FA2_MIN_VERSION = (2, 1)  # before 2.1 the causal mask of T < S queries is aligned top-left


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


_resolved: dict[str, Optional[FlashImpl]] = {}  # "flash": what flash_status chose


@functools.lru_cache(maxsize=None)
def flash_status() -> tuple[Optional[FlashImpl], str]:
    """(the FlashAttention implementation to use or None, why): FA3's ``flash_attn_interface``
    (Hopper only), FA2's ``flash_attn`` (>= 2.1), the ``flash-attn-4`` CuTe kernels."""
    impl, why = _flash_status()
    _resolved["flash"] = impl
    return impl, why


def resolved_flash() -> Optional[FlashImpl]:
    """The implementation :func:`flash_status` chose, as a plain read: the attention op calls
    this inside compiled blocks, where an import, a signature or a cache wrapper would break the
    graph (the kernel table's choice of flash has resolved it by then)."""
    if "flash" not in _resolved:
        flash_status()
    return _resolved["flash"]


def _flash_status() -> tuple[Optional[FlashImpl], str]:
    reasons = []
    if hopper():
        fa3, why = _try_import("flash_attn_interface")
        if fa3 is not None and hasattr(fa3, "flash_attn_func"):
            return FlashImpl.of(
                "FA3 flash_attn_interface",
                fa3.flash_attn_func,
                getattr(fa3, "flash_attn_varlen_func", None),
                False,
            ), "FA3 on Hopper"
        reasons.append(why or "flash_attn_interface has no flash_attn_func")
    fa2, why = _try_import("flash_attn")
    if fa2 is not None and hasattr(fa2, "flash_attn_func"):
        version = _version_tuple(getattr(fa2, "__version__", "0"))
        if version >= FA2_MIN_VERSION:
            return FlashImpl.of(
                "FA2 flash_attn",
                fa2.flash_attn_func,
                getattr(fa2, "flash_attn_varlen_func", None),
                True,
            ), f"flash-attn {fa2.__version__}"
        reasons.append(
            f"flash-attn {getattr(fa2, '__version__', '?')} is older than 2.1 (causal "
            "masks aligned top-left)"
        )
    else:
        reasons.append(why or "flash_attn has no flash_attn_func")
    fa4, why = _try_import("flash_attn.cute")
    if fa4 is not None and hasattr(fa4, "flash_attn_func"):
        return FlashImpl.of(
            "flash-attn-4 CuTe",
            fa4.flash_attn_func,
            getattr(fa4, "flash_attn_varlen_func", None),
            False,
        ), "flash-attn-4 available"
    reasons.append(why or "flash_attn.cute has no flash_attn_func")
    return None, "; ".join(r for r in reasons if r)
