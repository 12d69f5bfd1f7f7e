"""Which rank is slow: each rank times its own work per step; every interval the ranks compare.

In a synchronous step the fast ranks wait for the slow one inside a collective, so every rank's
step takes as long as the slowest's. What differs is each rank's own work, the step without the
waiting::

    CUDA:  own_r(n) = step_r(n) - comm_r(n)    (CUDA events around the step and around each
                                                collective, from the flight recorder)
    host:  own_r(n) = CPU seconds of the process over the step (a rank waiting in a gloo
                      collective, or descheduled by other jobs, spends none)

Every ``log.straggler_interval`` steps one all-gather of a few numbers per rank gives every rank
q_r, the lower quartile of own_r(n) over the interval (time lost in a few steps -- jitter, a
one-off -- does not move it; a rank slow in most steps does); a rank with
q_r > (1 + ``log.straggler_threshold``) x median_r(q_r) is named, as is a host whose ranks' median
is that much above the median host (with more than one host). Rank 0 logs the names with the host
and GPU index, adds ``straggler/*`` to the step's metrics record and keeps
``RUN_DIR/stragglers.json`` (the flagged intervals, and per host how many intervals in a row it was
flagged, which ``launch/slurm.sbatch`` reads to exclude a node from the requeued job). On the host a
rank that stalls without computing (waiting on I/O) is not a straggler by this measure: the
watchdog and the profiler show those.

CUDA events are read once per interval (the only host sync the detector adds). The detector adds
up the seconds of its own bookkeeping (``overhead_s``), reported beside the step time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Optional

import torch

from megaformer.comm import all_gather_objects
from megaformer.comm.flight import FlightRecorder
from megaformer.safe_files import json_or_none, read_text_bounded, write_atomic
from megaformer.training.loop import StepHook, StepState

log = logging.getLogger("megaformer")

STRAGGLERS_FILE = "stragglers.json"
MAX_KEPT = 1000  # flagged intervals kept in stragglers.json


def gpu_index(device: torch.device) -> Optional[int]:
    """The CUDA device index of this rank (None on the host)."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def lower_quartile(xs: list[float]) -> float:
    """The 25th percentile of ``xs`` (0 for none): a rank slow in most steps of the interval moves
    it, time lost in a few steps (scheduling jitter, a one-off) does not."""
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=4, method="inclusive")[0]


def flag(values: dict[Any, float], threshold: float) -> tuple[float, dict[Any, float]]:
    """(median, {who: value / median}) of the entries more than ``threshold`` above the median."""
    median = statistics.median(values.values())
    if median <= 0:
        return median, {}
    return median, {k: v / median for k, v in values.items() if v > (1 + threshold) * median}


class StragglerDetector(StepHook):
    """Times this rank's steps (``before_step`` .. ``after_step``) and compares the ranks every
    ``interval`` steps (a collective over ``group``: every rank runs the hook)."""

    def __init__(
        self,
        interval: int,
        threshold: float,
        recorder: FlightRecorder,
        rank: int,
        device: torch.device,
        run_dir: Path,
        group: Any = None,
    ) -> None:
        self.interval, self.threshold, self.recorder = interval, threshold, recorder
        self.rank, self.group, self.run_dir = rank, group, run_dir
        self.cuda = device.type == "cuda"
        self.me = {"host": socket.gethostname(), "gpu": gpu_index(device)}
        self.who: Optional[list[dict]] = None  # every rank's host and GPU, gathered once
        self.own: list[float] = []  # this interval's own seconds per step (host timing)
        self.pending: list[tuple[Any, Any, int, int]] = []  # CUDA: step events, collective slice
        self.step_s = 0.0
        self.overhead_s = 0.0
        self.first_step: Optional[int] = None
        self.flagged: list[dict] = []
        self.last: Optional[dict] = None
        self.in_a_row: dict[str, int] = {}
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._ev0: Any = None
        self._i0 = 0

    # ----------------------------------------------------------------------------- every step

    def before_step(self, step: int) -> None:
        t = time.perf_counter()
        if self.first_step is None:
            self.first_step = step
        if self.cuda:
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev0.record()
            self._i0 = len(self.recorder.events)
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()
        self.overhead_s += self._t0 - t

    def after_step(self, state: StepState, record: dict) -> None:
        t = time.perf_counter()
        self.step_s += t - self._t0
        if self.cuda:
            ev1 = torch.cuda.Event(enable_timing=True)
            ev1.record()
            self.pending.append((self._ev0, ev1, self._i0, len(self.recorder.events)))
        else:  # the CPU the process spent on the step: waiting in gloo and being descheduled cost none
            self.own.append(time.process_time() - self._cpu0)
        self.overhead_s += time.perf_counter() - t
        if state.step % self.interval == 0:
            self._compare(state, record)

    # ----------------------------------------------------------------------------- every interval

    def _own_seconds(self) -> list[float]:
        """This interval's own seconds per step (CUDA: read the events now, one sync)."""
        if not self.cuda:
            own, self.own = self.own, []
            return own
        pending, self.pending = self.pending, []
        comm = self.recorder.take_events()
        if not pending:
            return []
        pending[-1][1].synchronize()
        own = []
        for ev0, ev1, i0, i1 in pending:
            waited = sum(a.elapsed_time(b) for a, b in comm[i0:i1])
            own.append((ev0.elapsed_time(ev1) - waited) / 1e3)
        return own

    def _compare(self, state: StepState, record: dict) -> None:
        t = time.perf_counter()
        own = self._own_seconds()
        mine = lower_quartile(own)
        if self.who is None:
            self.who = all_gather_objects(self.me, self.group)
        cost = self.overhead_s + self.recorder.own_s
        row = torch.tensor([mine, cost, self.step_s], dtype=torch.float64)
        rows = _all_gather_rows(row, self.group)
        first, self.first_step = self.first_step, None
        result = self._judge(rows, (first or state.step, state.step))
        self.overhead_s += time.perf_counter() - t
        if self.rank == 0:
            self._report(result, state, record)

    def _judge(self, rows: torch.Tensor, steps: tuple[int, int]) -> dict:
        own = {r: float(rows[r, 0]) for r in range(rows.shape[0])}
        median, slow = flag(own, self.threshold)
        hosts: dict[str, list[float]] = {}
        for r, v in own.items():
            hosts.setdefault(self.who[r]["host"], []).append(v)
        slow_hosts: dict[str, float] = {}
        if len(hosts) > 1:
            _, slow_hosts = flag(
                {h: statistics.median(v) for h, v in hosts.items()}, self.threshold
            )
        for h in hosts:
            self.in_a_row[h] = self.in_a_row.get(h, 0) + 1 if h in slow_hosts else 0
        total_step = float(rows[:, 2].sum())
        return {
            "steps": list(steps),
            "median_own_s": median,
            "own_s": [own[r] for r in range(rows.shape[0])],
            "ranks": [
                {
                    "rank": r,
                    "host": self.who[r]["host"],
                    "gpu": self.who[r]["gpu"],
                    "own_s": own[r],
                    "ratio": ratio,
                }
                for r, ratio in sorted(slow.items(), key=lambda kv: -kv[1])
            ],
            "hosts": [{"host": h, "ratio": x} for h, x in sorted(slow_hosts.items())],
            "overhead": float(rows[:, 1].sum()) / total_step if total_step > 0 else 0.0,
        }

    def _report(self, result: dict, state: StepState, record: dict) -> None:
        a, b = result["steps"]
        for s in result["ranks"]:
            where = f"GPU {s['gpu']}" if s["gpu"] is not None else "host CPU"
            log.warning(
                "straggler: rank %d (%s, %s) needed %.3f s of its own per step in steps %d-%d, "
                "%.2fx the median %.3f s of the ranks (log.straggler_threshold %g)",
                s["rank"],
                s["host"],
                where,
                s["own_s"],
                a,
                b,
                s["ratio"],
                result["median_own_s"],
                self.threshold,
            )
        for h in result["hosts"]:
            log.warning(
                "straggler: host %s is %.2fx the median host in steps %d-%d (%d intervals in a row)",
                h["host"],
                h["ratio"],
                a,
                b,
                self.in_a_row[h["host"]],
            )
        if not record:
            record["step"] = state.step
        slowest = result["ranks"][0] if result["ranks"] else None
        record.update(
            {
                "straggler/count": len(result["ranks"]),
                "straggler/slowest_rank": slowest["rank"] if slowest else -1,
                "straggler/slowest_ratio": slowest["ratio"] if slowest else 1.0,
                "straggler/median_own_s": result["median_own_s"],
                "straggler/overhead": result["overhead"],
            }
        )
        if result["ranks"] or result["hosts"]:
            self.flagged = (self.flagged + [result])[-MAX_KEPT:]
        self.last = result
        self._write(result)

    def close(self) -> None:
        if self.rank == 0 and self.last is not None:
            log.info(
                "straggler detection: %d of its intervals named a rank or host; its own cost "
                "was %.3f%% of the step time (%s)",
                len(self.flagged),
                100 * self.last["overhead"],
                self.run_dir / STRAGGLERS_FILE,
            )

    def _write(self, last: dict) -> None:
        summary = {
            "interval": self.interval,
            "threshold": self.threshold,
            "last": last,
            "flagged": self.flagged,
            "hosts_in_a_row": self.in_a_row,
            "pid": os.getpid(),
        }
        write_atomic(self.run_dir / STRAGGLERS_FILE, json.dumps(summary, indent=1), fsync=False)


def _all_gather_rows(row: torch.Tensor, group: Any) -> torch.Tensor:
    """[world, len(row)]: every rank's ``row`` (host tensors, ``group`` takes them)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return row[None]
    out = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, row, group=group)
    return torch.stack(out)


def hosts_to_exclude(run_dir: str | Path, in_a_row: int) -> list[str]:
    """The hosts ``RUN_DIR/stragglers.json`` flagged in at least ``in_a_row`` consecutive
    intervals up to its last one (what ``launch/slurm.sbatch`` excludes from a requeued job)."""
    path = Path(run_dir) / STRAGGLERS_FILE
    if not path.is_file():
        return []
    data = json_or_none(read_text_bounded(path, 1 << 26))
    counts = data.get("hosts_in_a_row", {}) if isinstance(data, dict) else {}
    return sorted(
        h for h, n in counts.items() if isinstance(n, int) and n >= in_a_row and isinstance(h, str)
    )
