"""Where checkpoints live in a run directory, what they are called, and finding them again.

Layout::

    RUN_DIR/checkpoints/
      step_0000100/
        state/                     the training state, one file per rank (:mod:`.sharded`)
        moe_router/                MoE aux-loss-free biases (:mod:`.router_state`)
        model.safetensors          consolidated weights, only with checkpoint.export_weights
        config.yaml                the resolved config,
        tokenizer.json             the tokenizer,
        rng/rank_N.pt              every rank's RNG state (:mod:`.rng`),
        meta.json                  step, consumed samples/tokens, layout, version.
      latest                       the name of the newest complete checkpoint
      .tmp-step_0000200/           a save in progress, or one that was interrupted (never loaded)

Run directories are downloaded and shared, so what is read back is checked: ``latest`` may hold only
``step_<digits>`` (a name inside ``checkpoints/``), checkpoints are real folders named ``step_<digits>``
(never links), they are ordered by step number, and ``keep_last`` never deletes the checkpoint just
sealed or a link.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from megaformer.errors import CheckpointError
from megaformer.safe_files import (
    read_text_bounded,
    read_text_inside,
    refuse_links_below,
    refuse_read_link,
)

log = logging.getLogger("megaformer")

CHECKPOINTS = "checkpoints"
LATEST = "latest"
META = "meta.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.yaml"
TMP_PREFIX = ".tmp-"
STEP_NAME = re.compile(r"step_(\d+)")
README = "README.md"
README_TEXT = """\
This folder is a megaformer checkpoint. Read its weights with `megaformer generate`, or turn it
into a Hugging Face model folder with `megaformer convert CHECKPOINT --to hf OUT`; resume training
with `megaformer train CONFIG --run-dir RUN_DIR`. Its `.pt` files are loaded by megaformer with
weights-only unpickling; do not load them with scripts that unpickle arbitrary objects.
"""
# DeepSpeed's recovery scripts: they unpickle the checkpoint's files with weights_only=False.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def step_of(ckpt: Path) -> Optional[int]:
    """The step of a folder named ``step_<digits>``, else None."""
    m = STEP_NAME.fullmatch(ckpt.name)
    return int(m.group(1)) if m else None


def is_complete(ckpt: Path) -> bool:
    return (
        not ckpt.is_symlink()
        and ckpt.is_dir()
        and not ckpt.name.startswith(TMP_PREFIX)
        and (ckpt / META).is_file()
    )


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root`` (real folders named ``step_<digits>``), oldest first by
    step number."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and is_complete(p)]
    return sorted(found, key=lambda p: (step_of(p), p.name))


def half_written(root: Path) -> list[Path]:
    """``.tmp-`` folders under ``root``: saves that were interrupted (never loaded)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(TMP_PREFIX + "step_"))


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The checkpoint ``latest`` names; the newest complete one (with a warning) if that is broken."""
    pointer = root / LATEST
    found = complete_checkpoints(root)
    if pointer.is_symlink():
        raise CheckpointError(f"{pointer}: is a symbolic link; expected a file naming a checkpoint")
    if pointer.is_file():
        name = read_text_bounded(pointer, 4096).strip()
        if STEP_NAME.fullmatch(name) is None:
            raise CheckpointError(
                f"{pointer}: names {name[:80]!r}; expected step_<digits>, a "
                f"checkpoint inside {root}"
            )
        named = root / name
        if is_complete(named):
            return named
        if found:
            log.warning(
                "%s names %s, which is missing or incomplete; using %s instead",
                pointer,
                named.name,
                found[-1].name,
            )
    return found[-1] if found else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A run directory, its checkpoints/ folder, or one checkpoint -> the checkpoint to load."""
    p = Path(path).expanduser()
    if p.is_symlink():  # the path the user named may be a link; links inside it are not followed
        p = p.resolve()
    if not p.exists():
        raise CheckpointError(f"{p}: no such run directory or checkpoint")
    if is_complete(p):
        if not (p / WEIGHTS).is_file() and not (p / "state" / "index.json").is_file():
            raise CheckpointError(
                f"{p}: checkpoint has neither {WEIGHTS} nor a sharded state (state/index.json)"
            )
        refuse_links_below(p)
        return p
    refuse_read_link(p / CHECKPOINTS)
    for root in (p / CHECKPOINTS, p):
        if root.is_dir():
            found = latest_checkpoint(root)
            if found is not None:
                refuse_links_below(found)
                return found
    raise CheckpointError(
        f"{p}: not a megaformer run directory or checkpoint (no {CHECKPOINTS}/ "
        f"with a complete checkpoint, no {META})"
    )


def read_config_yaml(ckpt: Path) -> Any:
    """The raw mapping of a checkpoint's config.yaml: a regular file of bounded size, YAML without
    anchors/aliases (CheckpointError otherwise)."""
    from megaformer.config import MAX_CONFIG_BYTES, safe_yaml_load
    from megaformer.errors import ConfigError

    try:
        return safe_yaml_load(read_text_inside(ckpt, CONFIG, MAX_CONFIG_BYTES), str(ckpt / CONFIG))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None


def read_config(ckpt: Path) -> Any:
    """The resolved :class:`~megaformer.config.Config` a checkpoint was saved with."""
    from megaformer.config import config_from_dict
    from megaformer.errors import ConfigError

    raw = read_config_yaml(ckpt)
    try:
        return config_from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{ckpt}: invalid {CONFIG}: {e}") from None


def read_meta(ckpt: Path) -> dict:
    try:
        meta = json.loads(read_text_inside(ckpt, META, 1 << 20))
    except (CheckpointError, OSError, ValueError, RecursionError):  # a link, not JSON, too deep
        raise CheckpointError(f"{ckpt}: {META} is missing or corrupt") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{ckpt}: {META} is not a JSON object")
    return meta


def is_weights_only(ckpt: Path) -> bool:
    """True for a checkpoint with weights but no engine state (from ``megaformer convert``)."""
    return bool(read_meta(ckpt).get("weights_only", False))


def prune(root: Path, keep_last: int, sealed: Path) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints by step number, never ``sealed`` (the
    one just written: a planted later-named folder cannot push it out) and never a link."""
    sealed_step = step_of(sealed)
    older = [
        p
        for p in complete_checkpoints(root)
        if p.name != sealed.name and (sealed_step is None or step_of(p) < sealed_step)
    ]
    newer = [p for p in complete_checkpoints(root) if p.name != sealed.name and p not in older]
    if newer:
        log.warning(
            "%s holds checkpoints with steps after %s (%s); keep_last leaves them alone",
            root,
            sealed.name,
            ", ".join(p.name for p in newer[:3]),
        )
    doomed = older[: max(0, len(older) - (keep_last - 1))]
    for old in doomed:
        if not old.is_symlink():
            shutil.rmtree(old)
    return doomed
