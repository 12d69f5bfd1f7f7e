"""DeepSpeed's own per-rank engine files: read back only at the layout that wrote them.

Checkpoints of the first release hold the training state in these files (beside the layout-free
``optimizer/``, :mod:`.portable`); fp16 runs still write them (DeepSpeed's loss scaler lives
there). Every ``torch.load`` inside DeepSpeed's loader runs with weights-only unpickling
(:mod:`megaformer.checkpoint.safe_load`).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from megaformer.checkpoint.layout import STEP_NAME
from megaformer.checkpoint.rng import load_rng_state
from megaformer.checkpoint.safe_load import weights_only_forced
from megaformer.errors import CheckpointError


def load_engine_state(engine: Any, ckpt: Path, rank: int) -> tuple[dict, dict]:
    """Restore model, optimizer and scheduler into ``engine`` and this rank's RNG streams.

    Returns (client state, this rank's saved RNG dict — empty when the checkpoint has none)."""
    if ckpt.is_symlink() or STEP_NAME.fullmatch(ckpt.name) is None:
        raise CheckpointError(f"{ckpt}: not a checkpoint folder named step_<digits>")
    try:
        with weights_only_forced():  # every torch.load inside DeepSpeed is weights-only
            path, client = engine.load_checkpoint(
                str(ckpt.parent),
                tag=ckpt.name,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
    except CheckpointError:
        raise
    except (RuntimeError, KeyError, ValueError, AssertionError, pickle.UnpicklingError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"{ckpt}: cannot restore the training state ({first[:300]})"
        ) from None
    if path is None or client is None:
        raise CheckpointError(f"{ckpt}: DeepSpeed found no engine state for this layout")
    return client, load_rng_state(ckpt, rank)
