"""The ``checkpoint`` section: saving and resuming."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaformer.config.fields import option


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval: int = option(0, "Save every N steps (0 = only at the end).")
    save_at_end: bool = option(True, "Save after the last step.")
    keep_last: Optional[int] = option(None, "Keep only the newest N checkpoints (null = keep all).")
    resume: bool = option(
        True,
        "Resume from the latest complete checkpoint in the run directory if there is one "
        "(half-written ones are ignored with a warning); false refuses a run directory that "
        "already holds checkpoints rather than overwrite or silently ignore them.",
    )
    async_save: bool = option(
        False,
        "Write checkpoint files on a background thread: each rank copies its own shard of "
        "the state to host memory (the only stall), then training goes on while the shards "
        "are written, flushed and sealed (the next save and the end of training wait for "
        "it).",
    )
    export_weights: bool = option(
        False,
        "Also write consolidated release weights (model.safetensors) into every checkpoint. "
        "This gathers the whole model onto rank 0 at each save; leave it off at scale and "
        "build them when needed with megaformer convert CKPT --to hf.",
    )
