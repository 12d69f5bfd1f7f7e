"""A per-rank watchdog that turns a hung training step into a stack dump and a non-zero exit.

A background thread compares the time the current step has been running with

    limit = max(train.watchdog_min_seconds, train.watchdog_factor * median(recent step times))

(armed once one step has completed, so one-time start-up costs of the first step never trip it).
Past the limit it writes a line naming the step, then every thread's Python stack
(``faulthandler.dump_traceback(all_threads=True)``) to ``RUN_DIR/logs/rank_N.log`` and stderr, and
ends the process with :data:`EXIT_CODE` -- a hung collective never returns, so nothing short of
``os._exit`` gets a process out of it. Each rank runs its own watchdog: a stalled rank and the ranks
waiting for it in a collective all dump their stacks. Their steps started together (the previous
step ended in a collective), so their limits expire within a poll of each other; each waits
:data:`EXIT_GRACE_SECONDS` after its dump before exiting, so that its exit (which breaks the peers'
connections and makes the launcher stop them) does not pre-empt the other ranks' dumps.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Optional

EXIT_CODE = 3
EXIT_GRACE_SECONDS = 5.0
WINDOW = 100  # step times the running median is taken over


class StepWatchdog:
    def __init__(
        self,
        factor: float,
        min_seconds: float,
        log_path: Path,
        rank: int,
        poll_seconds: float = 0.25,
    ) -> None:
        self.factor, self.min_seconds = factor, min_seconds
        self.log_path, self.rank = log_path, rank
        self.poll_seconds = poll_seconds
        self.times: deque[float] = deque(maxlen=WINDOW)
        self._started: Optional[float] = None
        self._step = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="megaformer-watchdog", daemon=True)
        self._thread.start()

    def limit(self) -> Optional[float]:
        """Seconds a step may take now; None while unarmed (no step completed yet)."""
        if not self.times:
            return None
        return max(self.min_seconds, self.factor * statistics.median(self.times))

    def step_started(self, step: int) -> None:
        with self._lock:
            self._started, self._step = time.monotonic(), step

    def step_finished(self) -> None:
        with self._lock:
            if self._started is not None:
                self.times.append(time.monotonic() - self._started)
            self._started = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            with self._lock:
                started, step, limit = self._started, self._step, self.limit()
            if started is None or limit is None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > limit:
                median = statistics.median(self.times)
                self._fire(
                    f"megaformer watchdog (rank {self.rank}): step {step} has run "
                    f"{elapsed:.1f} s, over its limit {limit:.1f} s = max("
                    f"train.watchdog_min_seconds {self.min_seconds:g}, "
                    f"train.watchdog_factor {self.factor:g} x median step {median:.3f} s); "
                    f"stacks of all threads follow, exiting with code {EXIT_CODE}"
                )

    def _fire(self, message: str) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as fh:
            for out in (fh, sys.stderr):
                out.write(message + "\n")
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)
                out.flush()
            os.fsync(fh.fileno())
        time.sleep(EXIT_GRACE_SECONDS)
        os._exit(EXIT_CODE)
