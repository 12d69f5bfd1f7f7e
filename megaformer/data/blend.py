"""Blending several datasets with weights, each within one sample of its share at every point.

With weights w_1..w_D (sum 1) and c_d(n) the samples taken from dataset d among the first n, we
want |c_d(n) - w_d n| < 1 for every d and every n. This is the chairman-assignment problem;
Tijdeman (1980) showed the bound 1 - 1/(2D - 2) is reached by earliest-deadline-first scheduling of
dataset d's k-th sample in the window

    release (k + delta) / w_d  <=  n  <=  deadline (k + 1 - delta) / w_d,    delta = 1 / (2D - 2),

which is what :func:`blend_index` does (per slot, a scan over the D datasets, or two heaps, O(log D),
beyond 16 datasets; a greedy "largest deficit" rule, as in Megatron-LM, can overshoot 1). The
sequence is online, so the first n entries never depend on how many are built, and the state
after n entries is just the counts c_d(n): the schedule is built in chunks from there. Global
sample g is sample ``k = offset[g]`` of dataset ``which[g]``, and that dataset's own (shuffled)
order supplies the tokens.

The scheduling loop is sequential (each choice depends on the previous ones), so it runs as a small
C function (``blend.c``) built on first use with the system compiler (``$CC``, default ``cc``;
cached as the native kernels are, under ``$MEGAFORMER_CACHE_DIR``, default
``~/.cache/megaformer``, ``/blend/<hash>/``, private to the user and digest-checked), which computes
the same floating-point keys in the same order as the Python loop and so the same schedule. Without
a compiler (or with ``MEGAFORMER_NATIVE=0``) the Python loop runs instead: same output, slower.
The same library holds the two loops of :mod:`megaformer.data.gpt_dataset`'s index build (an
epoch's sample rows, numpy's shuffle), each with a numpy fallback of the same output. ``which``
and ``offset`` are stored in the smallest integer types that hold them, and a cached blend is
written chunk by chunk straight into its files (never whole in memory).
"""

from __future__ import annotations

import ctypes
import hashlib
import heapq
import json
import logging
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from megaformer.data.indexed import smallest_int
from megaformer.data.npy_files import NpyWriter
from megaformer.errors import DataError
from megaformer.safe_files import make_dir, owned_by_me, read_text_bounded, write_atomic

log = logging.getLogger("megaformer")

CHUNK = 1 << 22  # samples per call of the scheduler (bounds its int32/int64 staging buffers)

SOURCE = Path(__file__).with_name("blend.c")
_C_FLAGS = ("-O2", "-ffp-contract=off", "-fno-fast-math", "-std=c99", "-shared", "-fPIC")
_lib_lock = threading.Lock()
_lib_state: dict = {}


def _build_scheduler() -> tuple[Optional[ctypes.CDLL], str]:
    """The compiled scheduler through the native kernels' private, digest-checked build cache."""
    from megaformer.kernels import native

    if os.environ.get("MEGAFORMER_NATIVE", "1") == "0":
        return None, "blend scheduler: Python loop (MEGAFORMER_NATIVE=0)"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None, f"blend scheduler: Python loop (no C compiler '{compiler}' on PATH)"
    try:
        target, private = native.build_library(
            compiler, SOURCE, _C_FLAGS, "libmegaformer_blend.so", "blend", cpu_specific=False
        )
        lib = ctypes.CDLL(str(target))
        lib.mf_blend.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_double,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
        )
        lib.mf_blend.restype = ctypes.c_int
        lib.mf_epoch_rows.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_int,
        )
        lib.mf_epoch_rows.restype = ctypes.c_int
        lib.mf_shuffle.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64)
        lib.mf_shuffle.restype = None
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
        return None, f"blend scheduler: Python loop ({e})"
    if private:  # loaded (mapped): the private one-off copy is not needed on disk
        shutil.rmtree(target.parent, ignore_errors=True)
        return lib, f"blend scheduler: built privately ({private})"
    return lib, f"blend scheduler: {target}"


def scheduler() -> Optional[ctypes.CDLL]:
    """The compiled scheduler, built on the first call; None where it cannot be had."""
    if "status" not in _lib_state:
        with _lib_lock:
            if "status" not in _lib_state:
                _lib_state["lib"], _lib_state["status"] = _build_scheduler()
                if _lib_state["lib"] is None:
                    log.info("%s", _lib_state["status"])
    return _lib_state["lib"]


def normalise(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return w / w.sum()


def _schedule_py(
    w: np.ndarray, active: list[int], delta: float, i0: int, n: int, count: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Slots ``[i0, i0 + n)`` by the heap loop; ``count`` (samples per dataset before ``i0``) is
    updated in place."""
    which = np.zeros(n, dtype=np.int32)
    offset = np.zeros(n, dtype=np.int64)
    cnt = [int(c) for c in count]
    future = [((cnt[d] + delta) / w[d], d) for d in active]  # (release, d)
    heapq.heapify(future)
    ready: list[tuple[float, int]] = []  # (deadline, d)
    for i in range(i0, i0 + n):
        t = i + 1 + 1e-9
        while future and future[0][0] <= t:
            _, d = heapq.heappop(future)
            heapq.heappush(ready, ((cnt[d] + 1 - delta) / w[d], d))
        _, d = heapq.heappop(ready)
        which[i - i0] = d
        offset[i - i0] = cnt[d]
        cnt[d] += 1
        heapq.heappush(future, ((cnt[d] + delta) / w[d], d))
    count[:] = cnt
    return which, offset


def blend_chunks(
    weights: Sequence[float],
    n: int,
    chunk: int = CHUNK,
    native: bool = True,
    out: Optional[tuple[np.ndarray, np.ndarray]] = None,
    counts: Optional[np.ndarray] = None,
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(start, which, offset)`` for global samples ``[start, start + len(which))``, chunk by chunk,
    covering ``[0, n)``: :func:`blend_index` without holding all of it (int32 / int64 chunks), or,
    given ``out`` (two contiguous integer arrays of length >= n), views of ``out`` filled in place.
    ``counts`` (int64 zeros, one per dataset), when given, holds the samples per dataset so far.
    ``native=False`` runs the Python loop."""
    w = normalise(weights)
    D = len(w)
    active = [d for d in range(D) if w[d] > 0]
    lib = scheduler() if native and len(active) > 1 else None
    count = np.zeros(D, dtype=np.int64) if counts is None else counts
    if len(active) > 1:
        delta = 1.0 / (2 * (len(active) - 1))
        w_c = np.ascontiguousarray(w)
        act = np.asarray(active, dtype=np.int32)
        scratch = np.zeros(
            2 * len(active), dtype=np.dtype([("key", np.float64), ("d", np.int32)], align=True)
        )
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        if out is not None:
            which, offset = out[0][start : start + m], out[1][start : start + m]
        else:
            which, offset = np.empty(m, dtype=np.int32), np.empty(m, dtype=np.int64)
        if len(active) <= 1:
            which[:] = active[0] if active else 0
            offset[:] = np.arange(start, start + m)
            count[active[0] if active else 0] += m
        elif lib is None:
            which[:], offset[:] = _schedule_py(w, active, delta, start, m, count)
        else:
            rc = lib.mf_blend(
                w_c.ctypes.data,
                act.ctypes.data,
                len(active),
                delta,
                start,
                m,
                count.ctypes.data,
                which.ctypes.data,
                which.itemsize,
                offset.ctypes.data,
                offset.itemsize,
                scratch.ctypes.data,
            )
            if rc != 0:
                raise AssertionError("blend schedule: no dataset ready at a slot")
        yield start, which, offset


def blend_index(
    weights: Sequence[float], n: int, native: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(which dataset, its sample number) for global samples 0..n-1 (Tijdeman's schedule), in the
    smallest integer types that hold them."""
    which = np.empty(n, dtype=smallest_int(max(len(weights) - 1, 0)))
    offset = np.empty(n, dtype=smallest_int(max(n - 1, 0)))
    for _ in blend_chunks(weights, n, native=native, out=(which, offset)):
        pass
    return which, offset


SCHEDULE_SLACK = 1e-6  # floating-point slack on the bound |c_d(n) - w_d n| < 1


def check_schedule(
    which: np.ndarray, offset: np.ndarray, weights: np.ndarray, counts: np.ndarray, start: int
) -> None:
    """ValueError unless entries ``start, start + 1, ...`` of a cached blend (``which``,
    ``offset``; ``counts`` the samples per dataset before ``start``) are a schedule this module
    could have written: each dataset's samples taken in order, each once
    (``offset[g]`` = the number of earlier entries of dataset ``which[g]``), and every dataset
    within one sample of its share at every point. The share ``w_d n - c_d(n)`` is largest just
    before a sample of d and smallest just after one, so it suffices to check, for global sample
    g = sample k of d, ``w_d g - k < 1`` and ``k + 1 - w_d (g + 1) < 1`` (and at the end, in the
    caller, that no dataset falls short)."""
    w, off = np.asarray(weights, dtype=np.float64), offset.astype(np.int64)
    order = np.argsort(which, kind="stable")
    grouped = which[order].astype(np.int64)
    first = np.searchsorted(grouped, grouped)  # where each entry's dataset starts in ``order``
    expected = counts[grouped] + np.arange(len(order)) - first
    if (off[order] != expected).any():
        raise ValueError("a dataset's samples are not taken in order, each once")
    g = np.arange(start, start + len(which), dtype=np.float64)
    share = w[which.astype(np.int64)]
    if (share * g - off >= 1 + SCHEDULE_SLACK).any() or (
        off + 1 - share * (g + 1) >= 1 + SCHEDULE_SLACK
    ).any():
        raise ValueError("the datasets' shares are not the weights")


class BlendedDataset:
    """Global sample g = sample ``offset[g]`` of dataset ``which[g]``; built for ``n`` samples,
    extended (exactly, the schedule being online) when asked for more. ``len()`` = samples built.

    With a ``cache_dir``, the index is saved there as ``blend-<hash>-{which,offset}.npy`` (and a
    ``.json`` written last) and memory-mapped when read back."""

    shuffled = True

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        n: int,
        cache_dir: Optional[Path] = None,
        build: bool = True,
    ) -> None:
        self.datasets = list(datasets)
        self.weights = normalise(weights)
        self.cache_dir = cache_dir
        self._build(n, build)

    def _key(self) -> str:
        parts = [
            [
                str(getattr(getattr(d, "data", None), "prefix", "")),
                getattr(d, "split", ""),
                getattr(d, "start", 0),
                getattr(d, "end", 0),
                getattr(d, "seq_len", 0),
                getattr(d, "seed", 0),
            ]
            for d in self.datasets
        ]
        text = json.dumps({"v": 1, "datasets": parts, "weights": self.weights.tolist()})
        return "blend-" + hashlib.sha256(text.encode()).hexdigest()[:20]

    def _paths(self) -> dict[str, Path]:
        assert self.cache_dir is not None
        key = self._key()
        return {name: self.cache_dir / f"{key}-{name}.npy" for name in ("which", "offset")} | {
            "meta": self.cache_dir / f"{key}.json"
        }

    def _load_cached(self, n: int) -> bool:
        """The cached index when it holds at least ``n`` samples, its files are this user's own (not
        writable by others) and it is well formed (dataset numbers in range, sample numbers in
        ``[0, g]``); anything else is ignored (rebuilt)."""
        if self.cache_dir is None:
            return False
        paths = self._paths()
        if not (paths["meta"].is_file() or paths["meta"].is_symlink()):
            return False
        if not all(owned_by_me(p) for p in paths.values()):
            log.warning(
                "data: ignoring the cached blend index %s: its files must be regular files "
                "of this user, not writable by group or others",
                paths["meta"],
            )
            return False
        try:
            if int(json.loads(read_text_bounded(paths["meta"], 1 << 16, DataError))["samples"]) < n:
                return False
            which = np.load(paths["which"], mmap_mode="r", allow_pickle=False)
            offset = np.load(paths["offset"], mmap_mode="r", allow_pickle=False)
            if (
                which.ndim != 1
                or which.shape != offset.shape
                or len(which) < n
                or which.dtype.kind not in "iu"
                or offset.dtype.kind not in "iu"
            ):
                raise ValueError(
                    f"shapes {which.shape} ({which.dtype}), {offset.shape} ({offset.dtype})"
                )
            counts = np.zeros(len(self.datasets), dtype=np.int64)
            for a in range(0, len(which), CHUNK):
                wh, off = which[a : a + CHUNK], offset[a : a + CHUNK]
                if (
                    wh.min() < 0
                    or wh.max() >= len(self.datasets)
                    or off.min() < 0
                    or (off > np.arange(a, a + len(off))).any()
                ):
                    raise ValueError("entries out of range")
                check_schedule(wh, off, self.weights, counts, a)
                counts += np.bincount(wh, minlength=len(self.datasets))
            if (self.weights * len(which) - counts >= 1 + SCHEDULE_SLACK).any():
                raise ValueError("a dataset falls short of its share")
        except (OSError, ValueError, KeyError, TypeError, DataError) as e:
            log.warning(
                "data: ignoring the cached blend index %s (%s); rebuilding it",
                paths["meta"],
                " ".join(str(e).split())[:200],
            )
            return False
        self.which, self.offset, self._counts = which, offset, counts
        return True

    def _compute(self, n: int, paths: Optional[dict[str, Path]] = None) -> None:
        """``which``/``offset`` for ``n`` samples and the samples per dataset among them: in
        memory, or written chunk by chunk into ``paths`` (renamed into place when complete, the
        ``.json`` last) and memory-mapped from there."""
        D = len(self.datasets)
        dtypes = {"which": smallest_int(max(D - 1, 0)), "offset": smallest_int(max(n - 1, 0))}
        if paths is None:
            self.which, self.offset = blend_index(self.weights, n)
            self._counts = self.counts(n)
            return
        make_dir(paths["meta"].parent, mode=0o700, error=DataError)
        sinks: dict[str, NpyWriter] = {}
        try:
            for name in ("which", "offset"):
                sinks[name] = NpyWriter(paths[name], dtypes[name], (n,))
            counts = np.zeros(D, dtype=np.int64)
            for start, which, offset in blend_chunks(self.weights, n, counts=counts):
                sinks["which"].put(start, which)
                sinks["offset"].put(start, offset)
            for name in ("which", "offset"):
                sinks.pop(name).commit()
        finally:
            for sink in sinks.values():
                sink.abort()
        write_atomic(
            paths["meta"], json.dumps({"samples": n, "datasets": D}), fsync=False, error=DataError
        )
        self.which = np.load(paths["which"], mmap_mode="r", allow_pickle=False)
        self.offset = np.load(paths["offset"], mmap_mode="r", allow_pickle=False)
        self._counts = counts

    def _build(self, n: int, save: bool) -> None:
        if self._load_cached(n):
            self._ensure_parts()
            return
        if save:
            log.info(
                "data: building the blend index of %d datasets for %s samples (rank 0; the "
                "other ranks wait)",
                len(self.datasets),
                f"{n:,}",
            )
        t0 = time.perf_counter()
        self._compute(n, self._paths() if self.cache_dir is not None and save else None)
        log.info(
            "data: blend of %d datasets (weights %s): %s samples in %.2fs",
            len(self.datasets),
            ", ".join(f"{w:.3f}" for w in self.weights),
            f"{n:,}",
            time.perf_counter() - t0,
        )
        self._ensure_parts()

    def _ensure_parts(self) -> None:
        # dataset d's samples are numbered 0, 1, 2, ... in order: it needs as many as it appears
        for d, ds in enumerate(self.datasets):
            if self._counts[d] and hasattr(ds, "ensure"):
                ds.ensure(int(self._counts[d]), build=False)

    def __len__(self) -> int:
        return len(self.which)

    def counts(self, n: int) -> np.ndarray:
        """Samples per dataset among the first n."""
        counts = np.zeros(len(self.datasets), dtype=np.int64)
        for a in range(0, min(n, len(self.which)), CHUNK):
            counts += np.bincount(self.which[a : min(a + CHUNK, n)], minlength=len(self.datasets))
        return counts

    def sample(self, g: int) -> np.ndarray:
        if g >= len(self.which):
            self._build(max(g + 1, 2 * len(self.which)), save=False)
        return self.datasets[int(self.which[g])].sample(int(self.offset[g]))

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rows = np.stack([self.sample(int(g)) for g in indices]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
