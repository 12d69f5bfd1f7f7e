"""Measured tensor memory on CPU, from the allocator's own record of every allocation and free.

PyTorch keeps no allocator statistics on CPU (``torch.cuda.max_memory_allocated`` has no CPU twin),
and the resident set size counts the interpreter, libraries and freed-but-cached pages. What is
exact: with ``torch.profiler.profile(profile_memory=True)`` the CPU allocator reports each
allocation (+bytes) and free (-bytes) as a ``[memory]`` event. Summing them in time order gives the
live tensor bytes at every instant; the maximum prefix sum is the peak above the bytes already
live when measurement began. This is the CPU analogue of ``max_memory_allocated`` (without the
CUDA caching allocator's block rounding), and what the estimator in
:mod:`megaformer.analysis.memory` is checked against.

Limitations: only PyTorch's CPU allocator is seen (numpy or Python objects are not, and nothing
megaformer keeps in a training step lives there); the profiler adds time, not tensor memory.

The profiler's C++ side writes to the process's stdout/stderr directly: USDT probe lines when it
starts and stops, and the CPU allocator's warning for every freed block that was allocated before
it started. :func:`measure` sends file descriptors 1 and 2 to a temporary file around the start
and stop and drops what lands there; while ``fn`` runs, stderr goes to the file and every line but
those allocator warnings is written back afterwards (so real warnings still reach the console).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class Measured:
    peak: int  # max live bytes above the start
    end: int  # live bytes at the end above the start (what the call left allocated)
    result: Any = None


#: Lines torch's allocator writes to stderr while profiling (a C++ warning per freed block that was
#: allocated before the profiler started); dropped, every other line is passed on.
_NOISE = re.compile(r"^\[W.*CPUAllocator\.cpp:\d+\] Memory block of unknown size")


def _flush_python_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


@contextlib.contextmanager
def _redirect_fds(fds: tuple[int, ...], keep: Callable[[str], bool]) -> Iterator[None]:
    """File descriptors ``fds`` go to a temporary file for the duration; afterwards the lines for
    which ``keep`` is true are written to stderr (fd 2). Python's own streams are flushed first so
    nothing printed before is lost or reordered."""
    _flush_python_streams()
    saved = [os.dup(fd) for fd in fds]
    try:
        with tempfile.TemporaryFile() as sink:
            for fd in fds:
                os.dup2(sink.fileno(), fd)
            try:
                yield
            finally:
                _flush_python_streams()
                for fd, old in zip(fds, saved):
                    os.dup2(old, fd)
                sink.seek(0)
                kept = [
                    line
                    for line in sink.read().decode(errors="replace").splitlines(True)
                    if keep(line)
                ]
                if kept:
                    os.write(2, "".join(kept).encode())
    finally:
        for old in saved:
            os.close(old)


def measure(fn: Callable[[], Any]) -> Measured:
    """Run ``fn`` once under the profiler; peak and end live-bytes deltas of CPU tensors. The
    profiler's own console output is dropped (see the module docstring); what ``fn`` prints to
    stdout is untouched, and of its stderr only the allocator's unknown-block warnings are dropped."""
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _redirect_fds((1, 2), keep=lambda line: False):
        prof.__enter__()
    try:
        with _redirect_fds((2,), keep=lambda line: not _NOISE.match(line)):
            result = fn()
    finally:
        with _redirect_fds((1, 2), keep=lambda line: False):
            prof.__exit__(None, None, None)
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return Measured(peak=peak, end=live, result=result)


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and tied weights counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]
