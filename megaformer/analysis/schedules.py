"""Pipeline schedules on paper: each rank's order of forward and backward passes, the timeline it
gives with stated pass costs, its idle fraction and its activations in flight.

A schedule is, per pipeline rank r of p, the sequence of its passes ``(kind, phase)`` (kind F or
B; micro-batches are taken in order within each phase):

* ``1f1b``: w = min(p-1-r, m) forwards, then (m - w) times [F, B], then w backwards. One stage per
  rank; the bubble is (p-1)/(m+p-1) of the step.
* ``interleaved`` (interleaved 1F1B, Narayanan et al. 2021) with v stages per rank: rank r holds
  stages r, r+p, ..., r+(v-1)p (phase = chunk c), each 1/v of a 1F1B stage. Its pass order is the
  engine's own (:func:`megaformer.parallel.interleaved_schedule.rank_units`, flattened): w_r =
  min(2(p-1-r) + (v-1)p, vm) forwards, then [F, B] pairs, then w_r backwards; forwards take groups
  of p micro-batches through chunks 0..v-1, backwards through v-1..0 (m a multiple of p). The
  bubble is (p-1)/(vm+p-1).
* ``dualpipev`` (DeepSeek-V3's DualPipeV as DeepSpeed runs it): rank r holds chunk r (phase 0,
  activations go towards rank p-1) and chunk 2p-1-r (phase 1, back towards rank 0), each half of a
  1F1B stage. In order: 2(p-1-r) F0; (r+1) x [F0 F1]; (p-1-r) x [B1 F1]; (m-2p+r+1) x
  [F0 B1 F1 B0]; (p-1-r) x [B1 F1 B0]; (r+1) x [B1 B0]; (p-1-r) x B0 (m >= 2p). Weight gradients
  are not deferred (no zero-bubble W passes).

The timeline (:func:`simulate`) runs each rank's passes in order, each as soon as the rank is free
and its input is ready. Interleaved: F(c, j) on rank r after F(c, j) on r-1, or after F(c-1, j)
on rank p-1 when r = 0; the loss's backward B(v-1, j) on rank p-1 after its forward; B(c, j) on r
after B(c, j) on r+1, or after B(c+1, j) on rank 0 when r = p-1 (for any costs F and B every
rank idles exactly (p-1)(F+B)/v). DualPipeV: F(phase 0) of micro-batch j on rank r after F(0, j)
on r-1; the turn-around F(1, j) on rank p-1 after F(0, j) there, else after F(1, j) on r+1; the
loss's backward B(1, j) on rank 0 (1F1B: B on the last rank) after its forward; B(1, j) on r
after B(1, j) on r-1; B(0, j) on rank p-1 after B(1, j) there, else after B(0, j) on r+1.
Communication takes no time, so the idle fraction is the schedule's own bubble (the pipeline's
lower bound); ``tools/bench_pipeline.py`` measures the real one beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from megaformer.parallel.interleaved_schedule import check_interleaved, producer, rank_units

SCHEDULES = ("1f1b", "interleaved", "dualpipev")

Pass = tuple[str, int]  # (F or B, phase)


def schedule_label(schedule: str, v: int = 2) -> str:
    """How tables name a schedule: its name, with v for the interleaved one ('interleaved v=2')."""
    return f"{schedule} v={v}" if schedule == "interleaved" else schedule


def stages_per_rank(schedule: str, v: int = 2) -> int:
    """The stages one rank holds: 1 under 1F1B, v interleaved, 2 under DualPipeV."""
    return {"interleaved": v, "dualpipev": 2}.get(schedule, 1)


def rank_passes(schedule: str, p: int, m: int, r: int, v: int = 2) -> list[Pass]:
    """Rank r's passes under ``schedule`` with p ranks and m micro-batches (``v``: stages per rank
    under ``interleaved``, ignored otherwise)."""
    if schedule == "interleaved":
        check_interleaved(p, m, v)
        return [(kind, c) for unit in rank_units(p, m, v, r) for kind, c, _ in unit]
    if schedule == "1f1b":
        w = min(p - 1 - r, m)
        return [("F", 0)] * w + [("F", 0), ("B", 0)] * (m - w) + [("B", 0)] * w
    if schedule != "dualpipev":
        raise ValueError(f"unknown pipeline schedule {schedule!r}")
    if m < 2 * p:
        raise ValueError(f"dualpipev needs at least 2 * {p} micro-batches, got {m}")
    n = p - 1 - r
    f0, f1, b0, b1 = ("F", 0), ("F", 1), ("B", 0), ("B", 1)
    return (
        [f0] * (2 * n)
        + [f0, f1] * (r + 1)
        + [b1, f1] * n
        + [f0, b1, f1, b0] * (m - 2 * p + r + 1)
        + [b1, f1, b0] * n
        + [b1, b0] * (r + 1)
        + [b0] * n
    )


def _needs(schedule: str, p: int, r: int, kind: str, phase: int, v: int) -> tuple[str, int, int]:
    """(kind, phase, rank) of the pass whose output pass (kind, phase) on rank r reads."""
    last = p - 1
    if schedule == "interleaved":  # the engine's own rule
        src, c = producer(p, v, r, kind, phase)
        if src < 0:
            return ("", 0, -1)
        return ("F", c, r) if kind == "B" and src == r else (kind, c, src)  # B after its loss
    if schedule == "1f1b":
        if kind == "F":
            return ("F", 0, r - 1) if r > 0 else ("", 0, -1)
        return ("F", 0, r) if r == last else ("B", 0, r + 1)
    if kind == "F":
        if phase == 0:
            return ("F", 0, r - 1) if r > 0 else ("", 0, -1)
        return ("F", 0, r) if r == last else ("F", 1, r + 1)
    if phase == 1:
        return ("F", 1, r) if r == 0 else ("B", 1, r - 1)
    return ("B", 1, r) if r == last else ("B", 0, r + 1)


@dataclass(frozen=True)
class Timeline:
    """A schedule's step with forward cost ``f`` and backward cost ``b`` per 1F1B stage."""

    makespan: float
    busy: tuple[float, ...]  # per rank
    in_flight: tuple[float, ...]  # per rank: peak activations held, in 1F1B stages' micro-batches
    chunks_in_flight: tuple[int, ...] = ()  # per rank: the same in passes (chunks) held

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank: the fraction of the step it waits."""
        return tuple(1 - b / self.makespan for b in self.busy)

    @property
    def bubble(self) -> float:
        """Mean idle fraction over the ranks."""
        return sum(self.idle) / len(self.idle)


def simulate(schedule: str, p: int, m: int, f: float = 1.0, b: float = 2.0, v: int = 2) -> Timeline:
    """The timeline of ``schedule`` at p ranks and m micro-batches (see the module docstring);
    ``v``: stages per rank under ``interleaved``, ignored otherwise."""
    return _simulate(schedule, p, m, f, b, v if schedule == "interleaved" else 1)


@lru_cache(maxsize=256)
def _simulate(schedule: str, p: int, m: int, f: float, b: float, v: int) -> Timeline:
    chunk = 1.0 / stages_per_rank(schedule, v)  # a chunk's share of a 1F1B stage
    cost = {"F": f * chunk, "B": b * chunk}
    passes = [rank_passes(schedule, p, m, r, v) for r in range(p)]
    done: dict[tuple[str, int, int, int], float] = {}  # (kind, phase, rank, micro-batch) -> end
    nxt = [0] * p
    free = [0.0] * p
    count = [{(k, c): 0 for k in "FB" for c in range(max(v, 2))} for _ in range(p)]
    held, peak = [0] * p, [0] * p
    remaining = sum(len(x) for x in passes)
    while remaining:
        progressed = False
        for r in range(p):
            while nxt[r] < len(passes[r]):
                kind, phase = passes[r][nxt[r]]
                j = count[r][(kind, phase)]
                dk, dphase, dr = _needs(schedule, p, r, kind, phase, v)
                if dr >= 0 and (dk, dphase, dr, j) not in done:
                    break
                start = max(free[r], done.get((dk, dphase, dr, j), 0.0))
                free[r] = done[(kind, phase, r, j)] = start + cost[kind]
                count[r][(kind, phase)] += 1
                held[r] += 1 if kind == "F" else -1
                peak[r] = max(peak[r], held[r])
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"{schedule} at p={p}, m={m}: the passes wait on each other")
    return Timeline(
        max(free),
        tuple((f + b) * m for _ in range(p)),
        tuple(x * chunk for x in peak),
        tuple(peak),
    )


def step_factor(schedule: str, p: int, m: int, v: int = 2) -> float:
    """Step time over the bubble-free time m (F + B) per stage: 1 + (p-1)/m under 1F1B,
    1 + (p-1)/(vm) interleaved."""
    if p == 1:
        return 1.0
    t = simulate(schedule, p, m, v=v)
    return t.makespan / t.busy[0]


def formula_bubble(schedule: str, p: int, m: int, v: int = 2) -> float:
    """The idle fraction in closed form, a backward costing two forwards: (p-1)/(m+p-1) under
    1F1B (idle (p-1)(F+B) per rank); interleaved (p-1)/(vm+p-1) (idle (p-1)(F+B)/v: the warm-up
    and cool-down pass through chunks of 1/v of a stage); under DualPipeV every rank idles
    (p-1)B - F/2 (its timeline, for any m >= 2p), so (2p - 5/2)/(2p - 5/2 + 3m)."""
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (2 * p - 2.5) / (2 * p - 2.5 + 3 * m)


def p2p_sends_per_micro_batch(schedule: str, p: int, v: int = 2) -> int:
    """Activation (and gradient) sends between ranks per micro-batch, over the whole pipeline:
    2 (p-1) under 1F1B (forward and backward over p-1 boundaries); interleaved 2 (vp-1) (all vp-1
    stage boundaries are between ranks, the wrap-around from rank p-1 to rank 0 included: v times
    1F1B's plus 2 (v-1)); 4 (p-1) under DualPipeV (out and back: 2 (p-1) boundaries between
    ranks, the turn-around on rank p-1 is local)."""
    if schedule == "interleaved":
        return 2 * (v * p - 1)
    return (4 if schedule == "dualpipev" else 2) * (p - 1)
