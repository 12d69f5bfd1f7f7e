"""Host (CPU) memory allocator settings for CPU training: reuse the heap instead of faulting pages.

A training step allocates and frees the same activation tensors every step. glibc's malloc returns
a large freed block to the kernel (``munmap`` of an mmap-ed chunk, or ``sbrk`` trimming of the heap
top once more than the trim threshold is free), so the next step's allocation of the same size maps
fresh pages, and the kernel zero-fills every 4 KiB page on first touch: every step pays minor page
faults for all of its activations (docs/benchmarks.md has the count for the quickstart). With

    mallopt(M_MMAP_MAX, 0)            no chunk is mmap-ed: every block comes from the heap
    mallopt(M_TRIM_THRESHOLD, -1)     freed memory at the heap top is never handed back

each step reuses the pages of the previous one (a handful of page faults per step); the process
keeps its peak heap until it exits, which a training process reaches anyway every step. This is
what Intel's CPU training guides get from preloading jemalloc/tcmalloc, done through glibc's own
knobs (``train.cpu_malloc=tuned``, the default for CPU runs; ``default`` leaves glibc alone).
Other C libraries (musl) and non-Linux systems: nothing is changed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from megaformer.kernels.selection import announce

M_TRIM_THRESHOLD = -1  # glibc malloc.h
M_MMAP_MAX = -4

_tuned = False


def configure_host_allocator(setting: str, device: torch.device) -> str:
    """Apply ``train.cpu_malloc`` (``setting``) for a run on ``device``; returns the allocator in
    effect: "tuned" on CPU with glibc when asked for, else "default"."""
    if device.type == "cpu" and setting == "tuned" and tune_host_allocator():
        return "tuned"
    return "default"


def tune_host_allocator() -> bool:
    """Apply the settings above once per process; True when glibc accepted them."""
    global _tuned
    if _tuned:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # -1: "disables trimming completely" (mallopt(3))
    ok = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
    if ok:
        _tuned = True
        announce(
            "host allocator",
            "glibc malloc keeps freed memory: no mmap-ed chunks, no trimming "
            "(train.cpu_malloc=tuned)",
        )
    return ok
