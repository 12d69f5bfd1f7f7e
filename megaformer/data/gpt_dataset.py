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
built with vectorised numpy (a permutation, a cumulative sum and a ``searchsorted``), saved under
``CACHE/<hash of the settings>-*.npy`` by one rank and memory-mapped by the others. A cache may be
shared, so a cached index is used only when its files belong to this user (not writable by others)
and it passes :meth:`GPTDataset.check_indices`; otherwise it is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from megaformer.data.indexed import IndexedDataset, idx_path
from megaformer.errors import DataError
from megaformer.safe_files import make_dir, owned_by_me, read_text_bounded, temp_path, write_atomic

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
        out[e * n_docs:(e + 1) * n_docs] = start + np.random.default_rng([seed, e]).permutation(n_docs)
    return out


def build_sample_index(doc_lengths: np.ndarray, seq_len: int, n_samples: int,
                       chunk: int = 1 << 22) -> np.ndarray:
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
        out[a:a + len(pos), 0] = pos
        out[a:a + len(pos), 1] = targets - (ends[pos] - doc_lengths[pos])
    return out


def build_shuffle_index(block: int, n_blocks: int, seed: int) -> np.ndarray:
    dtype = np.int32 if block * n_blocks < 2**31 else np.int64
    out = np.empty(block * n_blocks, dtype=dtype)
    for k in range(n_blocks):
        out[k * block:(k + 1) * block] = k * block + np.random.default_rng([seed, k, 1]).permutation(block)
    return out


class GPTDataset:
    """Samples of ``seq_len + 1`` tokens from documents ``[start, end)`` of an indexed dataset.

    ``sample(g)`` is the g-th sample in training order (shuffled; any g >= 0, more epochs are built
    when needed); ``len()`` is the block size n (samples per epoch), so ``g % len`` stays in block 0.
    """

    shuffled = True  # the loader takes samples in index order (the shuffle is built in)

    def __init__(self, data: IndexedDataset, split: str, doc_range: tuple[int, int], seq_len: int,
                 seed: int, n_samples: int, cache_dir: Optional[Path], build: bool = True) -> None:
        self.data = data
        self.split = split
        self.start, self.end = doc_range
        self.seq_len = seq_len
        self.seed = seed
        self.cache_dir = cache_dir
        lengths = data.lengths[self.start:self.end]  # int32, a view on the .idx mapping
        self.n_tokens = int(lengths.sum(dtype=np.int64))
        self.n_docs = self.end - self.start
        self.block = self.n_tokens // seq_len
        if self.n_tokens < seq_len + 1:
            raise DataError(f"{idx_path(data.prefix)}: the {split} split has {self.n_tokens} tokens "
                            f"({self.n_docs} documents), fewer than seq_len + 1 = {seq_len + 1}; use "
                            "more data, another data.split or a shorter data.seq_len")
        self._lengths = lengths
        self.n_built = 0
        self.ensure(n_samples, build=build)

    # ------------------------------------------------------------------------- indices

    def key(self) -> str:
        h = hashlib.sha256()
        with open(idx_path(self.data.prefix), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
        settings = {"version": INDEX_VERSION, "idx_sha256": h.hexdigest(), "split": self.split,
                    "docs": [self.start, self.end], "seq_len": self.seq_len, "seed": self.seed}
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
        return f"{self.data.prefix.name}-{self.split}-{digest}"

    def _blocks_for(self, n_samples: int) -> int:
        return max(1, -(-n_samples // self.block))

    def _compute(self, n_blocks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = n_blocks * self.block
        n_epochs = -(-(n * self.seq_len + 1) // self.n_tokens)
        doc_idx = build_document_index(self.n_docs, self.start, n_epochs, self.seed)
        sample_idx = build_sample_index(self._lengths[doc_idx - self.start], self.seq_len, n)
        shuffle = build_shuffle_index(self.block, n_blocks, self.seed)
        return doc_idx, sample_idx, shuffle

    def _paths(self, key: str) -> dict[str, Path]:
        assert self.cache_dir is not None
        return {name: self.cache_dir / f"{key}-{name}.npy" for name in ("doc", "sample", "shuffle")}

    def _load_cached(self, key: str, n_blocks: int) -> bool:
        """The cached indices when they are this user's own files (not writable by others) and
        pass :meth:`check_indices`; anything else is ignored (rebuilt), with a warning when the
        files exist but are refused."""
        meta = self.cache_dir / f"{key}.json" if self.cache_dir else None
        if meta is None or not (meta.is_file() or meta.is_symlink()):
            return False
        paths = [meta, *self._paths(key).values()]
        if not all(owned_by_me(p) for p in paths):
            log.warning("data: ignoring the cached index %s: its files must be regular files of "
                        "this user, not writable by group or others", meta)
            return False
        try:
            info = json.loads(read_text_bounded(meta, 1 << 16, DataError))
            blocks = int(info["blocks"])
            if blocks < n_blocks:
                return False
            arrays = [np.load(p, mmap_mode="r", allow_pickle=False) for p in paths[1:]]
            self.check_indices(*arrays, blocks)
        except (OSError, ValueError, KeyError, TypeError, DataError) as e:
            log.warning("data: ignoring the cached index %s (%s); rebuilding it", meta,
                        " ".join(str(e).split())[:200])
            return False
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        self.n_built = len(self.shuffle_idx)
        return True

    def check_indices(self, doc_idx: np.ndarray, sample_idx: np.ndarray, shuffle: np.ndarray,
                      n_blocks: int) -> None:
        """ValueError unless the three arrays are exactly the shapes :meth:`_compute` gives for
        ``n_blocks`` and consistent with this split: every epoch of the document index a
        permutation of ``[start, end)``, every sample-index entry the (position, offset) of stream
        token ``i * seq_len``, every shuffle block a permutation of its own samples. A poisoned
        cache therefore cannot point outside the data, allocate, or change which tokens a sample
        holds (O(N) numpy passes, no sort)."""
        n = n_blocks * self.block
        n_epochs = -(-(n * self.seq_len + 1) // self.n_tokens)
        for name, arr, shape in (("doc", doc_idx, (n_epochs * self.n_docs,)),
                                 ("sample", sample_idx, (n + 1, 2)), ("shuffle", shuffle, (n,))):
            if arr.shape != shape or arr.dtype.kind not in "iu":
                raise ValueError(f"{name} index has shape {arr.shape} ({arr.dtype}), expected {shape}")
        docs = np.asarray(doc_idx, dtype=np.int64) - self.start
        if len(docs) and (docs.min() < 0 or docs.max() >= self.n_docs):
            raise ValueError("document index outside the split")
        counts = np.bincount(docs + np.repeat(np.arange(n_epochs, dtype=np.int64) * self.n_docs,
                                              self.n_docs), minlength=len(docs))
        if not (counts == 1).all():
            raise ValueError("an epoch of the document index is not a permutation of the split")
        pos, off = np.asarray(sample_idx[:, 0], dtype=np.int64), np.asarray(sample_idx[:, 1], np.int64)
        if pos.min() < 0 or pos.max() >= len(docs):
            raise ValueError("sample index outside the document index")
        lengths = self._lengths[docs[pos]]
        ends = np.cumsum(self._lengths[docs], dtype=np.int64)[pos]
        if (off < 0).any() or (off >= lengths).any() or \
                not (ends - lengths + off == np.arange(n + 1, dtype=np.int64) * self.seq_len).all():
            raise ValueError("sample index does not match the documents' lengths")
        sh = np.asarray(shuffle, dtype=np.int64)
        if len(sh) and (sh.min() < 0 or sh.max() >= n or
                        not (sh // self.block == np.arange(n) // self.block).all() or
                        not (np.bincount(sh, minlength=n) == 1).all()):
            raise ValueError("shuffle index is not a permutation of each block")

    def _save(self, key: str, n_blocks: int) -> None:
        """Write the indices: cache folder private to this user (0700 when created here), each
        file under a random exclusive temporary name, renamed into place."""
        make_dir(self.cache_dir, mode=0o700, error=DataError)  # type: ignore[arg-type]
        for arr, path in zip((self.doc_idx, self.sample_idx, self.shuffle_idx), self._paths(key).values()):
            tmp = temp_path(path, ".npy")
            try:
                with open(tmp, "wb") as fh:
                    np.save(fh, arr)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        meta = self.cache_dir / f"{key}.json"  # type: ignore[operator]
        write_atomic(meta, json.dumps({"blocks": n_blocks, "block": self.block,
                                       "prefix": str(self.data.prefix)}), fsync=False, error=DataError)

    def ensure(self, n_samples: int, build: bool = True) -> None:
        """Make samples ``[0, n_samples)`` available: from the cache, or built (and cached when
        ``build``); a rank with ``build=False`` only reads the cache, and computes in memory if it
        is not there."""
        if n_samples <= self.n_built:
            return
        n_blocks = self._blocks_for(n_samples)
        key = self.key() if self.cache_dir is not None else ""
        if key and self._load_cached(key, n_blocks):
            return
        t0 = time.perf_counter()
        if build:
            log.info("data: building the %s index of %s for %s samples (rank 0; the other ranks "
                     "wait)", self.split, self.data.prefix, f"{n_blocks * self.block:,}")
        self.doc_idx, self.sample_idx, self.shuffle_idx = self._compute(n_blocks)
        self.n_built = len(self.shuffle_idx)
        if key and build:
            self._save(key, n_blocks)
            self.doc_idx, self.sample_idx, self.shuffle_idx = (  # memory-mapped, as on other ranks
                np.load(p, mmap_mode="r", allow_pickle=False) for p in self._paths(key).values())
        log.info("data: %s split of %s: index of %s samples (%d blocks of %s) built in %.2fs",
                 self.split, self.data.prefix, f"{self.n_built:,}", n_blocks, f"{self.block:,}",
                 time.perf_counter() - t0)

    # ------------------------------------------------------------------------- reading

    def __len__(self) -> int:
        return self.block

    def stream_sample(self, i: int) -> np.ndarray:
        """Stream sample i (unshuffled): seq_len + 1 tokens."""
        (p0, o0), (p1, o1) = self.sample_idx[i], self.sample_idx[i + 1]
        if p0 == p1:
            return np.asarray(self.data.get(int(self.doc_idx[p0]), int(o0), int(o1 - o0 + 1)))
        parts = [self.data.get(int(self.doc_idx[p0]), int(o0))]
        parts += [self.data.get(int(d)) for d in self.doc_idx[p0 + 1:p1]]
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


def build_split_datasets(prefix: str | Path, ratios: Sequence[float], seq_len: int, seed: int,
                         n_samples: Sequence[int], cache_dir: Optional[Path], rank: int = 0,
                         barrier: Callable[[], None] = lambda: None) -> list[Optional[GPTDataset]]:
    """One :class:`GPTDataset` per split with a non-zero ratio (None for the others).

    Rank 0 builds and caches the indices first; the other ranks then read the cache.
    """
    data = IndexedDataset(prefix)
    ranges = split_ranges(len(data), ratios)
    for name, (a, b), r, n in zip(SPLITS, ranges, ratios, n_samples):  # every rank fails alike
        tokens = int(data.lengths[a:b].sum(dtype=np.int64))
        if r > 0 and n > 0 and tokens < seq_len + 1:
            raise DataError(f"{idx_path(data.prefix)}: the {name} split has {tokens} tokens ({b - a} "
                            f"documents), fewer than seq_len + 1 = {seq_len + 1}; use more data, "
                            "another data.split or a shorter data.seq_len")

    def make(build: bool) -> list[Optional[GPTDataset]]:
        return [GPTDataset(data, name, rng, seq_len, seed, n, cache_dir, build=build)
                if r > 0 and n > 0 else None
                for name, rng, r, n in zip(SPLITS, ranges, ratios, n_samples)]

    out = make(True) if rank == 0 else None
    barrier()
    return out if out is not None else make(False)
