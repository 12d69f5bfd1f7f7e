"""The MoE blocks' aux-loss-free router biases in a checkpoint: ``moe_router/stage_<pp>.safetensors``.

The biases b (:mod:`megaformer.model.moe`) are no parameter and no optimizer state, but the
expert selection depends on them, so an exact resume restores them. They are the same on every TP
and DP rank; each pipeline stage writes its blocks', keyed by plain-model name
(``layers.<i>.mlp.expert_bias``), so any layout reads them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from megaformer.errors import CheckpointError
from megaformer.model.moe import moe_layers

ROUTER_DIR = "moe_router"


def router_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The aux-loss-free biases of ``module``'s MoE blocks, by plain-model name."""
    return {
        f"layers.{m.layer}.mlp.expert_bias": m.expert_bias.detach().float().cpu().clone()
        for m in moe_layers(module)
    }


def router_files(module: nn.Module, topo: Any) -> dict[str, dict[str, torch.Tensor]]:
    """This rank's share of a checkpoint's router state: the first TP, CP and DP rank of each
    pipeline stage writes ``moe_router/stage_<pp>.safetensors`` (the biases are the same on every
    TP, CP and DP rank); nothing without MoE blocks."""
    state = router_state(module)
    if not state or topo.tp_rank != 0 or topo.cp_rank != 0 or topo.dp_rank != 0:
        return {}
    return {f"{ROUTER_DIR}/stage_{topo.pp_rank:03d}.safetensors": state}


def read_router_state(ckpt: Path) -> dict[str, torch.Tensor]:
    """The aux-loss-free biases saved in checkpoint ``ckpt``, by plain-model name (empty for a
    checkpoint without router state)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(ckpt) / ROUTER_DIR
    if folder.is_symlink() or not folder.is_dir():
        return {}
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("stage_*.safetensors")):
        if f.is_symlink() or not f.is_file():
            raise CheckpointError(f"{f}: not a regular file")
        try:
            saved.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable router state ({str(e)[:200]})") from None
    return saved


def write_router_state(ckpt: Path, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` (biases by plain-model name) as checkpoint ``ckpt``'s router state, as one
    stage's file (any layout reads it: keyed by block); nothing when empty."""
    from safetensors.torch import save_file

    if not state:
        return
    folder = Path(ckpt) / ROUTER_DIR
    folder.mkdir(exist_ok=True)
    save_file(
        {k: v.detach().float().cpu().contiguous() for k, v in state.items()},
        str(folder / "stage_000.safetensors"),
    )


@torch.no_grad()
def load_router_state(module: nn.Module, ckpt: Path) -> int:
    """Set ``module``'s aux-loss-free biases from checkpoint ``ckpt`` (any layout wrote it: keyed
    by block). Returns how many blocks were set; a checkpoint without router state (written
    before, or converted from a class without expert biases) leaves them at zero."""
    if not moe_layers(module):
        return 0
    return set_router_state(module, read_router_state(ckpt), Path(ckpt) / ROUTER_DIR)


@torch.no_grad()
def set_router_state(module: nn.Module, saved: dict[str, torch.Tensor], source: object) -> int:
    """Set ``module``'s aux-loss-free biases from ``saved`` (by plain-model name; ``source``
    names where they came from in errors). Returns how many blocks were set."""
    layers = moe_layers(module)
    folder = source
    n = 0
    for m in layers:
        t = saved.get(f"layers.{m.layer}.mlp.expert_bias")
        if t is None:
            continue
        if tuple(t.shape) != tuple(m.expert_bias.shape):
            raise CheckpointError(
                f"{folder}: layers.{m.layer}.mlp.expert_bias has shape "
                f"{list(t.shape)}, the model needs {list(m.expert_bias.shape)}"
            )
        m.expert_bias.copy_(t.to(m.expert_bias.dtype))
        n += 1
    return n
