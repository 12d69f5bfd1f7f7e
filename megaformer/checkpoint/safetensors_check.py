"""Refusing a truncated or tampered safetensors file before any tensor is read from it.

A safetensors file is ``u64 n | n bytes of JSON header | data``; every tensor's header entry names
its dtype, shape and ``data_offsets = [begin, end)`` into the data. A file is accepted when

    size = 8 + n + max(end),   end - begin = numel(shape) * itemsize(dtype)   for every tensor,

so a cut-off file, a grown file, or an edited header is a :class:`CheckpointError` naming the file
(bit flips inside the data are not detected: that would need a checksum over every byte).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

from megaformer.errors import CheckpointError

ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
MAX_HEADER = 100 * 1024 * 1024


def read_header(path: Path) -> dict:
    """The header of ``path`` (tensor name -> dtype/shape/data_offsets), after checking that the
    file's size and every tensor's byte range agree with it."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: truncated or tampered: corrupt safetensors file ({why})")

    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{path}: not a regular file (devices, folders and FIFOs are refused)"
            )
        size = st.st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise bad(f"header length {n} does not fit the file's {size} bytes")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (ValueError, RecursionError):  # not JSON/UTF-8, nested too deeply, an over-long int
        raise bad("header is not JSON") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = entry["data_offsets"]
            shape = entry["shape"]
            if not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0
                for d in [*shape, begin, stop]
            ):
                raise ValueError
            need = math.prod(shape) * ITEMSIZE[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            raise bad(f"malformed entry for {name!r}") from None
        if stop - begin != need or begin < 0:
            raise bad(f"{name!r} spans {stop - begin} bytes, its shape needs {need}")
        end = max(end, stop)
    if 8 + n + end != size:
        raise bad(f"{size} bytes on disk, the header describes {8 + n + end}")
    return header
