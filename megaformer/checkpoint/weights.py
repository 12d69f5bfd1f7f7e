"""A checkpoint's model weights: checked before they are read, loaded whole, written alone.

* :func:`check_weights` / :func:`check_shapes`: every tensor has the shape the config gives it,
  checked on headers alone before anything is allocated (a config describing a huge model beside
  small tensors is refused instead of built);
* :func:`load_weights`: whole, unpadded weights on one process (generation, tools), from
  ``model.safetensors`` or assembled from the sharded state;
* :func:`save_weights_checkpoint`: a weights-only checkpoint (``megaformer convert``), which
  ``megaformer train`` starts from with a fresh optimizer at any layout.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from megaformer import __version__
from megaformer.checkpoint.files import seal
from megaformer.checkpoint.layout import CHECKPOINTS, CONFIG, META, TMP_PREFIX, WEIGHTS, tag_for
from megaformer.checkpoint.safetensors_check import read_header
from megaformer.checkpoint.sharded import ShardedState, has_sharded_state
from megaformer.errors import CheckpointError
from megaformer.safe_files import make_dir, refuse_link, regular_files


def expected_shapes(model_cfg: Any) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of the (unpadded) model ``model_cfg`` describes, computed on
    the ``meta`` device: no memory is allocated whatever sizes the config names."""
    from megaformer.model.transformer import Transformer

    with torch.device("meta"):
        model = Transformer(model_cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_shapes(
    specs: Any, expected: dict[str, tuple[int, ...]], where: str, error: type = CheckpointError
) -> None:
    """Every (name, shape) in ``specs`` named in ``expected`` has exactly that shape, checked on
    shapes alone, before any tensor is read or allocated: a config describing a huge model beside
    small tensors (a "shape bomb") is refused instead of building what the config says."""
    for name, shape in specs:
        want = expected.get(name)
        if want is not None and tuple(shape) != tuple(want):
            raise error(
                f"{where}: tensor {name} has shape {list(shape)}, the config describes {list(want)}"
            )


def check_weights(ckpt: Path, model_cfg: Any) -> None:
    """The checkpoint's weight file is a regular, well-formed safetensors file whose tensors have
    the shapes ``model_cfg`` gives them (headers only: nothing is loaded or allocated); for a
    sharded checkpoint, its index names exactly the model's parameters with their shapes."""
    f = ckpt / WEIGHTS
    if not f.exists():
        ShardedState(ckpt).check_model(expected_shapes(model_cfg))
        return
    regular_files([f])
    header = read_header(f)
    header.pop("__metadata__", None)
    if len(header) < model_cfg.n_layers:  # every block has tensors: bounds the meta model too
        raise CheckpointError(
            f"{f}: {len(header)} tensors cannot hold the {model_cfg.n_layers} "
            f"blocks {ckpt / CONFIG} describes"
        )
    check_shapes(((n, e["shape"]) for n, e in header.items()), expected_shapes(model_cfg), str(f))


def load_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Whole, unpadded weights (one process: generation, tools): ``model.safetensors``, or the
    master weights assembled from a sharded checkpoint's shards."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = ckpt / WEIGHTS
    if not f.exists():
        if has_sharded_state(ckpt):
            state = ShardedState(ckpt)
            return {name: state.whole(name) for name in state.names()}
        raise CheckpointError(f"{ckpt}: no {WEIGHTS} and no sharded state")
    regular_files([f])
    read_header(f)
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{f}: corrupt weights file ({str(e)[:200]})") from None


def save_weights_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor] | Callable[[Path], None],
    config_yaml: str,
    tokenizer: Any,
    meta: dict,
) -> Path:
    """A weights-only checkpoint (one process): what ``megaformer convert`` writes.

    Same layout as a training checkpoint minus the engine state and RNG: ``model.safetensors``
    (unsharded, unpadded), ``config.yaml``, ``tokenizer.json`` and ``meta.json`` with
    ``"weights_only": true``. ``megaformer train`` on such a run directory starts from these
    weights with a fresh optimizer, at any parallel layout. Refuses to replace a checkpoint.
    ``weights`` may also be a function that writes the weights file at the path it is given
    (a converter streaming tensor by tensor)."""
    from safetensors.torch import save_file

    root = run_dir / CHECKPOINTS
    tag = tag_for(step)
    final, tmp = root / tag, root / f"{TMP_PREFIX}{tag}"
    if final.exists() or final.is_symlink():
        raise CheckpointError(f"{final}: already exists; not overwriting it")
    make_dir(root)
    refuse_link(tmp)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    if callable(weights):
        weights(tmp / WEIGHTS)
    else:
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in weights.items()},
            str(tmp / WEIGHTS),
            metadata={"format": "pt", "megaformer_version": __version__},
        )
    (tmp / CONFIG).write_text(config_yaml)
    tokenizer.save(tmp / "tokenizer.json")
    full_meta = {
        "megaformer_version": __version__,
        "step": step,
        "weights_only": True,
        "consumed_samples": 0,
        "consumed_tokens": 0,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **meta,
    }
    (tmp / META).write_text(json.dumps(full_meta, indent=2))
    seal(tmp, final, keep_last=None)
    return final
