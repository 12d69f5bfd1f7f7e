"""Byte counters: what each rank sends, by kind of exchange, while a :class:`CommCounter` is open.

Two ways to record, both public so no module reaches into another's state:

* :func:`record` — exact bytes this rank sends (all-to-all, point-to-point): ``bytes[kind] += n``;
* :func:`record_collective` — the bandwidth-optimal (ring) volume of a collective over p ranks for
  a full (unsharded) tensor of N bytes: all-reduce 2(p-1)/p N, all-gather and reduce-scatter
  (p-1)/p N each.

Each call also adds one to ``calls[kind]``. :func:`no_counting` hides a region from every open
counter (bookkeeping collectives such as the gradient norm's).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Iterator

_OPEN: list["CommCounter"] = []


class CommCounter:
    """Counts collective calls and bytes (by kind) while active: ``with CommCounter() as c: ...``."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    def __enter__(self) -> "CommCounter":
        _OPEN.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _OPEN.remove(self)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def record(kind: str, nbytes: int) -> None:
    """Add ``nbytes`` (exact, sent by this rank) and one call of ``kind`` to every open counter."""
    for c in _OPEN:
        c.bytes[kind] += int(nbytes)
        c.calls[kind] += 1


def record_collective(kind: str, full_bytes: int, world: int) -> None:
    """Record the ring volume of collective ``kind`` ("all_reduce", "all_gather",
    "reduce_scatter") over ``world`` ranks for a full tensor of ``full_bytes``."""
    factor = 2 * (world - 1) / world if kind == "all_reduce" else (world - 1) / world
    record(kind, int(round(full_bytes * factor)))


@contextlib.contextmanager
def no_counting() -> Iterator[None]:
    """Nothing inside is recorded by the counters open outside."""
    saved = list(_OPEN)
    _OPEN.clear()
    try:
        yield
    finally:
        _OPEN.extend(saved)
