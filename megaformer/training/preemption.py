"""Stopping cleanly: preemption signals, a time budget, and agreeing on it across ranks.

A SIGTERM (what Slurm, Kubernetes and torchrun send before killing) or SIGUSR1 (Slurm's
``--signal`` warning) only sets a flag; so does passing ``train.exit_after_minutes``. At every step
boundary the ranks combine their flags with one all-reduce (MAX) of a few integers, so when any
rank was told to stop, all of them save the same checkpoint at the same step and exit 0.

Ctrl-C (SIGINT) does the same and exits 130 (interrupted); a second SIGINT at least
:data:`REPEAT_S` seconds after the first raises KeyboardInterrupt at once, without saving. (A
terminal's Ctrl-C reaches a rank twice under torchrun, directly and forwarded by the launcher, a
few milliseconds apart: that counts as one.)
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Any, Optional, Sequence

import torch

from megaformer.runtime.collectives import collective_device

log = logging.getLogger("megaformer")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_S = 1.0  # a SIGINT this soon after the first is the same Ctrl-C

# Codes of the stop reason, ordered: the all-reduced MAX names the strongest one.
NONE, TIME_LIMIT, SIGNAL, INTERRUPT = 0, 1, 2, 3
REASONS = {
    TIME_LIMIT: "train.exit_after_minutes reached",
    SIGNAL: "stop signal received",
    INTERRUPT: "interrupted (SIGINT)",
}
INTERRUPTED = REASONS[INTERRUPT]


class StopRequest:
    """Set by a signal handler or the clock; read at step boundaries."""

    def __init__(self, exit_after_minutes: Optional[float] = None) -> None:
        self.deadline = (
            time.monotonic() + 60 * exit_after_minutes if exit_after_minutes is not None else None
        )
        self.signal: Optional[int] = None
        self.interrupted_at: Optional[float] = None  # monotonic time of the first SIGINT
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Handle SIGTERM/SIGUSR1/SIGINT (main thread only; a no-op elsewhere)."""
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
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self.interrupted_at is not None:
                if now - self.interrupted_at >= REPEAT_S:
                    raise KeyboardInterrupt  # the second Ctrl-C: stop now
                return
            self.interrupted_at = now
        if self.signal is None:
            log.warning(
                "received %s: saving a checkpoint at the next step boundary, then exiting%s",
                signal.Signals(signum).name,
                " (Ctrl-C again to stop at once)" if signum == signal.SIGINT else "",
            )
        self.signal = signum

    def local_code(self) -> int:
        if self.interrupted_at is not None:
            return INTERRUPT
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
