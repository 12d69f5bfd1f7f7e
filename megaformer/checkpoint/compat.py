"""Which checkpoints a run may resume from, and how.

* The model a checkpoint holds must be the model the config describes, except for the keys in
  :data:`RESUME_MAY_CHANGE`, which do not change the weights.
* A full resume also needs the same sample stream (:data:`RESUME_DATA_KEYS`): the saved data
  position (consumed samples) indexes it. A weights-only checkpoint starts a fresh run: any data.
* A layout (TP, PP, ZeRO stage, precision, and DP under ZeRO) other than the saved one cannot load
  DeepSpeed's per-rank files: a sharded checkpoint resumes from its shards at any layout, one of
  the first release from its layout-free state (:mod:`megaformer.checkpoint.legacy.portable`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.config import Config, config_from_dict
from megaformer.errors import CheckpointError, ConfigError

# Model keys that do not change the weights, so a resumed run may set them differently.
RESUME_MAY_CHANGE = {
    "dropout",
    "attention_dropout",
    "attention_backend",
    "init_std",
    "kernels",
    "loss_chunk_tokens",
    "document_mask",
    "init_from",
    "mtp_loss_coef",
}
# Data keys that define the sample stream the saved position (consumed samples) indexes.
RESUME_DATA_KEYS = (
    "seq_len",
    "tokenizer",
    "source",
    "text_field",
    "max_bytes",
    "valid_fraction",
    "paths",
    "weights",
    "split",
)


def check_resume_compatible(cfg: Config, ckpt: Path) -> None:
    """The model a checkpoint holds must be the model the config describes (CheckpointError)."""
    try:
        saved = ckpt_layout.read_config_yaml(ckpt)  # bounded regular file, no YAML aliases
        saved_cfg = config_from_dict(saved)
    except (OSError, yaml.YAMLError, ConfigError) as e:
        raise CheckpointError(
            f"{ckpt}: its {ckpt_layout.CONFIG} is missing or invalid ({e})"
        ) from None
    for f in dataclasses.fields(saved_cfg.model):
        new, old = getattr(cfg.model, f.name), getattr(saved_cfg.model, f.name)
        if f.name in RESUME_MAY_CHANGE or (f.name == "vocab_size" and new is None):
            continue
        if new != old:
            raise CheckpointError(
                f"model.{f.name}={new!r} differs from the checkpoint {ckpt} "
                f"({old!r}); use another --run-dir or the checkpoint's model"
            )
    if ckpt_layout.is_weights_only(ckpt):  # a fresh run from these weights: any data, any layout
        return
    new, old = cfg.train.optimizer, saved_cfg.train.optimizer
    if new != old and not cfg.train.optimizer_reset:
        raise CheckpointError(optimizer_changed(ckpt, old, new))
    for key in RESUME_DATA_KEYS:
        new, old = getattr(cfg.data, key), getattr(saved_cfg.data, key)
        if new != old:
            raise CheckpointError(
                f"data.{key}={new!r} differs from the checkpoint {ckpt} ({old!r}): the saved data "
                "position would point into another sample stream; resume with the checkpoint's "
                "data settings, or start a new run from its weights"
            )


def optimizer_changed(ckpt: Path, saved: str, now: str) -> str:
    """The one-line error for resuming with another optimizer than the checkpoint's."""
    return (
        f"train.optimizer={now} differs from the checkpoint {ckpt} ({saved}), whose optimizer "
        f"state it cannot load; resume with train.optimizer={saved}, or set "
        "train.optimizer_reset=true to keep the weights and start the optimizer state from zero"
    )


def layout_changes(cfg: Config, ckpt: Path, world_size: int) -> list[str]:
    """What about the layout differs from the checkpoint's in a way DeepSpeed's per-rank files
    cannot load (empty: DeepSpeed's exact resume applies). A resharded checkpoint has no engine
    files at all."""
    meta = ckpt_layout.read_meta(ckpt)
    if not meta.get("engine_state", True):
        return ["resharded offline (no engine state)"]
    saved = dict(
        meta.get("parallel", {}), zero_stage=meta.get("zero_stage"), precision=meta.get("precision")
    )
    p = cfg.parallel
    dp = world_size // (p.tensor * p.pipeline * p.context)
    now = {
        "tensor": p.tensor,
        "pipeline": p.pipeline,
        "data": dp,
        "context": p.context,
        "expert": p.expert,
        "zero_stage": p.zero_stage,
        "precision": cfg.train.precision,
    }
    saved.setdefault("context", 1)  # checkpoints from before context and expert parallelism
    saved.setdefault("expert", 1)
    keys = ["tensor", "pipeline", "context", "expert", "zero_stage", "precision"]
    if cfg.parallel.zero_stage > 0 or saved.get("zero_stage", 0) > 0:  # ZeRO files are per DP rank
        keys.append("data")
    return [
        f"{k} {saved[k]} -> {now[k]}"
        for k in keys
        if saved.get(k) is not None and saved[k] != now[k]
    ]
