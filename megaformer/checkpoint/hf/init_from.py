"""``model.init_from``: train from a Hugging Face folder directly, with no converted copy on disk.

The folder is read as ``megaformer convert --to megaformer`` reads it (``config.json`` through
transformers' own config class with no remote code, safetensors only, every header checked against
its file and every tensor's shape against the model before anything is allocated), but instead of
writing a converted checkpoint, the architecture's import plan renames each tensor on the fly while
each rank reads only its shards (:class:`~megaformer.checkpoint.sliced.SlicedWeights`). The first
loss equals the one after converting first.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from megaformer.checkpoint.compat import RESUME_MAY_CHANGE
from megaformer.checkpoint.hf.convert import _read_hf_config, import_plan
from megaformer.checkpoint.sliced import SlicedWeights
from megaformer.config import Config, validate
from megaformer.errors import ConfigError, ConversionError

log = logging.getLogger("megaformer")

# MoE keys that steer training, not the function of the weights: the run's config keeps them
TRAINING_ONLY = ("aux_loss_coef", "z_loss_coef", "bias_update_rate")


def _folder(m: Any) -> Path:
    path = Path(m.init_from)
    if not path.is_dir():
        raise ConfigError(f"model.init_from={m.init_from}: no such Hugging Face model folder")
    return path


def with_hf_model(cfg: Config) -> Config:
    """``cfg`` with the model the folder ``model.init_from`` holds (its ``config.json``): every
    key that shapes the weights is the folder's; a configured value that differs is replaced, with
    a warning. Unchanged without ``model.init_from``."""
    if cfg.model.init_from is None:
        return cfg
    src = _folder(cfg.model)
    hf, adapter = _read_hf_config(src, None)
    try:
        fields = {**adapter.model_fields(hf), "vocab_size": hf["vocab_size"]}
    except (KeyError, TypeError) as e:
        raise ConversionError(f"{src / 'config.json'}: missing or invalid key {e}") from None
    fields = {k: v for k, v in fields.items() if k not in RESUME_MAY_CHANGE}  # the run's own
    for key, value in fields.items():  # a nested section (model.moe, model.mla): its keys set
        section = getattr(cfg.model, key, None)
        if isinstance(value, dict) and dataclasses.is_dataclass(section):
            value = {k: v for k, v in value.items() if k not in TRAINING_ONLY}  # the run's own
            fields[key] = dataclasses.replace(section, **value)
    configured = {**cfg.model.__dict__, "head_dim": cfg.model.configured_head_dim}
    changed = [k for k, v in fields.items() if configured.get(k) != v]
    if changed:
        log.warning(
            "model.init_from=%s: the model's %s come from its config.json",
            src,
            ", ".join(f"{k}={fields[k]!r}" for k in changed),
        )
    out = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))
    try:
        validate(out)
    except ConfigError as e:
        raise ConfigError(f"model.init_from={src}: {e}") from None
    return out


def hf_router_state(m: Any) -> dict:
    """The MoE blocks' aux-loss-free biases the folder ``m.init_from`` stores with its weights
    (DeepSeek-V3's ``e_score_correction_bias``), by megaformer's router-state name; small tensors
    ([E] per block), read whole."""
    from megaformer.checkpoint.hf.stream import TensorSource

    src = _folder(m)
    _, adapter = _read_hf_config(src, None)
    names = adapter.router_bias_names(m)
    if not names:
        return {}
    source = TensorSource(src)
    return {ours: source.get(theirs) for ours, theirs in names.items() if theirs in source}


def hf_weights(m: Any) -> tuple[SlicedWeights, Path]:
    """(reader of this rank's shards, the folder) of the Hugging Face folder ``m.init_from`` for
    the model config ``m`` (as :func:`with_hf_model` resolved it)."""
    src = _folder(m)
    _, adapter = _read_hf_config(src, None)
    source, plan, _ = import_plan(src, m, adapter)
    return SlicedWeights(source, plan, src), src
