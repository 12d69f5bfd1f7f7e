"""Atomic checkpoints in the run directory, and finding them again.

Layout::

    RUN_DIR/checkpoints/
      step_0000100/                DeepSpeed engine state (model, optimizer, scheduler) ...
        model.safetensors          ... plus consolidated weights (what ``generate`` reads),
        config.yaml                the resolved config,
        tokenizer.json             the tokenizer,
        rng/rank_N.pt              every rank's RNG state,
        meta.json                  step, consumed samples/tokens, layout, version.
      latest                       the name of the newest complete checkpoint

A checkpoint is written into ``.tmp-step_...``, flushed to disk, then renamed; ``latest`` is replaced
(write + rename) only after that. An interrupted save leaves a ``.tmp-`` folder that is never
mistaken for a checkpoint, and an existing checkpoint is never overwritten.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from megaformer import __version__
from megaformer.checkpoint.safe_load import safe_torch_load
from megaformer.errors import CheckpointError

log = logging.getLogger("megaformer")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"
TMP_PREFIX = ".tmp-"


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
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
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def is_complete(ckpt: Path) -> bool:
    return ckpt.is_dir() and not ckpt.name.startswith(TMP_PREFIX) and (ckpt / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.name.startswith("step_") and is_complete(p)),
                  key=lambda p: p.name)


def half_written(root: Path) -> list[Path]:
    """``.tmp-`` folders under ``root``: saves that were interrupted (never loaded)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX + "step_"))


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names; the newest complete one (with a warning) if that is broken."""
    pointer = root / LATEST
    found = complete_checkpoints(root)
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
        if found:
            log.warning("%s names %s, which is missing or incomplete; using %s instead",
                        pointer, named.name, found[-1].name)
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run directory, its checkpoints/ folder, or one checkpoint -> the checkpoint to load."""
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"{p}: no such run directory or checkpoint")
    if is_complete(p):
        if not (p / WEIGHTS).is_file():
            raise CheckpointError(f"{p}: checkpoint has no {WEIGHTS}")
        return p
    for root in (p / CHECKPOINTS, p):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise CheckpointError(f"{p}: not a megaformer run directory or checkpoint (no {CHECKPOINTS}/ "
                          f"with a complete checkpoint, no {META})")


def read_meta(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / META).read_text())
    except (OSError, json.JSONDecodeError):
        raise CheckpointError(f"{ckpt}: {META} is missing or corrupt") from None


# ----------------------------------------------------------------------------- RNG state

def rng_state() -> dict:
    import random

    import numpy as np

    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype("int64")), *np_state[2:]],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype("uint32"), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- save

def save_checkpoint(engine: Any, run_dir: Path, step: int, *, rank: int, world_size: int,
                    client_state: dict, weights: Optional[dict[str, torch.Tensor]],
                    config_yaml: str, tokenizer: Any, meta: dict, keep_last: Optional[int],
                    barrier: Any, extra_rng: Optional[dict] = None,
                    before_commit: Optional[Callable[[], None]] = None) -> Optional[Path]:
    """Collective: every rank calls it. Returns the checkpoint path (None if it already existed).

    ``before_commit`` runs on every rank once the files are written, before the rename that makes
    the checkpoint visible (the fault-injection tests kill a rank there)."""
    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    final = root / tag
    tmp = root / f"{TMP_PREFIX}{tag}"
    exists = torch.tensor([1 if final.exists() else 0])
    if torch.distributed.is_initialized():
        torch.distributed.broadcast(exists, src=0)
    if exists.item():
        if rank == 0:
            log.warning("checkpoint %s already exists; not overwriting it", final)
        return None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by an interrupted save of ours: never a complete checkpoint
            shutil.rmtree(tmp)
    barrier()
    engine.save_checkpoint(str(root), tag=tmp.name, client_state=client_state, save_latest=False)
    (tmp / "rng").mkdir(parents=True, exist_ok=True)
    torch.save({**rng_state(), **(extra_rng or {})}, tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0:
        from safetensors.torch import save_file

        assert weights is not None
        save_file({k: v.detach().cpu().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS),
                  metadata={"format": "pt", "megaformer_version": __version__})
        (tmp / CONFIG).write_text(config_yaml)
        tokenizer.save(tmp / "tokenizer.json")
        full_meta = {"megaformer_version": __version__, "step": step, "world_size": world_size,
                     "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **meta}
        (tmp / META).write_text(json.dumps(full_meta, indent=2))
    barrier()
    if before_commit is not None:
        before_commit()
    if rank == 0:
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_dir(root)
        write_text_atomic(root / LATEST, tag + "\n")
        if keep_last is not None:
            for old in complete_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old)
    barrier()
    return final


# ----------------------------------------------------------------------------- load

def load_engine_state(engine: Any, ckpt: Path, rank: int) -> tuple[dict, dict]:
    """Restore model, optimizer and scheduler into ``engine`` and this rank's RNG streams.

    Returns (client state, this rank's saved RNG dict — empty when the checkpoint has none)."""
    try:
        path, client = engine.load_checkpoint(str(ckpt.parent), tag=ckpt.name,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError, AssertionError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{ckpt}: cannot restore the training state ({first[:300]})") from None
    if path is None or client is None:
        raise CheckpointError(f"{ckpt}: DeepSpeed found no engine state for this layout")
    rng_file = ckpt / "rng" / f"rank_{rank}.pt"
    rng: dict = {}
    if rng_file.is_file():
        rng = safe_torch_load(str(rng_file))
        set_rng_state(rng)
    else:
        log.warning("%s has no RNG state for rank %d; dropout will not replay exactly", ckpt, rank)
    return client, rng


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = ckpt / WEIGHTS
    if not f.is_file():
        raise CheckpointError(f"{ckpt}: no {WEIGHTS}")
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{f}: corrupt weights file ({str(e)[:200]})") from None
