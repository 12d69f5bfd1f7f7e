"""Stopping cleanly: preemption signals, a time budget, and agreeing on it across ranks.

A SIGTERM (what Slurm, Kubernetes and torchrun send before killing) or SIGUSR1 (Slurm's
``--signal`` warning) only sets a flag; so does passing ``train.exit_after_minutes``. At every step
boundary the ranks combine their flags with one all-reduce (MAX) of a few integers, so when any
rank was told to stop, all of them save the same checkpoint at the same step and exit 0.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Optional, Sequence

import torch

from megaformer.runtime.collectives import collective_device

log = logging.getLogger("megaformer")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

# Codes of the stop reason, ordered: the all-reduced MAX names the strongest one.
NONE, TIME_LIMIT, SIGNAL = 0, 1, 2
REASONS = {TIME_LIMIT: "train.exit_after_minutes reached", SIGNAL: "stop signal received"}


class StopRequest:
    """Set by a signal handler or the clock; read at step boundaries."""

    def __init__(self, exit_after_minutes: Optional[float] = None) -> None:
        self.deadline = (time.monotonic() + 60 * exit_after_minutes
                         if exit_after_minutes is not None else None)
        self.signal: Optional[int] = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle SIGTERM/SIGUSR1 (main thread only; a no-op elsewhere)."""
        try:
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread
            pass

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is None:
            log.warning("received %s: saving a checkpoint at the next step boundary, then exiting",
                        signal.Signals(signum).name)
        self.signal = signum

    def local_code(self) -> int:
        if self.signal is not None:
            return SIGNAL
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return TIME_LIMIT
        return NONE


def agree_max(values: Sequence[int], group: Any = None) -> list[int]:
    """Element-wise MAX of small integers over all ranks (one all-reduce)."""
    t = torch.tensor(list(values), dtype=torch.int64)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        t = t.to(collective_device(group))  # NCCL takes device tensors only
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]
