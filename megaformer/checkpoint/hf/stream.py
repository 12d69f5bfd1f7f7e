"""Streaming tensor conversion: read safetensors tensor by tensor, write safetensors shards.

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

from megaformer.errors import CheckpointError, ConversionError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_CODES = {v: k for k, v in _DTYPES.items()}
DTYPE_NAMES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Entry:
    """Output tensor ``out`` = ``fn(*inputs)``, the inputs read by name from the source."""

    out: str
    inputs: tuple[str, ...]
    fn: Callable[..., torch.Tensor]


def rename(out: str, src: str) -> Entry:
    """``out`` is ``src`` unchanged."""
    return Entry(out, (src,), lambda t: t)


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


class TensorSource:
    """Tensors of one ``model.safetensors`` or of a sharded folder (``model.safetensors.index.json``),
    opened lazily (memory-mapped); :meth:`get` copies one tensor into memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError):
                raise ConversionError(f"{index}: not a safetensors index (no weight_map)") from None
            self.files = {name: folder / fname for name, fname in weight_map.items()}
        elif (folder / SINGLE_FILE).is_file():
            self.files = None
        else:
            raise ConversionError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors "
                                  "weights are read; pickled .bin files are refused)")
        self._handles: dict[Path, object] = {}
        self._names: dict[str, Path] = {}
        paths = sorted(set(self.files.values())) if self.files else [folder / SINGLE_FILE]
        for path in paths:
            for name in self._open(path).keys():
                self._names[name] = path
        if self.files:
            missing = sorted(set(self.files) - set(self._names))
            if missing:
                raise ConversionError(f"{index}: lists {missing[0]} in {self.files[missing[0]].name}, "
                                      "which does not hold it")

    def _open(self, path: Path):
        if path not in self._handles:
            from safetensors import safe_open

            if not path.is_file():
                raise ConversionError(f"{path}: missing weights file")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # SafetensorError, OSError: truncated or tampered header/data
                raise CheckpointError(f"{path}: corrupt safetensors file "
                                      f"({str(e).splitlines()[0][:200]})") from None
        return self._handles[path]

    def keys(self) -> list[str]:
        return sorted(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def file_of(self, name: str) -> Path:
        if name not in self._names:
            raise ConversionError(f"{self.folder}: missing tensor {name}")
        return self._names[name]

    def meta(self, name: str) -> torch.Tensor:
        """A ``meta`` tensor with the stored shape and dtype (reads only the header)."""
        sl = self._open(self.file_of(name)).get_slice(name)
        return torch.empty(sl.get_shape(), dtype=_DTYPES[sl.get_dtype()], device="meta")

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of(name)
        try:
            return self._open(path).get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} "
                                  f"({str(e).splitlines()[0][:200]})") from None


def check_inputs(plan: list[Entry], source: TensorSource, ignore: Callable[[str], bool]) -> None:
    """Every input the plan reads exists; every source tensor is read (or known to be ignorable):
    a tensor nobody maps would otherwise be silently dropped."""
    used = {name for e in plan for name in e.inputs}
    for name in sorted(used):
        source.file_of(name)
    extra = [k for k in source.keys() if k not in used and not ignore(k)]
    if extra:
        raise ConversionError(f"{source.folder}: tensor {extra[0]} (and {len(extra) - 1} more) has no "
                              "counterpart in the target format; refusing to drop it"
                              if len(extra) > 1 else
                              f"{source.folder}: tensor {extra[0]} has no counterpart in the target "
                              "format; refusing to drop it")


def output_specs(plan: list[Entry], source: TensorSource,
                 dtype: Optional[torch.dtype]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
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

    def __init__(self, folder: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_bytes: Optional[int] = None, metadata: Optional[dict[str, str]] = None) -> None:
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
        self.names = ([SINGLE_FILE] if n == 1 else
                      [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)])
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
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + nb]}
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
            raise RuntimeError(f"writer expected {exp_name} {shape} {dtype}, got {name} "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
        if shard != self._shard:
            self._start_shard(shard)
        t = tensor.detach().to("cpu").contiguous()
        self._fh.write(t.view(torch.uint8).numpy().tobytes() if t.dim() else
                       t.reshape(1).view(torch.uint8).numpy().tobytes())
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


def run_plan(plan: list[Entry], source: TensorSource, folder: Path, dtype: Optional[torch.dtype],
             max_bytes: Optional[int] = None, metadata: Optional[dict[str, str]] = None,
             ignore: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Check, lay out and stream ``plan`` from ``source`` into safetensors file(s) in ``folder``."""
    check_inputs(plan, source, ignore)
    writer = SafetensorsShardWriter(folder, output_specs(plan, source, dtype), max_bytes, metadata)
    for e in plan:
        out = e.fn(*(source.get(n) for n in e.inputs))
        writer.write(e.out, out.to(dtype) if dtype is not None else out)
        del out
    return writer.close()
