"""Index arrays written piece by piece, straight into their ``.npy`` file or into memory.

An index of N rows is produced in independent pieces (an epoch, a shuffle block, a chunk of the
blend), possibly by several threads at once. :class:`NpyWriter` writes each piece at its place in a
``.npy`` file (the header that ``numpy.save`` writes, then the rows in C order, so the bytes are
those of ``numpy.save`` of the whole array) under a random exclusive temporary name beside the
target, renamed into place by :meth:`NpyWriter.commit`: the whole array is never held in memory, and
a reader sees the complete file or none. :class:`ArraySink` is the same interface over an array in
memory.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from megaformer.safe_files import temp_path


def npy_header(dtype: np.dtype, shape: Sequence[int]) -> bytes:
    """The header ``numpy.save`` writes for a C-ordered array of this dtype and shape."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf,
        {
            "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
            "fortran_order": False,
            "shape": tuple(shape),
        },
    )
    return buf.getvalue()


class ArraySink:
    """Rows ``[row, row + len(piece))`` of an array in memory, filled by :meth:`put`."""

    def __init__(self, dtype: np.dtype, shape: Sequence[int]) -> None:
        self.array = np.empty(tuple(shape), dtype=dtype)

    def put(self, row: int, piece: np.ndarray) -> None:
        self.array[row : row + len(piece)] = piece


class NpyWriter:
    """A ``.npy`` file of known dtype and shape, written by :meth:`put` in any order, from any
    thread (``os.pwrite`` at each piece's offset), then published by :meth:`commit` (or deleted by
    :meth:`abort`)."""

    def __init__(self, path: Path, dtype: np.dtype, shape: Sequence[int]) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.row_bytes = self.dtype.itemsize * int(np.prod(self.shape[1:], dtype=np.int64))
        header = npy_header(self.dtype, self.shape)
        self.offset = len(header)
        self.tmp = temp_path(self.path, ".npy")  # mkstemp: new, exclusive, private
        self._fd = os.open(self.tmp, os.O_WRONLY)
        try:
            self._write(header, 0)
            os.ftruncate(self._fd, self.offset + self.row_bytes * self.shape[0])
        except BaseException:
            self.abort()
            raise

    def _write(self, data, at: int) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            done = os.pwrite(self._fd, view, at)
            view, at = view[done:], at + done

    def put(self, row: int, piece: np.ndarray) -> None:
        piece = np.ascontiguousarray(piece, dtype=self.dtype)
        if row < 0 or row + len(piece) > self.shape[0] or piece.shape[1:] != self.shape[1:]:
            raise ValueError(f"rows {row}..{row + len(piece)} {piece.shape} outside {self.shape}")
        self._write(piece, self.offset + row * self.row_bytes)

    def commit(self) -> None:
        os.close(self._fd)
        self._fd = -1
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)
