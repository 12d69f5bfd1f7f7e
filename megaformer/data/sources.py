"""Documents from a source spec, streamed in batches through Hugging Face ``datasets``.

A spec is, in this order of precedence:

- ``stdlib``: the ``.py`` files of the running Python's standard library (one document per file);
- a local file, folder (searched recursively) or glob of ``.json``/``.jsonl`` (one document per
  record's ``text_field``), ``.parquet``/``.arrow`` (one per row), ``.txt``/``.md``/``.py``/``.rst``
  (one document per file; ``sample_by`` = ``line`` or ``paragraph`` splits them), optionally
  compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``);
- ``hf:NAME[:CONFIG][@SPLIT]``: a Hugging Face hub dataset (split defaults to ``train``), streamed
  by default. Only this explicit prefix reaches the network: a spec naming nothing local is an
  error naming it, never a hub lookup. ``HF_HUB_OFFLINE=1`` is honoured (the hub reading then uses
  the local Hugging Face cache only, and says so when that fails). Hub datasets are read as data:
  the ``datasets`` versions megaformer requires never run a dataset's loading script.

Consecutive files of one kind are read by one ``load_dataset(..., streaming=True)`` call, so memory
is one batch whatever the corpus size. Errors (missing field, invalid UTF-8, broken JSON) name the
file: on failure the files of the group are re-read one by one to find the culprit.
"""

from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from megaformer.errors import DataError

log = logging.getLogger("megaformer")

BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
    ".md": "text",
    ".py": "text",
    ".rst": "text",
}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
SAMPLE_BY = ("document", "paragraph", "line")

JSON_CHUNK_BYTES = 1 << 20  # bytes of a .json/.jsonl file that datasets parses at once


def _builder(path: Path) -> Optional[str]:
    name = path.name
    for c in COMPRESSION:
        if name.endswith(c):
            name = name[: -len(c)]
    return BUILDERS.get(Path(name).suffix)


@dataclass
class SourceStats:
    documents: int = 0
    empty: int = 0
    empty_where: list[str] = field(default_factory=list)


@dataclass
class Source:
    """A resolved spec: local files grouped by builder, or one hub dataset."""

    spec: str
    text_field: str = "text"
    sample_by: str = "document"
    files: list[Path] = field(default_factory=list)
    hub: Optional[tuple[str, Optional[str], str]] = None  # name, config, split
    streaming: bool = True
    encoding_errors: str = "strict"  # 'replace' for stdlib, whose test data holds non-UTF-8 files
    stats: SourceStats = field(default_factory=SourceStats)

    @property
    def total_bytes(self) -> Optional[int]:
        return sum(f.stat().st_size for f in self.files) if self.files else None

    def fingerprint(self) -> list:
        """What identifies the content: file names, sizes and mtimes, or the hub coordinates."""
        if self.hub is not None:
            return ["hub", *self.hub]
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]

    def batches(self, batch_size: int = 1024) -> Iterator[list[str]]:
        """Lists of non-empty documents; empty / whitespace-only ones are counted and skipped."""
        self.stats = SourceStats()
        for where, texts in self._raw_batches(batch_size):
            keep = [t for t in texts if t is not None and t.strip()]
            if len(keep) != len(texts):
                self.stats.empty += len(texts) - len(keep)
                if where not in self.stats.empty_where:
                    self.stats.empty_where.append(where)
            self.stats.documents += len(keep)
            if keep:
                yield keep

    def documents(self) -> Iterator[str]:
        for batch in self.batches():
            yield from batch

    # ------------------------------------------------------------------------- reading

    def _raw_batches(self, batch_size: int) -> Iterator[tuple[str, list]]:
        if self.hub is not None:
            yield from self._hub_batches(batch_size)
            return
        group: list[Path] = []
        for f in self.files + [None]:  # type: ignore[list-item]
            if group and (f is None or _builder(f) != _builder(group[0])):
                yield from self._group_batches(group, batch_size)
                group = []
            if f is not None:
                group.append(f)

    def _load(self, builder: str, files: list[Path]) -> Any:
        import datasets

        datasets.disable_progress_bars()
        kwargs: dict[str, Any] = {}
        if builder == "json":  # datasets' default reads 10 MB per batch (and grows its parse
            kwargs["chunksize"] = JSON_CHUNK_BYTES  # block up to that): bound it lower
        if builder == "text":
            kwargs["sample_by"] = self.sample_by
            kwargs["encoding_errors"] = self.encoding_errors
        return datasets.load_dataset(
            builder, data_files=[str(f) for f in files], split="train", streaming=True, **kwargs
        )

    def _group_batches(self, files: list[Path], batch_size: int) -> Iterator[tuple[str, list]]:
        builder = _builder(files[0])
        column = "text" if builder == "text" else self.text_field
        where = str(files[0]) if len(files) == 1 else f"{self.spec} ({files[0].parent})"
        try:
            for batch in self._load(builder, files).iter(batch_size=batch_size):
                if column not in batch:
                    raise _MissingField(sorted(batch))
                yield where, _strings(batch[column], column)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - re-read file by file to name the culprit
            raise self._locate(builder, files, column, e) from None

    def _locate(self, builder: str, files: list[Path], column: str, error: Exception) -> DataError:
        candidates = files if len(files) > 1 else []
        for f in candidates:
            try:
                for batch in self._load(builder, [f]).iter(batch_size=4096):
                    if column not in batch:
                        raise _MissingField(sorted(batch))
                    _strings(batch[column], column)
            except Exception as e:  # noqa: BLE001
                return DataError(f"{f}: {_describe(e, column)}")
        return DataError(
            f"{files[0] if len(files) == 1 else self.spec}: {_describe(error, column)}"
        )

    def _hub_batches(self, batch_size: int) -> Iterator[tuple[str, list]]:
        import datasets

        name, config, split = self.hub  # type: ignore[misc]
        where = f"{name}{':' + config if config else ''}@{split}"
        datasets.disable_progress_bars()
        try:
            ds = datasets.load_dataset(name, config, split=split, streaming=self.streaming)
            it = ds.iter(batch_size=batch_size)
            for batch in it:
                if self.text_field not in batch:
                    raise _MissingField(sorted(batch))
                yield where, _strings(batch[self.text_field], self.text_field)
        except DataError:
            raise
        except (_MissingField, _NotText) as e:
            raise DataError(f"{where}: {_describe(e, self.text_field)}") from None
        except Exception as e:  # noqa: BLE001 - hub / network / builder errors
            msg = " ".join(str(e).split())[:300]
            offline = ", offline: HF_HUB_OFFLINE is set" if hub_offline() else ""
            raise DataError(
                f"{where}: cannot load from the Hugging Face hub{offline} "
                f"({type(e).__name__}: {msg})"
            ) from None


class _MissingField(Exception):
    def __init__(self, fields: list[str]) -> None:
        super().__init__(", ".join(fields))
        self.fields = fields


class _NotText(Exception):
    pass


def _strings(values: list, column: str) -> list:
    for v in values:
        if v is not None and not isinstance(v, str):
            raise _NotText(type(v).__name__)
    return values


def _describe(e: Exception, column: str) -> str:
    if isinstance(e, _MissingField):
        return (
            f"no field '{column}' (fields: {', '.join(e.fields) or 'none'}); "
            f"choose one with --text-field / data.text_field"
        )
    if isinstance(e, _NotText):
        return f"field '{column}' holds {e} values, not text"
    if isinstance(e, UnicodeDecodeError):
        return f"invalid UTF-8 (byte {e.start} of a document: {e.reason})"
    text = " ".join(str(e).split())
    if "utf-8" in text.lower() or "utf8" in text.lower():
        return f"invalid UTF-8 ({text[:200]})"
    if "JSON" in text or "json" in text:
        return f"not valid JSON ({text[:200]})"
    return f"cannot read ({type(e).__name__}: {text[:200]})"


def _expand_local(spec: str) -> Optional[list[Path]]:
    """The files a local spec names, or None when it names nothing local."""
    path = Path(spec).expanduser()
    if path.is_dir():
        skip = {"site-packages", "dist-packages", "__pycache__"}
        return sorted(
            f
            for f in path.rglob("*")
            if f.is_file() and _builder(f) and not skip.intersection(f.relative_to(path).parts)
        )
    if path.is_file():
        return [path]
    if glob.has_magic(spec):
        return sorted(
            Path(p)
            for p in glob.glob(os.path.expanduser(spec), recursive=True)
            if Path(p).is_file()
        )
    return None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE) is set to a true value."""
    return any(
        os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
        for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    )


def parse_hub_spec(spec: str) -> tuple[str, Optional[str], str]:
    """``NAME[:CONFIG][@SPLIT]`` -> (name, config or None, split)."""
    spec = spec[3:] if spec.startswith("hf:") else spec
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    if not name:
        raise DataError(f"{spec!r}: expected a hub dataset NAME[:CONFIG][@SPLIT]")
    return name, config or None, split or "train"


def open_source(
    spec: str, text_field: str = "text", sample_by: str = "document", streaming: bool = True
) -> Source:
    """Resolve ``spec`` (see the module docstring) without reading any document yet."""
    if sample_by not in SAMPLE_BY:
        raise DataError(f"--sample-by {sample_by}: must be one of {', '.join(SAMPLE_BY)}")
    src = Source(spec, text_field, sample_by, streaming=streaming)
    if spec == "stdlib":
        from megaformer.data.corpus import stdlib_files

        src.files = stdlib_files()
        src.encoding_errors = "replace"
        return src
    if not spec.startswith("hf:"):
        files = _expand_local(spec)
        if files is not None:
            if not files:
                raise DataError(f"{spec}: no .json/.jsonl/.parquet/.arrow/.txt files found")
            bad = [f for f in files if _builder(f) is None]
            if bad:
                raise DataError(
                    f"{bad[0]}: unsupported file type (use .json, .jsonl, .parquet, "
                    ".arrow or .txt, optionally compressed)"
                )
            src.files = files
            return src
        raise DataError(
            f"{spec}: no such file, folder, glob match or PREFIX.bin/.idx pair (a "
            "Hugging Face hub dataset needs the prefix hf:, e.g. hf:NAME[:CONFIG][@SPLIT])"
        )
    src.hub = parse_hub_spec(spec)
    return src
