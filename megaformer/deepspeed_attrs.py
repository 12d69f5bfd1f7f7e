"""The attributes DeepSpeed attaches to the parameters and engines it manages, read in one place.

They are DeepSpeed internals (no public API answers these questions), so a DeepSpeed upgrade is
checked here and in :mod:`megaformer.training.deepspeed_adapter`, which re-exports these and holds
the engine-level calls. This module imports nothing from megaformer and nothing from DeepSpeed,
so the model, the parallel layers and the checkpoint code can ask without importing upwards.
"""

from __future__ import annotations

from typing import Any


def zero3_partitioned(param: Any) -> bool:
    """A parameter ZeRO-3 has partitioned (its data is a placeholder until gathered)."""
    return hasattr(param, "ds_id")


def pipe_replicated(param: Any) -> bool:
    """The copy of a tied weight that DeepSpeed's pipeline engine keeps on a second stage."""
    return bool(getattr(param, "ds_pipe_replicated", False))


def has_hp_mapping(param: Any) -> bool:
    """A parameter a bf16/ZeRO optimizer maps to an fp32 master (``safe_get_full_fp32_param``)."""
    return hasattr(param, "_hp_mapping")


def checkpoint_engine(engine: Any) -> Any:
    """The engine's checkpoint engine (what writes and reads DeepSpeed's files), or None."""
    return getattr(engine, "checkpoint_engine", None)


def set_checkpoint_engine(engine: Any, checkpoint_engine: Any) -> None:
    engine.checkpoint_engine = checkpoint_engine


def engine_config(engine: Any) -> Any:
    """The engine's parsed DeepSpeed config (what a checkpoint engine is constructed with)."""
    return getattr(engine, "_config", None)


def skip_recovery_scripts(engine: Any) -> None:
    """DeepSpeed copies zero_to_fp32.py / zero_to_torch.py (scripts that unpickle the checkpoint's
    files) into every ZeRO checkpoint; an engine told this writes none."""
    engine._copy_recovery_script = lambda save_path: None
