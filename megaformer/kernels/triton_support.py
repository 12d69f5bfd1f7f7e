"""When the Triton kernels run, and why not (one place for every fused kernel's dispatch).

A kernel runs when ``kernels`` (``model.fused_kernels``) is ``auto``, triton imports, and the
tensor is on CUDA -- or the process runs Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is imported), which executes the same kernels on CPU tensors with numpy; that is how the
tests check them on machines without a GPU. Everywhere else the torch reference runs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

logger = logging.getLogger("megaformer")

KERNEL_MODES = ("auto", "torch")
_announced: set = set()


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """(importable, why): triton is imported lazily, once; a broken install is a reason, not a crash."""
    try:
        triton = importlib.import_module("triton")
    except Exception as e:  # ImportError, or a build that fails to load its libraries
        return False, f"triton not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return True, f"triton {triton.__version__}"


def interpreting() -> bool:
    """Triton's interpreter is on (kernels run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor, kernels: str = "auto") -> bool:
    """True when the Triton kernel should run for ``x`` (see the module docstring).

    Never inside torch.compile (``train.compile``): there inductor fuses the torch ops of the
    reference into its own generated kernels, and the trace stays one graph per block."""
    if kernels != "auto" or torch.compiler.is_compiling():
        return False
    if not (x.is_cuda or (interpreting() and x.device.type == "cpu")):
        return False
    return triton_status()[0]


def announce(kernel: str, path: str) -> None:
    """Log once per process which implementation a fused kernel uses."""
    if torch.compiler.is_compiling():
        return
    if (kernel, path) not in _announced:
        _announced.add((kernel, path))
        logger.info("%s: %s", kernel, path)
