"""A model with its weights from a megaformer run directory or checkpoint, on one process (no
DeepSpeed, no process group): what generation and ``megaformer convert --verify`` run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.checkpoint.router_state import load_router_state
from megaformer.config import Config


def load_model_weights(path: str | Path, device: str = "cpu") -> tuple[Any, Config, Path]:
    """Model (eval mode, fp32) and config from a run directory or checkpoint (no tokenizer)."""
    from megaformer.parallel.build import build_model

    ckpt = ckpt_layout.resolve_checkpoint(path)
    cfg = ckpt_layout.read_config(ckpt)
    # weights checked against the config (headers only) before anything is allocated or built
    ckpt_weights.check_weights(ckpt, cfg.model)
    if (ckpt / ckpt_layout.WEIGHTS).exists():  # each tensor read into the model in turn
        from megaformer.checkpoint.sliced import SlicedWeights

        weights: Any = SlicedWeights.checkpoint(ckpt, cfg.model)
    else:
        from megaformer.checkpoint.sharded import ShardedState

        weights = ShardedState(ckpt)
    model = build_model(cfg, device=device, weights=weights, training=False).model
    load_router_state(model, ckpt)  # the MoE blocks' aux-loss-free biases
    return model.float().eval(), cfg, ckpt
