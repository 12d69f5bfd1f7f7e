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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile


@dataclass(frozen=True)
class Measured:
    peak: int      # max live bytes above the start
    end: int       # live bytes at the end above the start (what the call left allocated)
    result: Any = None


def measure(fn: Callable[[], Any]) -> Measured:
    """Run ``fn`` once under the profiler; peak and end live-bytes deltas of CPU tensors."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
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
    return [v for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]
