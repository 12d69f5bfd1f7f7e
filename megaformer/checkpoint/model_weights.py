"""A model with its weights from a megaformer run directory or checkpoint, on one process (no
DeepSpeed, no process group): what generation and ``megaformer convert --verify`` run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.config import Config
from megaformer.errors import CheckpointError


def load_model_weights(path: str | Path, device: str = "cpu") -> tuple[Any, Config, Path]:
    """Model (eval mode, fp32) and config from a run directory or checkpoint (no tokenizer)."""
    from megaformer.parallel.build import build_model

    ckpt = ckpt_layout.resolve_checkpoint(path)
    cfg = ckpt_layout.read_config(ckpt)
    # weights checked against the config (headers only) before anything is allocated or built
    ckpt_weights.check_weights(ckpt, cfg.model)
    if not (ckpt / ckpt_layout.WEIGHTS).exists():  # sharded: each tensor read into the model in turn
        from megaformer.checkpoint.sharded import ShardedState

        model = build_model(cfg, device=device, weights=ShardedState(ckpt), training=False).model
        return model.float().eval(), cfg, ckpt
    weights = ckpt_weights.load_weights(ckpt)
    model = build_model(cfg, device=device, training=False).model
    if cfg.model.tie_embeddings:
        weights.pop("lm_head.weight", None)
        weights["lm_head.weight"] = weights.get("tok_embeddings.weight")
    try:
        model.load_state_dict({k: v.float() for k, v in weights.items() if v is not None})
    except RuntimeError as e:
        raise CheckpointError(f"{ckpt}: weights do not fit the model its config describes "
                              f"({str(e).splitlines()[0][:200]})") from None
    model.to(device).eval()
    return model, cfg, ckpt
