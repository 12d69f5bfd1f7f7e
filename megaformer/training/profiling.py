"""Profiler traces and CUDA memory snapshots of chosen steps, on chosen ranks.

``log.profile_steps=[a, b]``: :class:`ProfileSteps` records steps a..b with ``torch.profiler``
(host ops, and CUDA kernels on CUDA; one ``megaformer step n`` span per step) on the ranks of
``log.profile_ranks`` and writes ``RUN_DIR/profile/rank_N/*.pt.trace.json`` when step b ends (or
the run stops first): a Chrome trace that TensorBoard's profiler plugin and Perfetto open.

``log.memory_snapshot_step=s``: :func:`start_memory_history` turns on the CUDA allocator's history
before the model is built, and :class:`MemorySnapshot` writes it after step s to
``RUN_DIR/profile/memory_rank_N.pickle`` (``torch.cuda.memory._dump_snapshot``; drag it onto
pytorch.org/memory_viz). On a CPU run it logs one line that the snapshot needs CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer.safe_files import make_dir, refuse_link
from megaformer.training.loop import StepHook, StepState

log = logging.getLogger("megaformer")

PROFILE_DIR = "profile"
MEMORY_HISTORY_ENTRIES = 100_000


def profiled_ranks(ranks: Optional[list[int]]) -> list[int]:
    """``log.profile_ranks`` (null: rank 0)."""
    return [0] if ranks is None else list(ranks)


class ProfileSteps(StepHook):
    """``torch.profiler`` over steps ``first``..``last`` of this rank, written to ``out_dir``."""

    def __init__(self, first: int, last: int, out_dir: Path, rank: int, device: torch.device):
        self.first, self.last, self.out_dir, self.rank = first, last, out_dir, rank
        self.cuda = device.type == "cuda"
        self.prof: Optional[Any] = None
        self.written: Optional[Path] = None
        self.started = first
        self.span: Optional[Any] = None

    def before_step(self, step: int) -> None:
        if self.prof is None and self.first <= step <= self.last and self.written is None:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            make_dir(self.out_dir)  # never through a link
            self.prof = profile(
                activities=activities,
                on_trace_ready=tensorboard_trace_handler(
                    str(self.out_dir), worker_name=f"rank_{self.rank}"
                ),
            )
            self.prof.start()
            self.started = step
        if self.prof is not None:
            self.span = torch.profiler.record_function(f"megaformer step {step}")
            self.span.__enter__()

    def after_step(self, state: StepState, record: dict) -> None:
        if self.prof is None:
            return
        self._end_span()
        if state.step >= self.last or state.final:
            self._stop(state.step)

    def _end_span(self) -> None:
        if self.span is not None:
            self.span.__exit__(None, None, None)
            self.span = None

    def _stop(self, step: int) -> None:
        self.prof.stop()  # the handler writes the trace
        self.prof = None
        traces = sorted(self.out_dir.glob(f"rank_{self.rank}.*.pt.trace.json*"))
        self.written = traces[-1] if traces else self.out_dir
        log.info(
            "profile of steps %d-%d (rank %d): %s (TensorBoard's profiler plugin or "
            "ui.perfetto.dev opens it)",
            self.started,
            step,
            self.rank,
            self.written,
        )

    def close(self) -> None:
        if self.prof is not None:  # the loop ended inside the window (an error)
            self._end_span()
            self._stop(self.started)


def start_memory_history(device: torch.device) -> bool:
    """Record the CUDA allocator's history from now on (True), or nothing off CUDA (False)."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
    return True


class MemorySnapshot(StepHook):
    """After step ``step``: the CUDA allocator's snapshot to ``path`` and the history switched off;
    off CUDA, one notice line at construction and nothing after."""

    def __init__(self, step: int, path: Path, device: torch.device) -> None:
        self.step, self.path = step, path
        self.cuda = device.type == "cuda"
        self.done = False
        if not self.cuda:
            log.warning(
                "log.memory_snapshot_step=%d: a memory snapshot needs CUDA (this run is on %s): "
                "none is written",
                step,
                device.type,
            )

    def after_step(self, state: StepState, record: dict) -> None:
        if not self.cuda or self.done or state.step < self.step:
            return
        make_dir(self.path.parent)
        refuse_link(self.path)
        torch.cuda.memory._dump_snapshot(str(self.path))
        self.close()
        log.info(
            "memory snapshot after step %d: %s (open it at pytorch.org/memory_viz)",
            state.step,
            self.path,
        )

    def close(self) -> None:
        if self.cuda and not self.done:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.done = True
