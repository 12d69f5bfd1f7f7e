"""A flight recorder of this rank's collectives: which one it is in, and how long it waited.

While a :class:`FlightRecorder` is installed, every collective called through the
``torch.distributed`` namespace (megaformer's own ``comm`` helpers and DeepSpeed's ``comm`` layer
both call it there) is counted per process group, keyed by the group's global ranks::

    seq[g] += 1;  entry = (seq[g], kind, g, bytes, entered at, left at)

(bytes: of the tensors handed to the call, inputs and outputs).

A group's members issue its collectives in the same order, so after a hang the member whose
``entered`` count is behind the others' on a group is the one that did not arrive (:func:`stragglers`
reads the per-rank dumps). The last ``capacity`` entries are kept (a ring), so the memory is fixed.

On CUDA a pair of CUDA events on the current stream brackets each synchronous call (read later,
once per interval, by the straggler detector; no host sync at the call): the time the collective
took on the device, waiting for its peers included.

The wrapper costs a few microseconds per call; :attr:`FlightRecorder.own_s` adds them up. Inside a
``torch.compile`` graph (compiled blocks under tensor parallelism) it steps aside: the collective is
traced as it is, and not recorded.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

#: The torch.distributed collectives recorded (point-to-point sends are not: they have no group).
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
)

_TENSOR_ARGS = 2  # the tensors of a collective are among its first two arguments
_TENSOR_KWARGS = ("tensor", "tensor_list", "output_tensor", "input_tensor", "output", "input")


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return 0


def _tensor_args(args: tuple, kwargs: dict) -> list[Any]:
    """The arguments of a collective that may hold its tensors (a tensor or a list of them)."""
    return [*args[:_TENSOR_ARGS], *(kwargs[k] for k in _TENSOR_KWARGS if k in kwargs)]


def _first_tensor(values: list[Any]) -> Optional[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
    return None


class FlightRecorder:
    """Counts and times the collectives of this process while installed (one per process)."""

    def __init__(self, capacity: int = 1024) -> None:
        self.entries: deque[list] = deque(maxlen=capacity)
        self.seq: dict[tuple[int, ...], int] = {}
        self.done: dict[tuple[int, ...], int] = {}
        self.own_s = 0.0  # the recorder's own bookkeeping
        self.events: list[tuple[Any, Any]] = []  # CUDA (start, end) pairs not yet read
        self._ranks: dict[int, tuple[Any, tuple[int, ...]]] = {}
        self._saved: dict[str, Callable] = {}
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- installing

    def install(self) -> "FlightRecorder":
        """Wrap the collectives of ``torch.distributed`` (idempotent)."""
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or name in self._saved:
                continue
            self._saved[name] = fn
            setattr(dist, name, self._wrap(name, fn))
        return self

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _wrap(self, kind: str, fn: Callable) -> Callable:
        params = list(inspect.signature(fn).parameters)
        g_at = params.index("group") if "group" in params else None
        a_at = params.index("async_op") if "async_op" in params else None

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():  # inside a compiled graph: the collective alone
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            group = kwargs.get(
                "group", args[g_at] if g_at is not None and len(args) > g_at else None
            )
            is_async = bool(
                kwargs.get(
                    "async_op", args[a_at] if a_at is not None and len(args) > a_at else False
                )
            )
            key = self._key(group)
            seq = self.seq[key] = self.seq.get(key, 0) + 1
            values = _tensor_args(args, kwargs)
            nbytes = sum(_nbytes(v) for v in values)
            entry = [seq, kind, key, nbytes, time.time(), None]
            self.entries.append(entry)
            tensor = _first_tensor(values)
            events = None
            if tensor is not None and tensor.is_cuda and not is_async:
                events = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                events[0].record()
            t1 = time.perf_counter()
            out = fn(*args, **kwargs)
            t2 = time.perf_counter()
            entry[5] = time.time()
            self.done[key] = seq
            if events is not None:
                events[1].record()
                self.events.append(events)
            self.own_s += (t1 - t0) + (time.perf_counter() - t2)
            return out

        return recorded

    def _key(self, group: Any) -> tuple[int, ...]:
        """The global ranks of ``group`` (None or WORLD: every rank), cached per group object."""
        if group is None or group is dist.group.WORLD:
            group = dist.group.WORLD
        held = self._ranks.get(id(group))
        if held is None or held[0] is not group:  # (the group is held: its id is not reused)
            held = self._ranks[id(group)] = (group, tuple(dist.get_process_group_ranks(group)))
        return held[1]

    # ----------------------------------------------------------------------------- reading

    def take_events(self) -> list[tuple[Any, Any]]:
        """The CUDA (start, end) event pairs recorded since the last call (not read: reading
        them is the caller's, once per interval)."""
        pairs, self.events = self.events, []
        return pairs

    def snapshot(self, rank: int, recent: int = 32) -> dict[str, Any]:
        """What a hang dump holds: per group how many collectives this rank entered and left, the
        collective it is in (if any), and the last ``recent`` entries."""
        now = time.time()
        entries = list(self.entries)
        last: dict[tuple[int, ...], list] = {}
        for e in entries:
            last[e[2]] = e
        groups = []
        for key, entered in list(self.seq.items()):
            e = last.get(key)
            groups.append(
                {
                    "ranks": list(key),
                    "entered": entered,
                    "left": self.done.get(key, 0),
                    "last": None
                    if e is None
                    else {
                        "kind": e[1],
                        "seq": e[0],
                        "bytes": e[3],
                        "since_s": round(now - e[4], 3),
                        "finished": e[5] is not None,
                    },
                }
            )
        return {
            "rank": rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "time": now,
            "groups": groups,
            "recent": [
                {
                    "seq": e[0],
                    "kind": e[1],
                    "ranks": list(e[2]),
                    "bytes": e[3],
                    "finished": e[5] is not None,
                }
                for e in entries[-recent:]
            ],
        }


_RECORDER: Optional[FlightRecorder] = None


def recorder() -> FlightRecorder:
    """This process's recorder, installed on first use."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = FlightRecorder().install()
    return _RECORDER


def installed() -> Optional[FlightRecorder]:
    """This process's recorder if one was installed, else None."""
    return _RECORDER


# ----------------------------------------------------------------------------- after a hang


def _span(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def stragglers(dumps: dict[int, dict]) -> list[dict]:
    """The collectives some ranks are stuck in, and who did not arrive, from the ranks' dumps
    (:meth:`FlightRecorder.snapshot`, by rank).

    For a group g with members M: a member r is waiting in collective n = entered_r(g) when
    left_r(g) < entered_r(g); the members with entered(g) < n (or no dump at all) did not arrive.
    One finding per group with a waiting member and someone missing, the longest wait first."""
    found = []
    seen: set[tuple[int, ...]] = set()
    for dump in dumps.values():
        for g in dump["groups"]:
            key = tuple(g["ranks"])
            if key in seen:
                continue
            seen.add(key)
            view = {}
            for r in key:
                mine = next(
                    (x for x in dumps.get(r, {}).get("groups", []) if tuple(x["ranks"]) == key),
                    None,
                )
                view[r] = mine
            waiting = [r for r, x in view.items() if x is not None and x["left"] < x["entered"]]
            if not waiting:
                continue
            n = max(view[r]["entered"] for r in waiting)
            missing = [r for r, x in view.items() if x is None or x["entered"] < n]
            no_dump = [r for r in missing if r not in dumps]
            if not missing:
                continue
            last = view[waiting[0]]["last"] or {}
            found.append(
                {
                    "ranks": list(key),
                    "seq": n,
                    "kind": last.get("kind", "?"),
                    "bytes": last.get("bytes", 0),
                    "waiting": waiting,
                    "missing": missing,
                    "no_dump": no_dump,
                    "behind": {r: view[r]["entered"] for r in missing if view[r] is not None},
                    "wait_s": max((view[r]["last"] or {}).get("since_s", 0.0) for r in waiting),
                }
            )
    return sorted(found, key=lambda f: -f["wait_s"])


def hang_line(dumps: dict[int, dict]) -> str:
    """One line naming the ranks that did not arrive at the collectives the others wait in."""
    found = stragglers(dumps)
    if not found:
        return (
            f"megaformer hang: no collective is waiting for a missing rank in the dumps of ranks "
            f"{_span(sorted(dumps))} (the stall is outside collectives: see the stacks in logs/)"
        )
    parts = []
    for f in found:
        hosts = {r: dumps[r]["host"] for r in f["missing"] if r in dumps}
        who = ", ".join(
            f"rank {r}"
            + (f" ({hosts[r]}, at #{f['behind'][r]})" if r in hosts else " (no dump: dead?)")
            for r in f["missing"]
        )
        waiting = f"rank{'s' if len(f['waiting']) > 1 else ''} {_span(f['waiting'])}"
        parts.append(
            f"{f['kind']} #{f['seq']} on ranks {_span(f['ranks'])} ({f['bytes']} bytes), "
            f"waited {f['wait_s']:.1f} s by {waiting}: did not arrive: {who}"
        )
    return "megaformer hang: " + "; ".join(parts)
