"""Files of a checkpoint that are whole or absent, and the thread that writes them.

Every file is written under a temporary name, flushed to disk (fsync) and renamed, so a file that
exists is a whole file; a checkpoint folder is written as ``.tmp-step_...``, flushed, renamed into
place, and only then does ``latest`` (write + rename) name it (:func:`seal`). An interrupted save
leaves a ``.tmp-`` folder that is never mistaken for a checkpoint, and an existing checkpoint is never
overwritten. :class:`BackgroundWriter` runs one checkpoint write at a time off the training thread.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megaformer.checkpoint.layout import LATEST, prune
from megaformer.errors import CheckpointError
from megaformer.safe_files import current_umask, write_atomic


def fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(path)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dirs(path: Path) -> None:
    """Flush the entries of ``path`` and of every folder below it (not the files' data)."""
    for folder, _, _ in os.walk(path):
        fsync_dir(Path(folder))


def flush_own_files(
    tmp: Path, rank: int, world_size: int, own: list[Path], shared_tree: bool
) -> None:
    """Every rank flushes what it wrote, so that the seal flushes folders only and rank 0's work
    does not grow with the world: ``own`` (its files not written by :func:`write_payload`, which
    flushes), on rank 0 also the checkpoint's top-level files (rank 0 writes them all), and with
    ``shared_tree`` (files a library wrote, owner unknown: DeepSpeed's) every ``world_size``-th
    file of the folder, from the ``rank``-th."""
    paths = [p for p in own if p.is_file()]
    if rank == 0:
        paths += [p for p in tmp.iterdir() if p.is_file() and not p.name.startswith(".")]
    if shared_tree:
        paths += [p for p in sorted(tmp.rglob("*")) if p.is_file()][rank::world_size]
    for p in dict.fromkeys(paths):
        fsync_file(p)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by ``text``: a random exclusive temporary, flushed, renamed (a link at
    ``path`` is refused, never written through)."""
    write_atomic(path, text)
    fsync_dir(path.parent)


def write_payload(path: Path, payload: Any, metadata: Optional[dict[str, str]] = None) -> None:
    """One file of a checkpoint: tensors as safetensors, or text; written under a ``.partial``
    name, flushed to disk, then renamed, so a file that exists is a whole file."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if isinstance(payload, dict):  # sorted metadata keys: the bytes do not depend on hash order
        save_file(payload, str(partial), metadata={"format": "pt", **(metadata or {})})
        # safetensors creates it 0600: give it an ordinary file's mode, as the run's other files
        os.chmod(partial, 0o666 & ~current_umask())
    else:
        partial.write_text(payload)
    with open(partial, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(partial, path)


def wait_for(folder: Path, names: list[str], timeout_s: float) -> None:
    """Until every file in ``names`` (written by other ranks' writer threads) exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [n for n in names if not (folder / n).is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"{folder}: other ranks did not write {missing[:3]} within {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def seal(tmp: Path, final: Path, keep_last: Optional[int]) -> None:
    """Flush the folders (each rank flushed its own files: :func:`flush_own_files`), rename the
    folder into place, then point ``latest`` at it: a number of fsyncs independent of the world."""
    root = final.parent
    fsync_dirs(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    write_text_atomic(root / LATEST, final.name + "\n")
    if keep_last is not None:
        prune(root, keep_last, final)


class BackgroundWriter:
    """One checkpoint write at a time on a background thread.

    ``submit`` first waits for the previous write; ``check`` (at every step boundary) re-raises a
    failed write as CheckpointError; ``wait`` blocks until the current write is done."""

    def __init__(self) -> None:
        self._thread: Optional[Any] = None
        self._error: Optional[BaseException] = None
        self._what = ""

    def submit(self, job: Callable[[], None], what: str) -> None:
        import threading

        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # reported on the training thread by check()/wait()
                self._error = e

        self._what = what
        self._thread = threading.Thread(target=run, name="megaformer-checkpoint", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            if isinstance(e, CheckpointError):
                raise e
            raise CheckpointError(
                f"writing {self._what} failed: {type(e).__name__}: {' '.join(str(e).split())[:300]}"
            ) from None

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
