"""Every rank's random-number streams in a checkpoint: ``rng/rank_N.pt``.

torch's CPU (and CUDA) generators, Python's ``random`` and NumPy's global state, plus streams the
caller adds (the tensor-parallel dropout generator). Restored only when a run resumes at the saved
layout: the streams are per rank. Read back with weights-only unpickling.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Optional

import torch

from megaformer.checkpoint.safe_load import safe_torch_load
from megaformer.errors import CheckpointError

log = logging.getLogger("megaformer")
RNG_DIR = "rng"


def rng_file(ckpt: Path, rank: int) -> Path:
    return ckpt / RNG_DIR / f"rank_{rank}.pt"


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


def save_rng_state(folder: Path, rank: int, extra: Optional[dict] = None) -> None:
    """Write this rank's streams (and ``extra``: name -> a generator's state dict) into ``folder``."""
    path = rng_file(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**rng_state(), **(extra or {})}, path)


def load_rng_state(ckpt: Path, rank: int) -> dict:
    """Restore this rank's saved RNG streams (weights-only unpickling); returns the saved dict
    (empty, with a warning, when the checkpoint has none for this rank)."""
    path = rng_file(ckpt, rank)
    if path.is_symlink() or not path.is_file():
        log.warning("%s has no RNG state for rank %d; dropout will not replay exactly", ckpt, rank)
        return {}
    try:
        rng = safe_torch_load(str(path))
        set_rng_state(rng)
    except (
        RuntimeError,
        KeyError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        pickle.UnpicklingError,
    ) as e:
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: corrupt RNG state ({why})") from None
    return rng
