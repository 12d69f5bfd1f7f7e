"""The optimizer of ``train.optimizer``: AdamW, or Muon (:mod:`megaformer.runtime.muon`) with
AdamW for what is not a block matrix.

AdamW with decoupled weight decay on matrices only.

Parameters with fewer than two dimensions (norm gains, biases) and embedding tables get no weight
decay, as in GPT-2/Megatron practice; every other weight gets ``train.weight_decay``.

The update is the same whichever implementation runs (``train.adam_impl``); they differ in memory
traffic. foreach runs one multi-tensor operation per term of

    m <- b1 m + (1-b1) g,   v <- b2 v + (1-b2) g^2,   p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)

so p, g, m, v cross memory about six times per step; fused reads each once and writes p, m, v once.

Under expert parallelism the experts' parameters form groups of their own (DeepSpeed's MoE groups:
``moe: True``, named by their expert-data-parallel group), with the same hyperparameters.
"""

from __future__ import annotations

from typing import Optional

import torch

from megaformer.config import TrainConfig
from megaformer.runtime.muon import Muon, MuonGroups, uses_muon

FUSED_DEVICES = ("cpu", "cuda")


def no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3: the whole parameter's shape
    return len(shape) < 2 or "embedding" in name


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # tied parameters appear once
        if not p.requires_grad:
            continue
        (no_decay if no_weight_decay(name, p) else decay).append(p)
    groups = [
        {"name": "decay", "params": decay, "weight_decay": weight_decay},
        {"name": "no_decay", "params": no_decay, "weight_decay": 0.0},
    ]
    if any(getattr(p, "allreduce", True) is False for p in decay + no_decay):
        # expert-parallel parameters in groups of their own, marked for DeepSpeed (reduced and,
        # under ZeRO, partitioned over their expert-data-parallel group)
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = [
            g for g in split_params_into_different_moe_groups_for_optimizer(groups) if g["params"]
        ]
    return groups


def use_fused_adam(params: list[torch.Tensor], impl: str) -> bool:
    """``train.adam_impl`` resolved: auto means fused when torch has the kernel for every parameter."""
    if impl != "auto":
        return impl == "fused"
    return all(p.device.type in FUSED_DEVICES and p.is_floating_point() for p in params)


def adamw_options(params: list[torch.Tensor], t: TrainConfig) -> dict:
    """torch's AdamW keyword arguments from ``t``."""
    fused = use_fused_adam(params, t.adam_impl)
    return {
        "lr": t.lr,
        "betas": (t.adam_beta1, t.adam_beta2),
        "eps": t.adam_eps,
        "fused": fused or None,
        "foreach": None if fused else True,
    }


def build_optimizer(
    model: torch.nn.Module,
    t: TrainConfig,
    names: Optional[dict[int, str]] = None,
    comm: Optional[MuonGroups] = None,
) -> torch.optim.Optimizer:
    """``train.optimizer``: torch's AdamW, or :class:`~megaformer.runtime.muon.Muon` (the block
    matrices; AdamW for the rest). ``names``: id(parameter) -> its plain-model name (the pipeline
    renames them); ``comm``: Muon's process groups."""
    groups = param_groups(model, t.weight_decay)
    params = [p for g in groups for p in g["params"]]
    if t.optimizer == "adamw":
        return torch.optim.AdamW(groups, **adamw_options(params, t))
    return Muon(muon_groups(model, groups, t, names), adamw_options(params, t), comm)


def muon_groups(
    model: torch.nn.Module, groups: list[dict], t: TrainConfig, names: Optional[dict[int, str]]
) -> list[dict]:
    """AdamW's groups less the block matrices, which form Muon groups of their own (one per
    AdamW group they came from, so expert parameters keep their MoE group marks)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    if names is not None:
        name_of.update(names)
    extra = tuple(t.muon_adamw_params or ())
    out = []
    for g in groups:
        muon = [p for p in g["params"] if uses_muon(name_of[id(p)], p, extra)]
        chosen = {id(p) for p in muon}
        rest = [p for p in g["params"] if id(p) not in chosen]
        if rest:
            out.append({**g, "params": rest, "use_muon": False})
        if muon:
            out.append(
                {
                    **g,
                    "params": muon,
                    "use_muon": True,
                    "lr": t.muon_lr if t.muon_lr is not None else t.lr,
                    "weight_decay": t.weight_decay,
                    "momentum": t.muon_momentum,
                    "nesterov": t.muon_nesterov,
                    "ns_steps": t.muon_ns_steps,
                }
            )
    return out
