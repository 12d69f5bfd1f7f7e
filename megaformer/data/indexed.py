"""Megatron-LM's indexed dataset (``PREFIX.bin`` + ``PREFIX.idx``, magic ``MMIDIDX``, version 1).

``PREFIX.bin`` is the token ids of every sequence, back to back, in one dtype. ``PREFIX.idx`` is,
little-endian::

    magic            9 bytes   b"MMIDIDX\\x00\\x00"
    version          uint64    1
    dtype code       uint8     1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    S                uint64    number of sequences
    D                uint64    number of document boundaries (documents + 1)
    lengths          int32[S]  tokens per sequence
    pointers         int64[S]  byte offset of each sequence in .bin: p_i = itemsize * sum_{j<i} len_j
    document index   int64[D]  0 = d_0 <= d_1 <= ... <= d_{D-1} = S; document k = sequences [d_k, d_{k+1})

megaformer writes one sequence per document (so d = 0, 1, ..., S), which is what Megatron-LM's and
GPT-NeoX's ``preprocess_data.py`` write without sentence splitting; files in this layout from either
tool load here and the other way round. Reading memory-maps both files: nothing is loaded into RAM
but the three index arrays (16 bytes per sequence), and those are views on the mapping.

Writing streams tokens into ``PREFIX.bin.tmp-PID-RANDOM`` (created exclusively), keeps only the
int32 lengths in memory, writes the index as ``PREFIX.idx.tmp-PID-RANDOM`` at the end and renames ``.bin`` first and ``.idx`` last, so a
prefix whose ``.idx`` exists is complete.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megaformer.errors import DataError
from megaformer.runtime.run_lock import check_not_owned

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
CHECK_CHUNK = 1 << 20  # sequences per step of the index check on open
TOKENIZER_SUFFIX = ".tokenizer.json"  # megaformer's sidecar; ignored by Megatron-LM and GPT-NeoX


def bin_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}.idx")


def tokenizer_path(prefix: str | Path) -> Path:
    return Path(f"{prefix}{TOKENIZER_SUFFIX}")


def is_prefix(path: str | Path) -> bool:
    """True when ``path.idx`` and ``path.bin`` both exist."""
    return idx_path(path).is_file() and bin_path(path).is_file()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when the vocabulary is under 65,500 (Megatron's rule), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


TOKEN_CHUNK = 1 << 24  # tokens per step of the id range check


def check_token_ids(tokens: np.ndarray, limit: int, where: Path) -> None:
    """Every token id lies in ``[0, limit)``: the whole array, in chunks of :data:`TOKEN_CHUNK`
    (memory stays bounded whatever the file's size). Skipped when the dtype cannot hold an id out
    of range. One out-of-range id anywhere would index past the embedding, or size a
    ``bincount``, in a training or validation step."""
    info = np.iinfo(tokens.dtype)
    if info.min >= 0 and info.max < limit:
        return
    for a in range(0, len(tokens), TOKEN_CHUNK):
        chunk = tokens[a : a + TOKEN_CHUNK]
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= limit:
            bad = hi if hi >= limit else lo
            raise DataError(
                f"{where}: token id {bad} (near token {a:,}) outside the vocabulary "
                f"(size {limit}); was it prepared with another tokenizer?"
            )


def dtype_holds(dtype: np.dtype, vocab_size: int) -> bool:
    """Whether every id in ``[0, vocab_size)`` fits ``dtype``."""
    return np.issubdtype(dtype, np.integer) and vocab_size - 1 <= np.iinfo(dtype).max


def index_bytes(lengths: np.ndarray, doc_indices: np.ndarray, dtype: np.dtype) -> bytes:
    """The complete ``.idx`` file for these sequence lengths and document boundaries."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    head = HEADER.pack(MAGIC, VERSION, CODES[dtype], len(lengths), len(doc_indices))
    return head + lengths.tobytes() + pointers.tobytes() + doc_indices.tobytes()


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)


def check_output_prefix(prefix: str | Path, overwrite: bool) -> Path:
    """Refuse an output prefix whose files exist (unless ``overwrite``), whose folder is missing, or
    that lies in a run directory another live job owns."""
    prefix = Path(prefix)
    if not prefix.name:
        raise DataError(f"--output-prefix {prefix}: needs a file name, e.g. data/corpus")
    if not prefix.parent.is_dir():
        raise DataError(f"--output-prefix {prefix}: folder {prefix.parent} does not exist")
    check_not_owned(prefix.parent, "prepare-data")  # never into a run directory a live job owns
    if not overwrite:
        for p in (bin_path(prefix), idx_path(prefix)):
            if p.exists():
                raise DataError(f"{p}: already exists; pass --overwrite to replace it")
    return prefix


class IndexedWriter:
    """Appends documents to ``PREFIX.bin`` under a temporary name; :meth:`finish` publishes both files.

    Memory: a 4-byte length per document; tokens go straight to disk.
    """

    def __init__(self, prefix: str | Path, dtype: np.dtype) -> None:
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODES:
            raise DataError(f"{self.prefix}: dtype {self.dtype} has no MMIDIDX code")
        tag = f".tmp-{os.getpid()}-{os.urandom(6).hex()}"  # random, created exclusively ("x"):
        self.tmp_bin = Path(f"{bin_path(prefix)}{tag}")  # never a planted link's target
        self.tmp_idx = Path(f"{idx_path(prefix)}{tag}")
        self._fh = open(self.tmp_bin, "xb", buffering=1 << 22)
        self._lengths: list[np.ndarray] = []
        self.n_tokens = 0
        self.n_docs = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as one flat token array and their lengths (sum = len(tokens))."""
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        self._fh.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.n_tokens += len(tokens)
        self.n_docs += len(lengths)

    def finish(self) -> tuple[Path, Path]:
        """Write the index, then rename ``.bin`` and, last, ``.idx`` into place."""
        self._fh.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        with open(self.tmp_idx, "xb") as fh:
            fh.write(index_bytes(lengths, np.arange(len(lengths) + 1), self.dtype))
        _replace(self.tmp_bin, bin_path(self.prefix))
        _replace(self.tmp_idx, idx_path(self.prefix))
        return bin_path(self.prefix), idx_path(self.prefix)

    def abort(self) -> None:
        """Close and delete the temporary files (the published prefix, if any, is untouched)."""
        if not self._fh.closed:
            self._fh.close()
        for p in (self.tmp_bin, self.tmp_idx):
            p.unlink(missing_ok=True)


def _pread(fd: int, dtype: type, count: int, offset: int) -> np.ndarray:
    want = np.dtype(dtype).itemsize * count
    parts = []
    while want > 0:
        data = os.pread(fd, want, offset)
        if not data:
            raise OSError("unexpected end of file")
        parts.append(data)
        want, offset = want - len(data), offset + len(data)
    return np.frombuffer(b"".join(parts), dtype=dtype)


def _check_index(ip: Path, n_seq: int, n_doc: int, itemsize: int) -> int:
    """The ``.bin`` size in bytes that the index describes, after checking it (lengths >= 0,
    pointers their running sum, document index rising from 0 to ``n_seq``), read in chunks with
    ``pread``: bounded memory, and the index's pages are not left mapped in this process."""
    head = HEADER.size
    fd = os.open(ip, os.O_RDONLY)
    try:
        nbytes = 0
        for a in range(0, n_seq, CHECK_CHUNK):
            m = min(CHECK_CHUNK, n_seq - a)
            lengths = _pread(fd, np.int32, m, head + 4 * a)
            if int(lengths.min()) < 0:
                raise DataError(f"{ip}: corrupt (negative sequence length)")
            ends = np.cumsum(lengths, dtype=np.int64)
            ends *= itemsize
            ends += nbytes
            pointers = _pread(fd, np.int64, m, head + 4 * n_seq + 8 * a)
            if pointers[0] != nbytes or not np.array_equal(pointers[1:], ends[:-1]):
                raise DataError(f"{ip}: corrupt (sequence pointers do not follow the lengths)")
            nbytes = int(ends[-1])
        ok, last = n_doc > 0, 0
        for a in range(0, n_doc, CHECK_CHUNK):
            docs = _pread(fd, np.int64, min(CHECK_CHUNK, n_doc - a), head + 12 * n_seq + 8 * a)
            ok = (
                ok
                and (a > 0 or docs[0] == 0)
                and docs[0] >= last
                and not (docs[1:] < docs[:-1]).any()
            )
            last = int(docs[-1])
        if not ok or last != n_seq:
            raise DataError(f"{ip}: corrupt document index (must rise from 0 to {n_seq})")
    finally:
        os.close(fd)
    return nbytes


class IndexedDataset:
    """A read-only, memory-mapped ``PREFIX.bin`` / ``PREFIX.idx`` pair, validated on open.

    ``lengths[i]``, ``pointers[i]`` and ``doc_indices`` are the index arrays; ``get(i, offset, n)``
    returns tokens ``offset .. offset + n`` of sequence i as a view on the mapping.
    """

    def __init__(self, prefix: str | Path) -> None:
        self.prefix = Path(prefix)
        ip, bp = idx_path(prefix), bin_path(prefix)
        for p in (ip, bp):
            if not p.is_file():
                raise DataError(f"{p}: no such file (expected PREFIX.bin and PREFIX.idx)")
        st = ip.stat()
        size = st.st_size
        if size < HEADER.size:
            raise DataError(
                f"{ip}: truncated ({size} bytes, shorter than the {HEADER.size}-byte header)"
            )
        with open(ip, "rb") as fh:
            magic, version, code, n_seq, n_doc = HEADER.unpack(fh.read(HEADER.size))
        if magic != MAGIC:
            raise DataError(
                f"{ip}: not a Megatron indexed dataset (magic {magic[:9]!r}, expected MMIDIDX)"
            )
        if version != VERSION:
            raise DataError(f"{ip}: unsupported MMIDIDX version {version} (only 1)")
        if code not in DTYPES:
            raise DataError(f"{ip}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        expected = HEADER.size + 12 * n_seq + 8 * n_doc
        if size not in (expected, expected + n_seq):  # + n_seq: Megatron's multimodal mode bytes
            raise DataError(
                f"{ip}: truncated or corrupt ({size} bytes; the header's {n_seq} "
                f"sequences and {n_doc} document boundaries need {expected})"
            )
        self._idx = np.memmap(ip, mode="r", dtype=np.uint8)
        off = HEADER.size
        self.lengths = np.frombuffer(self._idx, np.int32, n_seq, off)
        self.pointers = np.frombuffer(self._idx, np.int64, n_seq, off + 4 * n_seq)
        self.doc_indices = np.frombuffer(self._idx, np.int64, n_doc, off + 12 * n_seq)
        nbytes = _check_index(ip, n_seq, n_doc, self.dtype.itemsize)
        bsize = bp.stat().st_size
        if bsize != nbytes:
            raise DataError(
                f"{bp}: {bsize} bytes but {ip} describes {nbytes} "
                f"({'truncated' if bsize < nbytes else 'mismatched'} .bin/.idx pair)"
            )
        self._bin = np.memmap(bp, mode="r", dtype=self.dtype) if nbytes else np.zeros(0, self.dtype)
        self._idx_id = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # what was mapped
        self._sha256: Optional[str] = None
        self._sha256_lock = threading.Lock()

    @property
    def starts(self) -> np.ndarray:
        """Token offset of each sequence (computed on use: 8 bytes per sequence)."""
        return self.pointers // self.dtype.itemsize

    def idx_identity(self) -> tuple[int, int]:
        """(size, modification time in ns) of ``PREFIX.idx`` when it was opened."""
        return self._idx_id[2], self._idx_id[3]

    def trust_sha256(self, digest: str) -> None:
        """Take ``digest`` as the ``.idx``'s sha256 (rank 0 hashed the same file: same size and
        modification time) instead of reading the file again."""
        with self._sha256_lock:
            if self._sha256 is None:
                self._sha256 = digest

    def idx_sha256(self) -> str:
        """sha256 of ``PREFIX.idx``, read once per dataset object (the cache keys of its indices);
        DataError if the file was replaced since it was opened."""
        with self._sha256_lock:
            if self._sha256 is None:
                ip = idx_path(self.prefix)
                h = hashlib.sha256()
                with open(ip, "rb") as fh:
                    st = os.fstat(fh.fileno())
                    if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._idx_id:
                        raise DataError(f"{ip}: replaced or changed while in use; run again")
                    for chunk in iter(lambda: fh.read(1 << 24), b""):
                        h.update(chunk)
                self._sha256 = h.hexdigest()
            return self._sha256

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def n_tokens(self) -> int:
        return len(self._bin)

    @property
    def tokens(self) -> np.ndarray:
        """All tokens, memory-mapped."""
        return self._bin

    def get(self, i: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        first = int(self.pointers[i]) // self.dtype.itemsize
        start = first + offset
        end = first + int(self.lengths[i]) if length is None else start + length
        return self._bin[start:end]


def merge(
    prefixes: Sequence[str | Path], output: str | Path, overwrite: bool = False
) -> IndexedDataset:
    """Concatenate prepared datasets into ``output`` (same dtype required; .bin copied in chunks).

    Document boundaries are kept: the document index of dataset j is shifted by the sequences
    before it.
    """
    if not prefixes:
        raise DataError("--merge: needs at least one prefix")
    output = check_output_prefix(output, overwrite)
    parts = [IndexedDataset(p) for p in prefixes]
    dtype = parts[0].dtype
    for p in parts[1:]:
        if p.dtype != dtype:
            raise DataError(
                f"{idx_path(p.prefix)}: dtype {p.dtype} differs from {dtype} of "
                f"{idx_path(parts[0].prefix)}; cannot merge"
            )
    sidecars = [tokenizer_path(p.prefix) for p in parts if tokenizer_path(p.prefix).is_file()]
    for s in sidecars[1:]:
        if s.read_bytes() != sidecars[0].read_bytes():
            raise DataError(f"{s}: a different tokenizer from {sidecars[0]}; cannot merge")
    tag = f".tmp-{os.getpid()}-{os.urandom(6).hex()}"  # random, created exclusively ("x")
    tmp_bin, tmp_idx = Path(f"{bin_path(output)}{tag}"), Path(f"{idx_path(output)}{tag}")
    try:
        with open(tmp_bin, "xb") as out:
            for p in parts:
                with open(bin_path(p.prefix), "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        lengths = np.concatenate([p.lengths for p in parts])
        docs, shift = [np.zeros(1, np.int64)], 0
        for p in parts:
            docs.append(p.doc_indices[1:] + shift)
            shift += len(p)
        with open(tmp_idx, "xb") as fh:
            fh.write(index_bytes(lengths, np.concatenate(docs), dtype))
        if sidecars:
            shutil.copyfile(sidecars[0], tokenizer_path(output))
        _replace(tmp_bin, bin_path(output))
        _replace(tmp_idx, idx_path(output))
    finally:
        tmp_bin.unlink(missing_ok=True)
        tmp_idx.unlink(missing_ok=True)
    return IndexedDataset(output)


def smallest_int(upper: int) -> np.dtype:
    """The smallest signed integer dtype holding every value in ``[0, upper]``."""
    for dtype in (np.int8, np.int16, np.int32):
        if upper <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)
