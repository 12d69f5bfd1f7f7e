"""The interleaved 1F1B schedule (Narayanan et al. 2021, "Efficient large-scale language model
training on GPU clusters"), as rounds of passes and the point-to-point exchanges between them.

The blocks are cut into v * p stages; pipeline rank r of p holds the v stages s = c * p + r
(its chunks c = 0..v-1), so a micro-batch visits ranks 0..p-1 v times and the activations of
chunk c on rank p-1 go on to chunk c+1 on rank 0. Each rank runs its passes in this order
(m micro-batches, m a multiple of p; micro-batches taken in groups of p):

    forwards:  for each group g of p micro-batches: for c = 0..v-1: F(c, j) for j in g
    backwards: the same with c = v-1..0
    warm-up:   w_r = min(2 (p-1-r) + (v-1) p, m v) forwards, then (m v - w_r) rounds of
               [F, B], then w_r backwards.

A pass of stage s reads the output of stage s-1 (forward) or s+1 (backward; the last stage's
backward reads its own forward's loss). The idle fraction is (p-1) / (v m + p - 1): the 1F1B
bubble shrunk v times, for v times the point-to-point traffic.

:func:`rounds` places the passes in rounds: in round t every rank runs its next unit ([F], [F, B]
or [B]) if every input it needs from another rank was produced in an earlier round, else it waits
that round. The outputs are exchanged twice per round, in one batch per rank each time: after the
first pass of every unit, what the first passes made; after the second, what the second passes
made (each send and its receive are in the same batch on both ranks, and a rank makes one output
per half-round, so two ranks exchange at most one message each way per batch; a rank's sends and
receives are queued in the order of the stage boundary each crosses). In the steady state the
forward output of a round crosses while both ranks run the round's backward, and the backward
output while they run the next forward: the engine waits on a batch only before the pass that
reads what it received (Megatron's overlapped point-to-point). This is the order the engine (:mod:`megaformer.parallel.interleaved_engine`) runs; pure
Python, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

Pass = tuple[str, int, int]  # (F or B, chunk, micro-batch)


def check_interleaved(p: int, m: int, v: int, forward_only: bool = False) -> None:
    """ValueError unless (p ranks, m micro-batches, v chunks per rank) can run interleaved
    (forward passes only, as in evaluation: any m)."""
    if p < 2:
        raise ValueError("the interleaved schedule needs a pipeline of at least 2 ranks")
    if v < 2:
        raise ValueError(f"the interleaved schedule needs at least 2 stages per rank, got {v}")
    if forward_only:
        if m < 1:
            raise ValueError(f"the interleaved schedule needs micro-batches, got {m}")
    elif m < p or m % p:
        raise ValueError(
            f"the interleaved schedule needs a multiple of pipeline = {p} micro-batches per step, "
            f"got {m}"
        )


def _chunk_order(p: int, m: int, v: int, backward: bool) -> list[tuple[int, int]]:
    chunks = range(v - 1, -1, -1) if backward else range(v)
    return [(c, j) for g in range(0, m, p) for c in chunks for j in range(g, min(g + p, m))]


def rank_units(p: int, m: int, v: int, r: int, forward_only: bool = False) -> list[list[Pass]]:
    """Rank r's passes in order, grouped in the units of a round: [F] (warm-up), [F, B]
    (steady state) and [B] (cool-down); forward-only: every F alone."""
    fwd = [("F", c, j) for c, j in _chunk_order(p, m, v, False)]
    if forward_only:
        return [[f] for f in fwd]
    bwd = [("B", c, j) for c, j in _chunk_order(p, m, v, True)]
    w = min(2 * (p - 1 - r) + (v - 1) * p, m * v)
    steady = len(fwd) - w
    return (
        [[f] for f in fwd[:w]]
        + [[fwd[w + i], bwd[i]] for i in range(steady)]
        + [[b] for b in bwd[steady:]]
    )


def stage_of(p: int, r: int, c: int) -> int:
    return c * p + r


def place(p: int, s: int) -> tuple[int, int]:
    """(rank, chunk) that holds stage s."""
    return s % p, s // p


def producer(p: int, v: int, r: int, kind: str, c: int) -> tuple[int, int]:
    """(rank, chunk) whose pass of the same kind and micro-batch produces the input of pass
    (kind, c) on rank r: stage s-1's forward, stage s+1's backward; (-1, -1) for the first
    stage's forward (the data); the last stage's backward reads its own forward (returned as
    (r, c))."""
    s = stage_of(p, r, c)
    if kind == "F":
        return (-1, -1) if s == 0 else place(p, s - 1)
    return (r, c) if s == v * p - 1 else place(p, s + 1)


@dataclass(frozen=True)
class Transfer:
    """An output crossing ranks in a round: pass (kind, chunk, micro-batch) of rank ``src``
    goes to rank ``dst``'s chunk ``dst_chunk``; ``boundary`` is the stage boundary it crosses,
    by its lower stage (forward s -> s+1 and backward s+1 -> s both give s); ``half``: after the
    first or the second pass of the round."""

    kind: str
    src: int
    chunk: int
    micro_batch: int
    dst: int
    dst_chunk: int
    boundary: int
    half: int  # 0: made by the first pass of the source's unit, 1: by the second


@dataclass(frozen=True)
class Round:
    """What every rank does in one round: ``passes[r]`` (possibly empty), then the transfers of
    the outputs made in it."""

    passes: tuple[tuple[Pass, ...], ...]
    transfers: tuple[Transfer, ...]


@lru_cache(maxsize=64)
def rounds(p: int, m: int, v: int, forward_only: bool = False) -> tuple[Round, ...]:
    """The whole step's rounds for all p ranks (the same on every rank: each rank builds its
    instructions from this one plan). RuntimeError if the passes wait on each other."""
    check_interleaved(p, m, v, forward_only)
    units = [rank_units(p, m, v, r, forward_only) for r in range(p)]
    nxt = [0] * p
    made: dict[Pass, int] = {}  # (kind, stage, micro-batch) -> round it was produced in
    plan: list[Round] = []
    last = v * p - 1
    while any(nxt[r] < len(units[r]) for r in range(p)):
        t = len(plan)
        ran: list[tuple[Pass, ...]] = []
        for r in range(p):
            unit = units[r][nxt[r]] if nxt[r] < len(units[r]) else []
            ready = True
            for kind, c, j in unit:
                src, sc = producer(p, v, r, kind, c)
                if src < 0 or src == r:
                    continue  # the data, or this rank's own forward (done before its backward)
                key = (kind, stage_of(p, src, sc), j)
                if made.get(key, t) >= t:
                    ready = False
            ran.append(tuple(unit) if ready else ())
        transfers = []
        for r, unit in enumerate(ran):
            if unit:
                nxt[r] += 1
            for half, (kind, c, j) in enumerate(unit):
                s = stage_of(p, r, c)
                made[(kind, s, j)] = t
                to = s + 1 if kind == "F" else s - 1  # the stage that reads this output
                if 0 <= to <= last:
                    transfers.append(Transfer(kind, r, c, j, *place(p, to), min(s, to), half))
        if not any(ran):
            raise RuntimeError(f"interleaved schedule at p={p}, m={m}, v={v}: the passes wait")
        plan.append(Round(tuple(ran), tuple(transfers)))
    return tuple(plan)
