"""AdamW with decoupled weight decay on matrices only.

Parameters with fewer than two dimensions (norm gains, biases) and embedding tables get no weight
decay, as in GPT-2/Megatron practice; every other weight gets ``train.weight_decay``.
"""

from __future__ import annotations

import torch

from megaformer.config import TrainConfig


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.ndim < 2 or "embedding" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # tied parameters appear once
        if not p.requires_grad:
            continue
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr,
                             betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
