"""Writing into a run directory (or a cache) without following links, and reading bounded files.

Run directories, model folders and data caches are things users download and share, often on
shared filesystems. Every write megaformer makes into one follows three rules:

- an entry that is a symbolic link is refused, never written through (a linked ``metrics.jsonl``
  or ``checkpoints/`` would otherwise redirect the write, or a deletion, to the link's target);
- a file is replaced by writing a temporary with a random, exclusively created name in the same
  folder (``tempfile.mkstemp``: ``O_CREAT | O_EXCL``, mode 0600), flushing it, and renaming it
  over the target (``rename`` replaces a link itself, never its target);
- an appended file is opened with ``O_NOFOLLOW``.

Files that are read whole (configs, JSON metadata) are read only when they are regular files of a
bounded size, so a ``config.yaml`` linked to ``/dev/zero`` is refused instead of read forever.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterable, Optional, Type

from megaformer.errors import CheckpointError, UserError

MAX_TEXT_BYTES = 64 * 1024 * 1024  # configs, meta.json, indexes: far below this in practice

# Entries of a run directory megaformer writes to (or deletes in).
RUN_DIR_ENTRIES = (
    "checkpoints",
    "logs",
    "metrics.jsonl",
    "config.yaml",
    "tokenizer.json",
    "data_cache",
    "report",
    "tensorboard",
    "wandb",
    "wandb_run_id",
    "profile",
    "stragglers.json",
    "layout.json",
)
# Folders of a run directory whose entries megaformer (or a library it drives) writes. W&B's own
# wandb/ folder holds a link it makes itself (latest-run); the folder may not be a link.
RUN_DIR_FOLDERS = ("checkpoints", "logs", "report", "data_cache", "tensorboard", "profile")


def refuse_link(path: Path, error: Type[UserError] = CheckpointError) -> None:
    """Raise ``error`` when ``path`` is a symbolic link (a missing path is fine)."""
    if os.path.islink(path):
        raise error(
            f"{path}: is a symbolic link; megaformer does not write through links in a "
            "run directory or cache (replace it by a real file or folder)"
        )


def check_run_dir(run_dir: Path, error: Type[UserError] = CheckpointError) -> None:
    """Refuse a run directory whose entries (:data:`RUN_DIR_ENTRIES`), the entries of its folders
    (:data:`RUN_DIR_FOLDERS`), or the files of its checkpoints are symbolic links.

    The run directory itself may be a link (scratch space); what megaformer writes inside it may not.
    """
    run_dir = Path(run_dir)
    for name in RUN_DIR_ENTRIES:
        refuse_link(run_dir / name, error)
    for folder in RUN_DIR_FOLDERS:
        if (run_dir / folder).is_dir():
            for entry in (run_dir / folder).iterdir():
                refuse_link(entry, error)
                if folder == "checkpoints" and entry.is_dir():  # config.yaml, tokenizer.json, ...
                    for item in entry.iterdir():
                        refuse_link(item, error)


def make_dir(path: Path, mode: int = 0o777, error: Type[UserError] = CheckpointError) -> Path:
    """``mkdir -p`` that refuses ``path`` when it is a link (or not a folder); every folder it
    creates, the missing parents included, gets ``mode`` (less the umask)."""
    path = Path(path)
    refuse_link(path, error)
    missing = []
    parent = path
    while not os.path.lexists(parent) and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for folder in reversed(missing):
        folder.mkdir(mode=mode, exist_ok=True)
    if not path.is_dir():
        raise error(f"{path}: exists and is not a folder")
    return path


def write_atomic(
    path: Path,
    data: str | bytes,
    *,
    fsync: bool = True,
    error: Type[UserError] = CheckpointError,
    mode: Optional[int] = 0o644,
) -> None:
    """Replace ``path`` by ``data``: a random exclusive temporary beside it, flushed, renamed.

    ``mode`` (default 0644, as an ordinary file) is applied to the temporary before the rename;
    None keeps mkstemp's private 0600."""
    path = Path(path)
    refuse_link(path.parent, error)
    refuse_link(path, error)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def temp_path(target: Path, suffix: str = "") -> Path:
    """A new, empty, exclusively created file beside ``target`` with a random name (the caller
    writes it and renames it over ``target``, or deletes it)."""
    fd, tmp = tempfile.mkstemp(
        prefix=f".tmp-{Path(target).name}.", suffix=suffix, dir=Path(target).parent
    )
    os.close(fd)
    return Path(tmp)


def open_append(path: Path, error: Type[UserError] = CheckpointError):
    """Open ``path`` for appending text without following a link at its name."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if os.path.islink(path):
            refuse_link(path, error)
        raise error(f"{path}: cannot open for writing ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(f"{path}: not a regular file")
    return os.fdopen(fd, "a")


def read_bounded(
    path: Path, limit: int = MAX_TEXT_BYTES, error: Type[UserError] = CheckpointError
) -> bytes:
    """The bytes of ``path`` when it is a regular file of at most ``limit`` bytes, else ``error``.

    The check is made on the opened file (``fstat``), so a path swapped between check and read
    cannot slip a device or a larger file in."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{path}: missing") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror})") from None
    return _read_fd(fd, Path(path), limit, error)


READ_CHUNK = 1 << 20


def _read_fd(fd: int, path: Path, limit: int, error: Type[UserError]) -> bytes:
    """Read (and close) ``fd``: a regular file of at most ``limit`` bytes, read in chunks so that
    memory follows the bytes the file holds, never the bound."""
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file")
        if st.st_size > limit:
            raise error(
                f"{path}: {st.st_size} bytes, more than the {limit} a file of this kind may hold"
            )
        chunks, total = [], 0
        while total <= limit:
            chunk = fh.read(min(READ_CHUNK, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    if total > limit:
        raise error(f"{path}: more than the {limit} bytes a file of this kind may hold")
    return b"".join(chunks)


# ----------------------------------------------------------------------------- reading inside a folder


def open_inside(root: Path, relative: str | Path, error: Type[UserError] = CheckpointError) -> int:
    """A read-only descriptor of ``root/relative``, opened one component at a time relative to its
    parent's descriptor with ``O_NOFOLLOW``: a symbolic link anywhere below ``root`` (a linked
    ``state/`` folder as much as a linked ``tokenizer.json``) is refused, never followed. ``root``
    itself is the folder the user named and may be a link. The final component is opened
    non-blocking (a FIFO does not hang) and must be a regular file."""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or any(p in (".", "..") for p in parts):
        raise error(f"{root}: {str(relative)[:80]!r} is not a plain path inside it")
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        raise error(f"{root}: cannot open ({e.strerror})") from None
    try:
        for i, part in enumerate(parts):
            here = Path(root).joinpath(*parts[: i + 1])
            last = i == len(parts) - 1
            flags = (
                os.O_RDONLY
                | nofollow
                | (getattr(os, "O_NONBLOCK", 0) if last else getattr(os, "O_DIRECTORY", 0))
            )
            try:
                child = os.open(part, flags, dir_fd=fd)
            except OSError as e:
                refuse_read_link(here, error)
                if isinstance(e, FileNotFoundError):
                    raise error(f"{here}: missing") from None
                raise error(f"{here}: cannot read ({e.strerror})") from None
            os.close(fd)
            fd = child
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{Path(root, relative)}: not a regular file")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_inside(
    root: Path,
    relative: str | Path,
    limit: int = MAX_TEXT_BYTES,
    error: Type[UserError] = CheckpointError,
) -> bytes:
    """The bytes of ``root/relative`` (:func:`open_inside`: no link followed below ``root``), a
    regular file of at most ``limit`` bytes."""
    return _read_fd(open_inside(root, relative, error), Path(root, relative), limit, error)


def read_text_inside(
    root: Path,
    relative: str | Path,
    limit: int = MAX_TEXT_BYTES,
    error: Type[UserError] = CheckpointError,
) -> str:
    data = read_inside(root, relative, limit, error)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise error(f"{Path(root, relative)}: not a UTF-8 text file") from None


def copy_inside(
    root: Path, relative: str | Path, target: Path, error: Type[UserError] = CheckpointError
) -> None:
    """Copy ``root/relative`` (opened by :func:`open_inside`) to ``target``, a new file."""
    fd = open_inside(root, relative, error)
    with os.fdopen(fd, "rb") as src, open(target, "xb") as dst:
        while chunk := src.read(READ_CHUNK):
            dst.write(chunk)


def refuse_links_below(root: Path, error: Type[UserError] = CheckpointError) -> None:
    """No entry anywhere below ``root`` is a symbolic link (``root`` itself may be one): a
    checkpoint is checked whole before any of its files is read, including those handed to
    libraries that open by path (safetensors, tokenizers)."""
    for folder, dirs, files in os.walk(root):  # os.walk does not descend into linked folders
        for name in dirs + files:
            refuse_read_link(Path(folder) / name, error)


def refuse_read_link(path: Path, error: Type[UserError] = CheckpointError) -> None:
    """Raise ``error`` when ``path`` is a symbolic link (a missing path is fine)."""
    if os.path.islink(path):
        raise error(
            f"{path}: is a symbolic link; megaformer does not read through links in a "
            "run directory or checkpoint"
        )


def read_text_bounded(
    path: Path, limit: int = MAX_TEXT_BYTES, error: Type[UserError] = CheckpointError
) -> str:
    data = read_bounded(path, limit, error)
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise error(f"{path}: not a UTF-8 text file") from None


def regular_files(paths: Iterable[Path], error: Type[UserError] = CheckpointError) -> None:
    """Each path is a regular file (not a link, device or folder)."""
    for p in paths:
        st = os.lstat(p) if os.path.lexists(p) else None
        if st is None:
            raise error(f"{p}: missing")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{p}: not a regular file (links, devices and folders are refused)")


def check_file(path: Path, limit: int, error: Type[UserError] = CheckpointError) -> None:
    """``path`` is a regular file (not a link, device or folder) of at most ``limit`` bytes."""
    regular_files([path], error)
    size = os.lstat(path).st_size
    if size > limit:
        raise error(f"{path}: {size} bytes, more than the {limit} a file of this kind may hold")


def owned_by_me(path: Path) -> bool:
    """``path`` is a regular file (not a link) owned by this user and not writable by group or
    others: a cache file nobody else could have planted or changed."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.getuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


# ----------------------------------------------------------------------------- paths code is run from

#: Environment switch naming the one lm-eval task folder a config *file* may point at.
TRUST_TASKS_ENV = "MEGAFORMER_TRUST_TASKS_DIR"


def refuse_code_folders(raw: dict, source: Path, error: Type[UserError] = UserError) -> None:
    """Refuse a config file (the parsed mapping ``raw`` read from ``source``) that names a folder
    Python is imported from.

    lm-eval's task loader executes the ``.py`` file beside a ``!function`` tag, so
    ``eval.tasks_include_path`` is a path to *code*. A downloaded config must not carry one: the key
    is accepted from the command line (``eval.tasks_include_path=DIR``, ``megaformer eval
    --include-path DIR``) or, in a file, only when ``$MEGAFORMER_TRUST_TASKS_DIR`` names the same
    folder."""
    section = raw.get("eval") if isinstance(raw, dict) else None
    value = section.get("tasks_include_path") if isinstance(section, dict) else None
    if value is None:
        return
    trusted = os.environ.get(TRUST_TASKS_ENV)
    if trusted and os.path.realpath(trusted) == os.path.realpath(str(value)):  # as lm-eval reads it
        return
    raise error(
        f"{source}: eval.tasks_include_path={value!r} names a folder of lm-eval tasks, "
        "whose Python files run when loaded; a config file may not carry it (give it on "
        f"the command line, eval.tasks_include_path=DIR, or set {TRUST_TASKS_ENV}=DIR to "
        "trust that folder)"
    )


# ----------------------------------------------------------------------------- parsing


def unreadable_reason(e: BaseException) -> str:
    """One line for why a JSON/YAML document could not be parsed: nesting deeper than Python
    recurses (RecursionError), an integer longer than Python converts (ValueError), or the
    parser's own first line."""
    if isinstance(e, RecursionError):
        return "nested too deeply to read"
    text = str(e)
    if "integer string conversion" in text:
        return "holds an integer too long to read"
    return (text.splitlines() or [type(e).__name__])[0][:200]


def json_or_none(line: str) -> Any:
    """``json.loads(line)``, or None when the line is not JSON, nests too deeply or holds an
    integer too long to convert (a metrics line that cannot be a record)."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # once, at import: os.umask is process-wide, not safe to toggle in threads


def current_umask() -> int:
    """The process umask (read once at import)."""
    return _UMASK
