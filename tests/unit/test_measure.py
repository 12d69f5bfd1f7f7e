"""megaformer.analysis.measure: the profiler's console noise is dropped, the measured bytes and the
measured function's own output are kept."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from megaformer.analysis.measure import measure


def _frees_an_old_block_and_allocates():
    """Frees a tensor allocated before profiling (the allocator warns about such blocks) and
    allocates 64 KiB that stay live."""
    old = [torch.ones(4096)]
    holder = {}

    def fn():
        old.clear()
        holder["t"] = torch.zeros(16384)  # 64 KiB
        print("printed by fn")
        print("a real warning", file=sys.stderr)
        return 7

    return fn


def test_raw_profiler_is_noisy(capfd):
    """The noise this module removes exists: without the redirection torch's profiler writes to the
    file descriptors (so the next test can fail)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        _frees_an_old_block_and_allocates()()
    out, err = capfd.readouterr()
    assert "profiler_st" in out + err or "unknown size" in out + err


def test_measure_prints_nothing_but_fn_output(capfd):
    m = measure(_frees_an_old_block_and_allocates())
    out, err = capfd.readouterr()
    assert out == "printed by fn\n"
    assert err == "a real warning\n"
    assert m.result == 7
    assert m.end == 16384 * 4 and m.peak >= 16384 * 4
