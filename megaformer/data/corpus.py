"""Reading documents from a local text source.

A *source* is ``stdlib`` (the ``.py`` files of the running interpreter's standard library: present on
every machine with Python, so the quickstart needs no download), a folder (its text files, recursively,
in sorted order), or a single ``.txt`` / ``.json`` / ``.jsonl`` file. Each file is one document, except
JSON files, where each record's ``text_field`` is one document. The full pipeline (HF ``datasets``,
Megatron indexed data) plugs in behind the same ``iter_documents`` seam.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Optional

from megaformer.errors import DataError

TEXT_SUFFIXES = (".txt", ".md", ".py", ".json", ".jsonl", ".rst")
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without installed third-party packages, in sorted order."""
    return list(iter_stdlib_files())


def iter_stdlib_files() -> Iterator[Path]:
    """:func:`stdlib_files` one at a time, each folder listed when the walk reaches it: a walk
    that visits each folder's entries sorted by name yields paths in sorted order (paths sort
    component by component), so a reader that stops after a few files lists a few folders, not
    the whole library."""
    yield from _py_files(Path(sysconfig.get_paths()["stdlib"]))


def _py_files(folder: Path) -> Iterator[Path]:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if entry.name in _SKIP_DIRS:
            continue
        if entry.is_dir(follow_symlinks=False):
            yield from _py_files(folder / entry.name)
        elif entry.name.endswith(".py"):
            yield folder / entry.name


def _nonempty(files: Iterator[Path]) -> Iterator[Path]:
    """``files``, or the stdlib source's error if there are none."""
    first = next(files, None)
    if first is None:
        raise DataError("data.source=stdlib: no .py files found in this Python's standard library")
    yield first
    yield from files


def source_files(source: str) -> list[Path]:
    """Resolve a source spec to the list of files it reads (sorted, deterministic)."""
    if source == "stdlib":
        files = stdlib_files()
        if not files:
            raise DataError(
                "data.source=stdlib: no .py files found in this Python's standard library"
            )
        return files
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source={source!r}: no such file or folder")
    if path.is_dir():
        files = sorted(
            f
            for f in path.rglob("*")
            if f.is_file() and f.suffix in TEXT_SUFFIXES and not _SKIP_DIRS.intersection(f.parts)
        )
        if not files:
            raise DataError(
                f"data.source={source!r}: folder holds no text files ({', '.join(TEXT_SUFFIXES)})"
            )
        return files
    if path.suffix not in TEXT_SUFFIXES:
        raise DataError(
            f"data.source={source!r}: unsupported file type '{path.suffix}' "
            f"(use one of {', '.join(TEXT_SUFFIXES)})"
        )
    return [path]


def _json_documents(path: Path, text_field: str) -> Iterator[str]:
    def text_of(record: object, where: str) -> str:
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{where}: record has no field '{text_field}' (set data.text_field)")
        value = record[text_field]
        if not isinstance(value, str):
            raise DataError(f"{where}: field '{text_field}' is not a string")
        return value

    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    raise DataError(f"{path}:{lineno}: not valid JSON") from None
                yield text_of(record, f"{path}:{lineno}")
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError:
        raise DataError(f"{path}: not valid JSON") from None
    records = data if isinstance(data, list) else [data]
    for i, record in enumerate(records):
        yield text_of(record, f"{path}[{i}]")


def iter_documents(
    source: str, text_field: str = "text", max_bytes: Optional[int] = None
) -> Iterator[str]:
    """Yield the non-empty documents of ``source``, stopping after ``max_bytes`` bytes of text."""
    total = 0
    files = source_files(source) if source != "stdlib" else _nonempty(iter_stdlib_files())
    for path in files:
        if path.suffix in (".json", ".jsonl"):
            docs: Iterator[str] = _json_documents(path, text_field)
        else:
            try:
                docs = iter([path.read_text(encoding="utf-8", errors="replace")])
            except OSError as e:
                raise DataError(f"{path}: cannot read ({e.strerror})") from None
        for doc in docs:
            if not doc.strip():
                continue
            if max_bytes is not None and total + len(doc) > max_bytes:
                remaining = max_bytes - total
                if remaining > 0:
                    yield doc[:remaining]
                return
            total += len(doc)
            yield doc
