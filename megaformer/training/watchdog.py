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

With a :class:`~megaformer.training.hang.HangReport` it also dumps the rank's collective record
and, during that grace period, the first rank alive writes the one line naming the ranks that did
not arrive (:mod:`megaformer.training.hang`). SIGUSR2 does the same without exiting: the stacks,
the record and the line, while the run goes on (the signal wakes the watchdog's thread through
``signal.set_wakeup_fd``, so it works while the main thread is blocked inside a collective).
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

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
        hang: Any = None,
        exit_process: bool = True,
    ) -> None:
        self.factor, self.min_seconds = factor, min_seconds
        self.log_path, self.rank = log_path, rank
        self.poll_seconds = poll_seconds
        self.hang, self.exit_process = hang, exit_process
        self.fired = False
        self._wake = self._listen_sigusr2()
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
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")  # wake the thread out of its select
            except OSError:
                pass
        self._thread.join(timeout=5)
        if self._wake is not None and not self._thread.is_alive():
            read_fd, write_fd, previous_fd, previous_handler = self._wake
            signal.set_wakeup_fd(previous_fd)
            signal.signal(signal.SIGUSR2, previous_handler)
            os.close(read_fd)
            os.close(write_fd)
            self._wake = None

    def _listen_sigusr2(self) -> Optional[tuple[int, int, int, Any]]:
        """A pipe the C-level signal handler writes each signal number to (main thread only;
        None elsewhere, or when something else already listens that way)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone else's (an event loop): leave it theirs
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(write_fd)
            return None
        previous_handler = signal.signal(signal.SIGUSR2, lambda *_: None)
        return read_fd, write_fd, previous_fd, previous_handler

    def _wait(self) -> bool:
        """Sleep a poll (or until SIGUSR2); True when asked to dump. Exits the loop on close."""
        wake = self._wake
        if wake is None:
            self._stop.wait(self.poll_seconds)
            return False
        try:
            ready, _, _ = select.select([wake[0]], [], [], self.poll_seconds)
            got = os.read(wake[0], 512) if ready else b""
        except (OSError, ValueError):  # closed under us: the watchdog is closing
            return False
        return signal.SIGUSR2 in got

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._wait():
                self._report(
                    f"megaformer watchdog (rank {self.rank}): SIGUSR2 received in step "
                    f"{self._step}: stacks of all threads follow, the run goes on",
                    exit_code=None,
                )
                continue
            if self.fired:
                continue
            with self._lock:
                started, step, limit = self._started, self._step, self.limit()
            if started is None or limit is None:
                continue
            elapsed = time.monotonic() - started
            if elapsed > limit:
                median = statistics.median(self.times)
                self.fired = True
                code = EXIT_CODE if self.exit_process else None
                self._report(
                    f"megaformer watchdog (rank {self.rank}): step {step} has run "
                    f"{elapsed:.1f} s, over its limit {limit:.1f} s = max("
                    f"train.watchdog_min_seconds {self.min_seconds:g}, "
                    f"train.watchdog_factor {self.factor:g} x median step {median:.3f} s); "
                    "stacks of all threads follow"
                    + (f", exiting with code {code}" if code is not None else ""),
                    exit_code=code,
                )

    def _report(self, message: str, exit_code: Optional[int]) -> None:
        """The message and every thread's stack to the rank's log and stderr, the collective
        record dumped and the hang line concluded (with a report), then ``exit_code`` if any."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as fh:
            for out in (fh, sys.stderr):
                out.write(message + "\n")
                out.flush()
                faulthandler.dump_traceback(file=out, all_threads=True)
                out.flush()
            os.fsync(fh.fileno())
        if self.hang is not None:
            self.hang.dump()
            line = self.hang.conclude()  # waits for the other ranks' dumps
            if line is not None:
                with open(self.log_path, "a") as fh:
                    fh.write(line + "\n")
        else:
            time.sleep(EXIT_GRACE_SECONDS if exit_code is not None else 0)
        if exit_code is not None:
            os._exit(exit_code)
