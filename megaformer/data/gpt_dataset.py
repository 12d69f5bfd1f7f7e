"""Packed, shuffled samples over one indexed dataset split (Megatron's GPTDataset, re-derived).

Let the split hold documents ``[a, b)`` with T tokens in all, and L = seq_len. Then:

- **document index**: epoch e visits the split's documents in the order ``a + perm_e`` with
  ``perm_e = Permutation(rng(seed, e))``; the epochs are concatenated into one endless stream S.
- **sample index**: stream sample i is ``S[i*L : i*L + L + 1]`` (inputs its first L tokens, labels its
  last L), packed across document boundaries. It is stored as (position in the document index,
  offset in that document) of token i*L, for i = 0..N, so sample i runs from entry i to entry i+1
  inclusive. Every token of the stream is an input of exactly one sample.
- **shuffle index**: the samples come in blocks of n = floor(T / L) (about one epoch each);
  block k is visited in the order ``k*n + Permutation(rng(seed, k))``.

Each index is a prefix of the one built for more epochs, so sample g never depends on how many
samples were built: a resumed run, or one with more steps, sees the same stream. The indices are
saved under ``CACHE/<hash of the settings>-*.npy`` by one rank and memory-mapped by the others. A
cache may be shared, so a cached index is used only when its files belong to this user (not
writable by others) and it passes :meth:`GPTDataset.check_indices`; otherwise it is rebuilt.

Every epoch holds the same T tokens, so epoch e covers stream tokens ``[e*T, (e+1)*T)`` and the
sample-index rows i with ``e*T <= i*L < (e+1)*T`` depend on perm_e alone. The build is therefore a
set of independent units, one per epoch (its permutation, then one walk over its documents, by a
small compiled function, else a cumulative sum and a ``searchsorted`` per :data:`DOC_CHUNK`
documents) and one per shuffle block, run on a pool of threads (numpy's shuffle, the compiled walk
and the file writes release the GIL) sized by the usable cores and by :data:`BUILD_MEMORY`; each
unit writes its rows straight into the index files (:mod:`megaformer.data.npy_files`). Checking a cached index is the same units, each
recomputing its rows from the cached permutation and comparing. A permutation is numpy's
``Generator.shuffle`` of ``arange`` in the index's own dtype (the same Fisher-Yates draws, so the
same permutation, as ``Generator.permutation``, which shuffles int64), run by a compiled copy of
numpy's loop that makes its draws ahead and prefetches the items they swap (the same permutation
again, checked against numpy by the tests), else by numpy.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch

from megaformer.data.indexed import IndexedDataset, idx_path
from megaformer.data.npy_files import ArraySink, NpyWriter
from megaformer.errors import DataError
from megaformer.safe_files import make_dir, owned_by_me, read_text_bounded, write_atomic

log = logging.getLogger("megaformer")

INDEX_VERSION = 1
SPLITS = ("train", "valid", "test")


def parse_split(split: Optional[str], valid_fraction: float) -> list[float]:
    """``'969,30,1'`` -> normalised [train, valid, test]; None -> [1 - vf, vf, 0]."""
    if split is None:
        return [1.0 - valid_fraction, valid_fraction, 0.0]
    ratios = [float(x) for x in split.split(",")]
    ratios += [0.0] * (3 - len(ratios))
    total = sum(ratios)
    return [r / total for r in ratios]


def split_ranges(n_docs: int, ratios: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous document ranges: split s = ``[round(n * c_{s-1}), round(n * c_s))``, c = cumulative."""
    bounds = [0] + [int(round(n_docs * c)) for c in np.cumsum(ratios)]
    bounds[-1] = n_docs
    return [(bounds[i], bounds[i + 1]) for i in range(len(ratios))]


def build_document_index(n_docs: int, start: int, n_epochs: int, seed: int) -> np.ndarray:
    dtype = np.int32 if start + n_docs < 2**31 else np.int64
    out = np.empty(n_epochs * n_docs, dtype=dtype)
    for e in range(n_epochs):
        out[e * n_docs : (e + 1) * n_docs] = start + np.random.default_rng([seed, e]).permutation(
            n_docs
        )
    return out


def build_sample_index(
    doc_lengths: np.ndarray, seq_len: int, n_samples: int, chunk: int = 1 << 22
) -> np.ndarray:
    """[n_samples + 1, 2]: (document-index position, offset) of stream token i * seq_len; int32
    when positions and document lengths fit it (else int64), built ``chunk`` samples at a time."""
    ends = np.cumsum(doc_lengths, dtype=np.int64)
    fits = max(len(doc_lengths), int(doc_lengths.max(initial=0))) < 2**31
    out = np.empty((n_samples + 1, 2), dtype=np.int32 if fits else np.int64)
    for a in range(0, n_samples + 1, chunk):
        targets = np.arange(a, min(a + chunk, n_samples + 1), dtype=np.int64) * seq_len
        pos = np.searchsorted(ends, targets, side="right")
        if pos[-1] >= len(doc_lengths):
            raise AssertionError("sample index ran past the document index")
        out[a : a + len(pos), 0] = pos
        out[a : a + len(pos), 1] = targets - (ends[pos] - doc_lengths[pos])
    return out


def build_shuffle_index(block: int, n_blocks: int, seed: int) -> np.ndarray:
    dtype = np.int32 if block * n_blocks < 2**31 else np.int64
    out = np.empty(block * n_blocks, dtype=dtype)
    for k in range(n_blocks):
        out[k * block : (k + 1) * block] = k * block + np.random.default_rng(
            [seed, k, 1]
        ).permutation(block)
    return out


# ----------------------------------------------------------------------------- the build in units

DOC_CHUNK = 1 << 20  # documents per step of an epoch's cumulative sum (bounds a unit's memory)
ROW_CHUNK = 1 << 20  # sample-index rows per step
BUILD_MEMORY = 2 << 30  # bytes the build (or check) units running at once may hold together
THREADS: Optional[int] = None  # threads for building and checking indices; None: the usable cores


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def processes_per_node() -> int:
    """Processes of this job on this node, as the launchers tell (1 when none does)."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


_budget = threading.Condition()
_running = {"units": 0, "bytes": 0}  # build/check units running now, in this process


@contextlib.contextmanager
def _unit_slot(unit_bytes: int, share: int) -> Iterator[None]:
    """Wait until the unit fits: fewer than the thread limit running and their bytes plus this
    unit's within the memory limit (or nothing running), over every index being built at once."""
    threads = max(1, (THREADS or usable_cores()) // share)
    limit = BUILD_MEMORY // share
    with _budget:
        _budget.wait_for(
            lambda: (
                _running["units"] == 0
                or (_running["units"] < threads and _running["bytes"] + unit_bytes <= limit)
            )
        )
        _running["units"] += 1
        _running["bytes"] += unit_bytes
    try:
        yield
    finally:
        with _budget:
            _running["units"] -= 1
            _running["bytes"] -= unit_bytes
            _budget.notify_all()


def run_units(units: Sequence[Callable[[], None]], unit_bytes: int, share: int = 1) -> None:
    """Run ``units`` (in this order of submission) on threads, at most :data:`THREADS` (default:
    the usable cores) and ``BUILD_MEMORY // unit_bytes`` at once across every call running in this
    process, the cores and memory divided by ``share`` (processes doing the same at once on this
    node); the first error is raised."""

    def slotted(unit: Callable[[], None]) -> None:
        with _unit_slot(unit_bytes, share):
            unit()

    threads = max(
        1,
        min(
            (THREADS or usable_cores()) // share,
            BUILD_MEMORY // share // max(unit_bytes, 1),
            len(units),
        ),
    )
    if threads == 1:
        for unit in units:
            slotted(unit)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="megaformer-index") as pool:
        futures = [pool.submit(slotted, unit) for unit in units]
        for f in futures:
            f.result()


def _native_rows():
    """The compiled index loops (in :mod:`megaformer.data.blend`'s library), or None (numpy then)."""
    from megaformer.data.blend import scheduler

    return scheduler()


def shuffled_range(lo: int, hi: int, dtype: np.dtype, seed: list[int]) -> np.ndarray:
    """``lo + np.random.default_rng(seed).permutation(hi - lo)`` in ``dtype``: numpy's shuffle of
    ``arange(lo, hi)``, by the compiled copy of its loop (the same draws, prefetching the items it
    swaps) where there is one."""
    out = np.arange(lo, hi, dtype=dtype)
    rng = np.random.default_rng(seed)
    lib = _native_rows()
    state = rng.bit_generator.state
    if lib is None or state["bit_generator"] != "PCG64" or out.itemsize not in (4, 8):
        rng.shuffle(out)
        return out
    mask = (1 << 64) - 1
    words = np.array(
        [
            state["state"]["state"] >> 64,
            state["state"]["state"] & mask,
            state["state"]["inc"] >> 64,
            state["state"]["inc"] & mask,
            state["has_uint32"],
            state["uinteger"],
        ],
        dtype=np.uint64,
    )
    lib.mf_shuffle(words.ctypes.data, out.ctypes.data, out.itemsize, len(out))
    return out


def epoch_rows(
    lengths: np.ndarray,
    docs: np.ndarray,
    e: int,
    n_tokens: int,
    seq_len: int,
    n_samples: int,
    dtype: np.dtype,
) -> Iterator[tuple[int, np.ndarray]]:
    """``(i0, rows)``: sample-index rows ``i0, i0 + 1, ...`` (``[m, 2]`` of ``dtype``) of the rows
    i <= ``n_samples`` whose token i*L lies in epoch ``e``, given its document order ``docs`` (ids
    into the int32 ``lengths``): (e * len(docs) + p, i*L - e*T - S(p)) for the p whose documents
    before it hold S(p) <= i*L - e*T < S(p + 1) tokens. Memory: O(DOC_CHUNK + ROW_CHUNK). A
    compiled walk over the documents where there is one, else a cumulative sum and a
    ``searchsorted`` per chunk of documents (the same rows)."""
    L, T, first = seq_len, n_tokens, e * n_tokens
    i = -(-first // L)
    i_end = min(n_samples, -(-(first + T) // L) - 1) + 1
    lib = _native_rows()
    if (
        lib is not None
        and lengths.dtype == np.int32
        and docs.dtype in (np.int32, np.int64)
        and docs.flags.c_contiguous
    ):
        state = np.zeros(2, dtype=np.int64)  # (p, S(p))
        for a in range(i, i_end, ROW_CHUNK):
            rows = np.empty((min(ROW_CHUNK, i_end - a), 2), dtype=dtype)
            if (
                lib.mf_epoch_rows(
                    lengths.ctypes.data,
                    docs.ctypes.data,
                    docs.itemsize,
                    len(docs),
                    state.ctypes.data,
                    a * L - first,
                    L,
                    len(rows),
                    e * len(docs),
                    rows.ctypes.data,
                    rows.itemsize,
                )
                != 0
            ):
                raise AssertionError("sample index ran past the document index")
            yield a, rows
        return
    base = 0  # S(p0)
    for p0 in range(0, len(docs), DOC_CHUNK):
        if i >= i_end:
            return
        lens = lengths[docs[p0 : p0 + DOC_CHUNK]]
        ends = np.cumsum(lens, dtype=np.int64)
        ends += base  # ends[k] = S(p0 + k + 1)
        stop = min(i_end, -(-(first + int(ends[-1])) // L))  # rows whose token lies in this chunk
        for a in range(i, stop, ROW_CHUNK):
            t = np.arange(a, min(a + ROW_CHUNK, stop), dtype=np.int64) * L - first
            k = np.searchsorted(ends, t, side="right")
            rows = np.empty((len(t), 2), dtype=dtype)
            rows[:, 0] = k + (e * len(docs) + p0)
            rows[:, 1] = t - ends[k] + lens[k]
            yield a, rows
        i, base = max(i, stop), int(ends[-1])
    if i < i_end:
        raise AssertionError("sample index ran past the document index")


class GPTDataset:
    """Samples of ``seq_len + 1`` tokens from documents ``[start, end)`` of an indexed dataset.

    ``sample(g)`` is the g-th sample in training order (shuffled; any g >= 0, more epochs are built
    when needed); ``len()`` is the block size n (samples per epoch), so ``g % len`` stays in block 0.
    """

    shuffled = True  # the loader takes samples in index order (the shuffle is built in)

    def __init__(
        self,
        data: IndexedDataset,
        split: str,
        doc_range: tuple[int, int],
        seq_len: int,
        seed: int,
        n_samples: int,
        cache_dir: Optional[Path],
        build: bool = True,
        trusted: frozenset[str] = frozenset(),
    ) -> None:
        self.data = data
        self.trusted = trusted  # cache keys rank 0 checked in this run: not checked again here
        self.cached_key: Optional[str] = None  # the cache entry the indices came from
        self.split = split
        self.start, self.end = doc_range
        self.seq_len = seq_len
        self.seed = seed
        self.cache_dir = cache_dir
        lengths = data.lengths[self.start : self.end]  # int32, a view on the .idx mapping
        self.n_tokens = int(lengths.sum(dtype=np.int64))
        self.n_docs = self.end - self.start
        self.block = self.n_tokens // seq_len
        if self.n_tokens < seq_len + 1:
            raise DataError(
                f"{idx_path(data.prefix)}: the {split} split has {self.n_tokens} tokens "
                f"({self.n_docs} documents), fewer than seq_len + 1 = {seq_len + 1}; use "
                "more data, another data.split or a shorter data.seq_len"
            )
        self._lengths = lengths
        self.n_built = 0
        self.ensure(n_samples, build=build)

    # ------------------------------------------------------------------------- indices

    def key(self) -> str:
        settings = {
            "version": INDEX_VERSION,
            "idx_sha256": self.data.idx_sha256(),
            "split": self.split,
            "docs": [self.start, self.end],
            "seq_len": self.seq_len,
            "seed": self.seed,
        }
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
        return f"{self.data.prefix.name}-{self.split}-{digest}"

    def _blocks_for(self, n_samples: int) -> int:
        return max(1, -(-n_samples // self.block))

    def _layout(
        self, n_blocks: int
    ) -> tuple[int, int, dict[str, tuple[np.dtype, tuple[int, ...]]]]:
        """(samples, epochs, {index: (dtype, shape)}) of the indices for ``n_blocks`` blocks: the
        smallest of int32/int64 that holds each index's values."""
        n = n_blocks * self.block
        n_epochs = -(-(n * self.seq_len + 1) // self.n_tokens)
        max_len = int(self._lengths.max(initial=0))
        small = np.dtype(np.int32)
        big = np.dtype(np.int64)
        return (
            n,
            n_epochs,
            {
                "doc": (small if self.end < 2**31 else big, (n_epochs * self.n_docs,)),
                "sample": (
                    small if max(n_epochs * self.n_docs, max_len) < 2**31 else big,
                    (n + 1, 2),
                ),
                "shuffle": (small if n < 2**31 else big, (n,)),
            },
        )

    def _unit_bytes(self) -> int:
        """Bound on what one build or check unit holds: an epoch's order (and a seen-mask when
        checking), one chunk of lengths and sums, one chunk of rows."""
        return 9 * max(self.n_docs, self.block) + 16 * DOC_CHUNK + 64 * ROW_CHUNK

    def _compute(
        self, n_blocks: int, paths: Optional[dict[str, Path]] = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The three indices for ``n_blocks`` blocks, in memory, or written straight into ``paths``
        (renamed into place once complete) and returned memory-mapped."""
        n, n_epochs, layout = self._layout(n_blocks)
        sinks: dict = {}
        try:
            for name, (dtype, shape) in layout.items():
                sinks[name] = (
                    NpyWriter(paths[name], dtype, shape) if paths else ArraySink(dtype, shape)
                )
            doc_t, sample_t, shuffle_t = (layout[k][0] for k in ("doc", "sample", "shuffle"))
            lengths = self.data.lengths

            def epoch(e: int) -> None:
                docs = shuffled_range(self.start, self.end, doc_t, [self.seed, e])
                sinks["doc"].put(e * self.n_docs, docs)
                for i0, rows in epoch_rows(
                    lengths, docs, e, self.n_tokens, self.seq_len, n, sample_t
                ):
                    sinks["sample"].put(i0, rows)

            def block(k: int) -> None:
                order = shuffled_range(
                    k * self.block, (k + 1) * self.block, shuffle_t, [self.seed, k, 1]
                )
                sinks["shuffle"].put(k * self.block, order)

            run_units(
                [lambda e=e: epoch(e) for e in range(n_epochs)]
                + [lambda k=k: block(k) for k in range(n_blocks)],
                self._unit_bytes(),
            )
            if not paths:
                return sinks["doc"].array, sinks["sample"].array, sinks["shuffle"].array
            for name in layout:
                sinks.pop(name).commit()
        finally:
            for sink in sinks.values():
                if isinstance(sink, NpyWriter):
                    sink.abort()
        return tuple(
            np.load(paths[name], mmap_mode="r", allow_pickle=False)  # type: ignore[return-value]
            for name in layout
        )

    def _paths(self, key: str) -> dict[str, Path]:
        assert self.cache_dir is not None
        return {name: self.cache_dir / f"{key}-{name}.npy" for name in ("doc", "sample", "shuffle")}

    def _load_cached(self, key: str, n_blocks: int, share: int = 1) -> bool:
        """The cached indices when they are this user's own files (not writable by others) and
        pass :meth:`check_indices` (on the cores and memory divided by ``share``; only their
        shapes when rank 0 checked them in this run: ``key`` in :attr:`trusted`); anything else
        is ignored (rebuilt), with a warning when the files exist but are refused."""
        meta = self.cache_dir / f"{key}.json" if self.cache_dir else None
        if meta is None or not (meta.is_file() or meta.is_symlink()):
            return False
        paths = [meta, *self._paths(key).values()]
        if not all(owned_by_me(p) for p in paths):
            log.warning(
                "data: ignoring the cached index %s: its files must be regular files of "
                "this user, not writable by group or others",
                meta,
            )
            return False
        try:
            info = json.loads(read_text_bounded(meta, 1 << 16, DataError))
            blocks = int(info["blocks"])
            if blocks < n_blocks:
                return False
            arrays = [np.load(p, mmap_mode="r", allow_pickle=False) for p in paths[1:]]
            if key in self.trusted:
                self.check_shapes(*arrays, blocks)
            else:
                self.check_indices(*arrays, blocks, share=share)
        except (OSError, ValueError, KeyError, TypeError, DataError, RecursionError) as e:
            log.warning(
                "data: ignoring the cached index %s (%s); rebuilding it",
                meta,
                " ".join(str(e).split())[:200],
            )
            return False
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        self.n_built = len(self.shuffle_idx)
        self.cached_key = key
        return True

    def check_shapes(
        self, doc_idx: np.ndarray, sample_idx: np.ndarray, shuffle: np.ndarray, n_blocks: int
    ) -> None:
        """ValueError unless the three arrays have the shapes and integer types :meth:`_compute`
        gives for ``n_blocks`` (the part of :meth:`check_indices` that reads no values)."""
        _, _, layout = self._layout(n_blocks)
        for name, arr in (("doc", doc_idx), ("sample", sample_idx), ("shuffle", shuffle)):
            shape = layout[name][1]
            if arr.shape != shape or arr.dtype.kind not in "iu":
                raise ValueError(
                    f"{name} index has shape {arr.shape} ({arr.dtype}), expected {shape}"
                )

    def check_indices(
        self,
        doc_idx: np.ndarray,
        sample_idx: np.ndarray,
        shuffle: np.ndarray,
        n_blocks: int,
        share: int = 1,
    ) -> None:
        """ValueError unless the three arrays are exactly the shapes :meth:`_compute` gives for
        ``n_blocks`` and consistent with this split: every epoch of the document index a
        permutation of ``[start, end)``, every sample-index entry the (position, offset) of stream
        token ``i * seq_len``, every shuffle block a permutation of its own samples. A poisoned
        cache therefore cannot point outside the data, allocate, or change which tokens a sample
        holds. Checked by the build's units (an epoch: its permutation, then its sample rows
        recomputed from it and compared; a shuffle block), in their bounded memory, no sort."""
        self.check_shapes(doc_idx, sample_idx, shuffle, n_blocks)
        n, n_epochs, _ = self._layout(n_blocks)
        lengths = self.data.lengths

        def is_permutation(values: np.ndarray, lo: int) -> bool:
            if len(values) == 0:
                return True
            if int(values.min()) < lo or int(values.max()) >= lo + len(values):
                return False
            seen = np.zeros(len(values), dtype=bool)
            seen[values - values.dtype.type(lo)] = True
            return bool(seen.all())  # len(values) values in range, all hit: a permutation

        def epoch(e: int) -> None:
            docs = np.array(doc_idx[e * self.n_docs : (e + 1) * self.n_docs])
            if not is_permutation(docs, self.start):
                raise ValueError(
                    f"epoch {e} of the document index is not a permutation of the split"
                )
            for i0, rows in epoch_rows(lengths, docs, e, self.n_tokens, self.seq_len, n, np.int64):
                if not np.array_equal(sample_idx[i0 : i0 + len(rows)], rows):
                    raise ValueError("sample index does not match the documents' lengths")

        def block(k: int) -> None:
            if not is_permutation(
                np.array(shuffle[k * self.block : (k + 1) * self.block]), k * self.block
            ):
                raise ValueError("shuffle index is not a permutation of each block")

        run_units(
            [lambda e=e: epoch(e) for e in range(n_epochs)]
            + [lambda k=k: block(k) for k in range(n_blocks)],
            self._unit_bytes(),
            share,
        )

    def _write_meta(self, key: str, n_blocks: int) -> None:
        meta = self.cache_dir / f"{key}.json"  # type: ignore[operator]
        write_atomic(
            meta,
            json.dumps({"blocks": n_blocks, "block": self.block, "prefix": str(self.data.prefix)}),
            fsync=False,
            error=DataError,
        )

    def ensure(self, n_samples: int, build: bool = True) -> None:
        """Make samples ``[0, n_samples)`` available: from the cache, or built (and cached when
        ``build``: written into the cache folder, private to this user (0700 when created here),
        under random exclusive temporary names renamed into place, the ``.json`` last); a rank with
        ``build=False`` only reads the cache, and computes in memory if it is not there."""
        if n_samples <= self.n_built:
            return
        n_blocks = self._blocks_for(n_samples)
        key = self.key() if self.cache_dir is not None else ""
        # rank 0 checks a cached index alone (the others wait); the others all at once
        if key and self._load_cached(key, n_blocks, share=1 if build else processes_per_node()):
            return
        t0 = time.perf_counter()
        if build:
            log.info(
                "data: building the %s index of %s for %s samples (rank 0; the other ranks wait)",
                self.split,
                self.data.prefix,
                f"{n_blocks * self.block:,}",
            )
        if key and build:
            make_dir(self.cache_dir, mode=0o700, error=DataError)  # type: ignore[arg-type]
            self.doc_idx, self.sample_idx, self.shuffle_idx = self._compute(
                n_blocks, self._paths(key)
            )
            self._write_meta(key, n_blocks)
            self.cached_key = key
        else:
            self.doc_idx, self.sample_idx, self.shuffle_idx = self._compute(n_blocks)
        self.n_built = len(self.shuffle_idx)
        log.info(
            "data: %s split of %s: index of %s samples (%d blocks of %s) built in %.2fs",
            self.split,
            self.data.prefix,
            f"{self.n_built:,}",
            n_blocks,
            f"{self.block:,}",
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------------- reading

    def __len__(self) -> int:
        return self.block

    def stream_sample(self, i: int) -> np.ndarray:
        """Stream sample i (unshuffled): seq_len + 1 tokens."""
        (p0, o0), (p1, o1) = self.sample_idx[i], self.sample_idx[i + 1]
        if p0 == p1:
            return np.asarray(self.data.get(int(self.doc_idx[p0]), int(o0), int(o1 - o0 + 1)))
        parts = [self.data.get(int(self.doc_idx[p0]), int(o0))]
        parts += [self.data.get(int(d)) for d in self.doc_idx[p0 + 1 : p1]]
        parts.append(self.data.get(int(self.doc_idx[p1]), 0, int(o1) + 1))
        return np.concatenate(parts)

    def sample(self, g: int) -> np.ndarray:
        if g >= self.n_built:
            self.ensure(max(g + 1, 2 * self.n_built), build=False)
        return self.stream_sample(int(self.shuffle_idx[g]))

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each [len(indices), seq_len] int64."""
        rows = np.stack([self.sample(int(g)) for g in indices]).astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def build_split_datasets(
    prefix: str | Path,
    ratios: Sequence[float],
    seq_len: int,
    seed: int,
    n_samples: Sequence[int],
    cache_dir: Optional[Path],
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
) -> list[Optional[GPTDataset]]:
    """One :class:`GPTDataset` per split with a non-zero ratio (None for the others).

    Rank 0 builds and caches the indices first; the other ranks then read the cache.
    """
    return build_many_split_datasets(
        [prefix], ratios, seq_len, seed, [n_samples], cache_dir, rank, barrier
    )[0]


def _open_splits(
    prefix: str | Path | IndexedDataset,
    ratios: Sequence[float],
    seq_len: int,
    n_samples: Sequence[int],
) -> tuple[IndexedDataset, list[tuple[int, int]]]:
    data = prefix if isinstance(prefix, IndexedDataset) else IndexedDataset(prefix)
    ranges = split_ranges(len(data), ratios)
    for name, (a, b), r, n in zip(SPLITS, ranges, ratios, n_samples):  # every rank fails alike
        tokens = int(data.lengths[a:b].sum(dtype=np.int64))
        if r > 0 and n > 0 and tokens < seq_len + 1:
            raise DataError(
                f"{idx_path(data.prefix)}: the {name} split has {tokens} tokens ({b - a} "
                f"documents), fewer than seq_len + 1 = {seq_len + 1}; use more data, "
                "another data.split or a shorter data.seq_len"
            )
    return data, ranges


def _each(fn: Callable, items: Sequence) -> list:
    """``[fn(x) for x in items]``, on up to one thread per item (as many as the usable cores);
    the first error in item order is raised."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(
        min(len(items), usable_cores()), thread_name_prefix="megaformer-data"
    ) as pool:
        return list(pool.map(fn, items))


def build_many_split_datasets(
    prefixes: Sequence[str | Path | IndexedDataset],
    ratios: Sequence[float],
    seq_len: int,
    seed: int,
    n_samples: Sequence[Sequence[int]],
    cache_dir: Optional[Path],
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    share: Optional[Callable[[Any], Any]] = None,
) -> list[list[Optional[GPTDataset]]]:
    """:func:`build_split_datasets` for each prefix (``n_samples[j]`` per split of prefix j),
    the datasets opened (unless given open), hashed and indexed concurrently (their build units
    share one budget of threads and memory), with one wait: rank 0 builds and caches every index,
    then the other ranks read the cache. With ``share`` (rank 0's object on every rank, a
    collective) rank 0 alone validates: the others take its ``.idx`` digests and its checked
    cache entries (:func:`validated`) and hash or re-check nothing."""
    opened = _each(
        lambda j: _open_splits(prefixes[j], ratios, seq_len, n_samples[j]), range(len(prefixes))
    )

    def make(
        j: int, build: bool, trusted: frozenset[str] = frozenset()
    ) -> list[Optional[GPTDataset]]:
        data, ranges = opened[j]
        return [
            GPTDataset(data, name, rng, seq_len, seed, n, cache_dir, build=build, trusted=trusted)
            if r > 0 and n > 0
            else None
            for name, rng, r, n in zip(SPLITS, ranges, ratios, n_samples[j])
        ]

    out = _each(lambda j: make(j, True), range(len(prefixes))) if rank == 0 else None
    barrier()
    trusted: frozenset[str] = frozenset()
    if share is not None:
        verdict = share(validated(out) if out is not None else None)
        if out is None:
            trusted = trust(verdict, [opened[j][0] for j in range(len(prefixes))])
    return (
        out if out is not None else _each(lambda j: make(j, False, trusted), range(len(prefixes)))
    )


def validated(built: list[list[Optional[GPTDataset]]]) -> dict:
    """What rank 0 checked, for the other ranks to trust: each ``.idx``'s sha256 with the file's
    size and modification time, and the cache entries it loaded (checked) or built."""
    digests, keys = {}, []
    for split in built:
        for ds in split:
            if ds is not None and ds.cached_key is not None:
                size, mtime = ds.data.idx_identity()
                digests[str(ds.data.prefix)] = [size, mtime, ds.data.idx_sha256()]
                keys.append(ds.cached_key)
    return {"idx": digests, "keys": keys}


def trust(verdict: Optional[dict], datasets: Sequence[IndexedDataset]) -> frozenset[str]:
    """Take rank 0's digests (:func:`validated`) for the ``.idx`` files that are still what it
    hashed (same size and modification time); returns the cache entries it checked."""
    if not verdict:
        return frozenset()
    for data in datasets:
        record = verdict["idx"].get(str(data.prefix))
        if record is not None and list(data.idx_identity()) == record[:2]:
            data.trust_sha256(record[2])
    return frozenset(verdict["keys"])
