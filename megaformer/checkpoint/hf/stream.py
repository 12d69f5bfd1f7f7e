"""Streaming tensor conversion: read safetensors tensor by tensor, write safetensors shards.

Reading parses each file's header (validated against the file size) and reads one tensor at a time
with plain file reads, not a memory map, so converted tensors do not stay resident.

A conversion is a *plan*: a list of :class:`Entry` (output name, input names, function). Running it
first evaluates every function on ``meta`` tensors (shapes only, no data) to lay out the output
shards and write their headers, then computes the outputs one at a time and appends their bytes.
At any moment the process holds one output tensor and the inputs it is made of, so peak memory is
about the largest tensor group (e.g. the embedding), not the model.

The safetensors format (what :func:`SafetensorsShardWriter` writes byte by byte):

    [8 bytes: header length N, little-endian u64] [N bytes: JSON header] [tensor bytes]

the header mapping each name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
byte buffer after the header, in order, without holes) plus ``"__metadata__"`` (strings).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from megaformer.checkpoint.safetensors_check import read_header
from megaformer.checkpoint.weights import check_shapes
from megaformer.errors import CheckpointError, ConversionError
from megaformer.safe_files import read_text_bounded, regular_files

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")
MAX_INDEX_BYTES = 256 * 1024 * 1024

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CODES = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """Output tensor ``out`` = ``fn(*inputs)``, the inputs read by name from the source."""

    out: str
    inputs: tuple[str, ...]
    fn: Callable[..., torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def rename(out: str, src: str) -> Entry:
    """``out`` is ``src`` unchanged."""
    return Entry(out, (src,), _same)


def is_rename(e: Entry) -> bool:
    """``e`` copies one input unchanged (any part of it can be read as that part of the input)."""
    return e.fn is _same


def _stack(*parts: torch.Tensor) -> torch.Tensor:
    return torch.stack(parts)


def stack(out: str, srcs: tuple[str, ...]) -> Entry:
    """``out`` is ``srcs`` stacked along a new dim 0 (one expert's tensor per index)."""
    return Entry(out, srcs, _stack)


def is_stack(e: Entry) -> bool:
    """``e`` stacks its inputs (index i of dim 0 is input i, unchanged)."""
    return e.fn is _stack


def zeros(out: str, size: int) -> Entry:
    """A zero vector of ``size`` (a bias the target format requires and the source lacks)."""
    return Entry(out, (), lambda: torch.zeros(size))


def parse_size(text: str) -> int:
    """'5GB' -> 5*10^9, '500MiB' -> 500*2^20, '1000' -> 1000 bytes (Hugging Face's convention)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B?)\s*", text.upper())
    if not m or (m.group(3) == "I"):
        raise ConversionError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or 2GiB")
    base = 1024 if m.group(3) == "IB" else 1000
    size = int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))
    if size <= 0:
        raise ConversionError(f"--max-shard-size {text!r}: must be positive")
    return size


class SafetensorsFile:
    """One safetensors file read with plain ``pread`` calls (no memory map, so pages of tensors
    already converted do not stay resident). The header is validated against the file size: a
    truncated or tampered file is refused, naming it, before any tensor is used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise ConversionError(f"{path}: missing weights file")
        header = read_header(path)  # size and every tensor's byte range checked against it
        header.pop("__metadata__", None)
        # read_header checked size == 8 + header length + end of the last tensor
        data_start = path.stat().st_size - max(
            (e["data_offsets"][1] for e in header.values()), default=0
        )
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        end = 0
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            (begin, stop), dtype = e["data_offsets"], _DTYPES.get(e["dtype"])
            if dtype is None:
                self._corrupt(f"tensor {name} has dtype {e['dtype']}, which torch cannot hold")
            if begin != end:  # tensors packed back to back, as safetensors writes them
                self._corrupt(f"tensor {name} has offsets {begin}..{stop}, expected {end}..")
            self.entries[name] = (dtype, tuple(e["shape"]), data_start + begin, stop - begin)
            end = stop

    def _corrupt(self, why: str) -> None:
        raise CheckpointError(f"{self.path}: corrupt safetensors file ({why})")

    def keys(self) -> list[str]:
        return list(self.entries)

    def meta(self, name: str) -> torch.Tensor:
        dtype, shape, _, _ = self.entries[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        dtype, shape, offset, nbytes = self.entries[name]
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(nbytes)
        with open(self.path, "rb") as fh:
            fh.seek(offset)
            if fh.readinto(buf) != nbytes:
                self._corrupt(f"short read of tensor {name}")
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


class TensorSource:
    """Tensors of one ``model.safetensors`` or of a sharded folder (``model.safetensors.index.json``);
    only headers are read up front, :meth:`get` reads one tensor into memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file() or index.is_symlink():
            try:
                weight_map = json.loads(read_text_bounded(index, MAX_INDEX_BYTES, ConversionError))[
                    "weight_map"
                ]
                names = set(weight_map.values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
                raise ConversionError(f"{index}: not a safetensors index (no weight_map)") from None
            regular_files([index], ConversionError)
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index}: not a safetensors index (no weight_map)")
            for fname in sorted(names, key=str):
                if not shard_name_ok(fname):
                    raise ConversionError(
                        f"{index}: weight_map names {str(fname)[:80]!r}; expected "
                        "a plain *.safetensors file name inside the folder"
                    )
            paths = sorted(folder / f for f in names)
        elif (folder / SINGLE_FILE).is_file():
            weight_map, paths = None, [folder / SINGLE_FILE]
        else:
            raise ConversionError(
                f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                "weights are read; pickled .bin files are refused)"
            )
        regular_files(paths, ConversionError)  # no links, devices or folders as shards
        self._files: dict[str, SafetensorsFile] = {}
        for path in paths:
            f = SafetensorsFile(path)
            for name in f.keys():
                self._files[name] = f
        if weight_map is not None:
            for name, fname in weight_map.items():
                if name not in self._files or self._files[name].path.name != fname:
                    raise ConversionError(
                        f"{index}: lists {name} in {fname}, which does not hold it"
                    )

    def keys(self) -> list[str]:
        return sorted(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def file_of(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            raise ConversionError(f"{self.folder}: missing tensor {name}")
        return self._files[name]

    def meta(self, name: str) -> torch.Tensor:
        """A ``meta`` tensor with the stored shape and dtype (no data read)."""
        return self.file_of(name).meta(name)

    def get(self, name: str) -> torch.Tensor:
        return self.file_of(name).get(name)


def shard_name_ok(name: object) -> bool:
    """A weight_map entry is a plain file name (no folder part, no '..', not hidden) ending in
    ``.safetensors``."""
    return (
        isinstance(name, str)
        and SHARD_NAME.fullmatch(name) is not None
        and name not in (".", "..")
        and not name.startswith(".")
    )


def _where(source: object) -> str:
    """How errors name a tensor source (any object with ``keys``/``meta``/``get``)."""
    return str(getattr(source, "folder", "the source checkpoint"))


def check_inputs(plan: list[Entry], source: TensorSource, ignore: Callable[[str], bool]) -> None:
    """Every input the plan reads exists; every source tensor is read (or known to be ignorable):
    a tensor nobody maps would otherwise be silently dropped. ``source``: a
    :class:`TensorSource` or any object with its ``keys``/``meta``/``get``."""
    used = {name for e in plan for name in e.inputs}
    names = set(source.keys())
    missing = sorted(used - names)
    if missing:
        raise ConversionError(f"{_where(source)}: missing tensor {missing[0]}")
    extra = [k for k in sorted(names) if k not in used and not ignore(k)]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConversionError(
            f"{_where(source)}: tensor {extra[0]}{more} has no counterpart in the "
            "target format; refusing to drop it"
        )


def output_specs(
    plan: list[Entry], source: TensorSource, dtype: Optional[torch.dtype]
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every output, computed on meta tensors (no data read)."""
    specs = []
    for e in plan:
        with torch.device("meta"):
            out = e.fn(*(source.meta(n) for n in e.inputs))
        specs.append((e.out, tuple(out.shape), dtype or out.dtype))
    return specs


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


class SafetensorsShardWriter:
    """Writes tensors, in a fixed announced order, into shards of at most ``max_bytes`` each
    (a tensor larger than that gets a shard of its own). One shard is named ``model.safetensors``;
    several are ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``."""

    def __init__(
        self,
        folder: Path,
        specs: list[tuple[str, tuple[int, ...], torch.dtype]],
        max_bytes: Optional[int] = None,
        metadata: Optional[dict[str, str]] = None,
    ) -> None:
        self.folder = folder
        self.metadata = {"format": "pt", **(metadata or {})}
        self.shards: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = [[]]
        size = 0
        for spec in specs:
            nb = _nbytes(spec[1], spec[2])
            if self.shards[-1] and max_bytes is not None and size + nb > max_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(spec)
            size += nb
        n = len(self.shards)
        self.names = (
            [SINGLE_FILE]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self.total_size = sum(_nbytes(s[1], s[2]) for s in specs)
        self._order = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._pos = 0
        self._fh = None
        self._shard = -1

    def _start_shard(self, i: int) -> None:
        if self._fh is not None:
            self._finish_shard()
        header: dict = {"__metadata__": self.metadata}
        offset = 0
        for name, shape, dtype in self.shards[i]:
            nb = _nbytes(shape, dtype)
            header[name] = {
                "dtype": _CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nb],
            }
            offset += nb
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data, as safetensors does
        self._fh = open(self.folder / self.names[i], "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)
        self._shard = i

    def _finish_shard(self) -> None:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor; it must be the one announced next, with its shape and dtype."""
        shard, (exp_name, shape, dtype) = self._order[self._pos]
        if name != exp_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise RuntimeError(
                f"writer expected {exp_name} {shape} {dtype}, got {name} "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        if shard != self._shard:
            self._start_shard(shard)
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        if t.numel():
            self._fh.write(t.view(torch.uint8).numpy().data)  # the tensor's own bytes, no copy
        self._pos += 1

    def close(self) -> list[str]:
        """Finish the last shard (and write the index when sharded); returns the file names."""
        if self._pos != len(self._order):
            raise RuntimeError(f"writer closed after {self._pos} of {len(self._order)} tensors")
        if self._fh is None and self._order:
            self._start_shard(0)
        if self._fh is not None:
            self._finish_shard()
        if len(self.names) > 1:
            weight_map = {name: self.names[i] for i, (name, _, _) in self._order}
            index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            return [*self.names, INDEX_FILE]
        return list(self.names)


def run_plan(
    plan: list[Entry],
    source: TensorSource,
    folder: Path,
    dtype: Optional[torch.dtype],
    max_bytes: Optional[int] = None,
    metadata: Optional[dict[str, str]] = None,
    ignore: Callable[[str], bool] = lambda name: False,
    expected_out: Optional[dict[str, tuple[int, ...]]] = None,
) -> list[str]:
    """Check, lay out and stream ``plan`` from ``source`` into safetensors file(s) in ``folder``.

    ``expected_out``: the shapes the outputs must have (from the config); checked on meta tensors
    before anything is computed."""
    check_inputs(plan, source, ignore)
    specs = output_specs(plan, source, dtype)
    if expected_out is not None:
        check_shapes([(n, s) for n, s, _ in specs], expected_out, _where(source), ConversionError)
    writer = SafetensorsShardWriter(folder, specs, max_bytes, metadata)
    for e in plan:
        out = e.fn(*(source.get(n) for n in e.inputs))
        writer.write(e.out, out.to(dtype) if dtype is not None else out)
        del out
    return writer.close()
