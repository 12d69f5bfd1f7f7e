"""Offline reshard: a megaformer checkpoint -> a new run directory set up for another TP x PP layout.

Every checkpoint already holds its state in a layout-free form: the sharded state (``state/``,
see :mod:`megaformer.checkpoint.sharded`: boxes placed in whole-tensor coordinates, which any
layout reads directly), or, in checkpoints of the first release, ``model.safetensors`` and
``optimizer/`` (:mod:`megaformer.checkpoint.legacy.portable`). Resharding therefore moves no bytes
between shards; it

1. checks that the new layout fits the model (heads and KV heads divisible by TP, at least one
   block per stage, ...) by validating the checkpoint's config with the new ``parallel`` keys;
2. checks every safetensors file (header against size, each tensor's byte range, the optimizer
   state naming exactly the parameters of ``model.safetensors`` with their shapes);
3. streams the files into ``DST/checkpoints/step_N`` (chunked copies: memory stays bounded by the
   copy buffer, whatever the model size), writes ``config.yaml`` with the new layout and
   ``meta.json`` with ``"engine_state": false``, seals it (fsync, rename, ``latest`` last).

``megaformer train --run-dir DST`` then sees no DeepSpeed engine files and resumes through the
layout-free path at whatever layout its config and world size give (the one written here by
default), with the optimizer state, LR schedule and data position of step N.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import yaml

from megaformer import __version__
from megaformer.checkpoint import files as ckpt_files
from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import sharded
from megaformer.checkpoint.legacy import portable
from megaformer.checkpoint.safetensors_check import read_header
from megaformer.config import config_from_dict
from megaformer.errors import CheckpointError, ConfigError
from megaformer.safe_files import copy_inside


def _new_config(ckpt: Path, tensor: int, pipeline: int) -> str:
    try:
        raw = ckpt_layout.read_config_yaml(ckpt)  # bounded regular file, no YAML aliases
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"{ckpt / ckpt_layout.CONFIG}: missing or invalid ({e})") from None
    raw.setdefault("parallel", {})
    raw["parallel"]["tensor"], raw["parallel"]["pipeline"] = tensor, pipeline
    if "," in str(raw["parallel"].get("pipeline_partition", "")):
        raw["parallel"]["pipeline_partition"] = "layers"  # an explicit split was for the old PP
    if tensor == 1:
        raw["parallel"]["sequence_parallel"] = False
    if pipeline == 1:
        raw["parallel"]["pipeline_schedule"] = "1f1b"  # a schedule needs a pipeline
    try:
        return config_from_dict(raw).to_yaml()
    except ConfigError as e:
        raise ConfigError(f"--tp {tensor} --pp {pipeline} does not fit {ckpt}: {e}") from None


def _shapes(header: dict) -> dict[str, tuple]:
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


def _check_sharded(ckpt: Path) -> list[Path]:
    """A sharded checkpoint's state files: the index, and every shard checked against it (size,
    header, each tensor's byte range)."""
    state = sharded.ShardedState(ckpt)
    state.listed()  # every box (an index that describes them by rule: expanded and checked)
    files = [state.folder / sharded.INDEX]
    for name in state.files:
        state.open_file(name)  # size against the index, header against the file
        files.append(state.folder / name)
    return files


def _check_state(ckpt: Path) -> list[Path]:
    """The checkpoint's safetensors files, each checked; the optimizer state must cover exactly
    the weights (three fp32 tensors of the weight's shape per parameter)."""
    if sharded.has_sharded_state(ckpt):
        return _check_sharded(ckpt)
    weights = _shapes(read_header(ckpt / ckpt_layout.WEIGHTS))
    files = [ckpt / ckpt_layout.WEIGHTS]
    if not portable.has_portable_state(ckpt):
        return files
    state: dict[str, tuple] = {}
    for f in sorted((ckpt / portable.STATE_DIR).glob("stage_*.safetensors")):
        state.update(_shapes(read_header(f)))
        files.append(f)
    want = {f"{n}/{k}": s for n, s in weights.items() for k in portable.KEYS}
    if state != want:
        odd = sorted(set(state.items()) ^ set(want.items()))[:3]
        raise CheckpointError(
            f"{ckpt / portable.STATE_DIR}: optimizer state does not match "
            f"{ckpt_layout.WEIGHTS} (e.g. {odd})"
        )
    return files


def reshard_checkpoint(src: Path, dst: Path, tensor: int, pipeline: int) -> Path:
    """Write SRC's latest checkpoint (or SRC itself, if it is one) into the new run directory DST,
    set up for ``tensor`` x ``pipeline``. Single process; returns the new checkpoint's path.

    Refuses (CheckpointError/ConfigError, nothing written) when DST exists, when the layout does
    not fit the model, or when a file is missing, truncated or tampered."""
    ckpt = ckpt_layout.resolve_checkpoint(src)
    dst = Path(dst)
    if dst.exists():
        raise CheckpointError(f"{dst}: already exists; reshard writes a new run directory")
    for name, value in (("--tp", tensor), ("--pp", pipeline)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} {value}: must be a positive integer")
    meta = ckpt_layout.read_meta(ckpt)
    weights_only = bool(meta.get("weights_only", False))
    if (
        not weights_only
        and not portable.has_portable_state(ckpt)
        and not sharded.has_sharded_state(ckpt)
    ):
        raise CheckpointError(
            f"{ckpt}: has no layout-free optimizer state "
            f"({portable.STATE_DIR}/); it predates resharding"
        )
    config_yaml = _new_config(ckpt, tensor, pipeline)
    files = _check_state(ckpt)
    root = dst / ckpt_layout.CHECKPOINTS
    final = root / ckpt.name
    tmp = root / f"{ckpt_layout.TMP_PREFIX}{ckpt.name}"
    tmp.mkdir(parents=True)
    try:
        for f in files:
            target = tmp / f.relative_to(ckpt)
            target.parent.mkdir(parents=True, exist_ok=True)
            copy_inside(ckpt, f.relative_to(ckpt), target)
        if not weights_only and portable.has_portable_state(ckpt):
            copy_inside(
                ckpt,
                Path(portable.STATE_DIR, portable.STATE_JSON),
                tmp / portable.STATE_DIR / portable.STATE_JSON,
            )
        copy_inside(ckpt, "tokenizer.json", tmp / "tokenizer.json")
        (tmp / ckpt_layout.CONFIG).write_text(config_yaml)
        new_meta = {
            **meta,
            "engine_state": False,
            "resharded_from": str(ckpt.resolve()),
            "resharded_by": __version__,
            "resharded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "saved_parallel": meta.get("parallel"),
            "parallel": {"tensor": tensor, "pipeline": pipeline},
        }
        new_meta.pop("world_size", None)
        (tmp / ckpt_layout.META).write_text(json.dumps(new_meta, indent=2))
    except OSError as e:
        shutil.rmtree(dst, ignore_errors=True)
        raise CheckpointError(f"{dst}: cannot write the resharded checkpoint ({e})") from None
    ckpt_files.fsync_tree(tmp)
    os.rename(tmp, final)
    ckpt_files.fsync_dir(root)
    ckpt_files.write_text_atomic(root / ckpt_layout.LATEST, final.name + "\n")
    return final
