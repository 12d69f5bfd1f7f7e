"""The global gradient norm of a tensor-, pipeline- and data-parallel model, and clipping by it.

    ||g||_2 = sqrt( sum over TP ranks of ||g_sharded||^2  +  ||g_replicated||^2 ),  summed over stages

Shards of tensor-parallel parameters are summed over the TP group, replicated parameters counted
once, pipeline stages summed over the PP group (the copy of a tied weight on the last stage
skipped); under expert parallelism each rank's experts (their TP shards summed first) are summed
over the EP group, so every expert counts once. Gradients are already averaged over the data-parallel group when this runs. Clipping:

    g <- g * min(1, c / (||g|| + 1e-6))
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch

from megaformer.comm import all_reduce, no_counting, size
from megaformer.deepspeed_attrs import pipe_replicated


def global_grad_norm(
    params: Iterable[torch.nn.Parameter], tp_group: Any, pp_group: Any = None, ep_group: Any = None
) -> float:
    """||g||_2 over the whole model (collective over ``tp_group``, ``pp_group`` and, with expert
    parallelism, ``ep_group``; a group of one or None: no reduction there)."""
    split_experts = ep_group is not None and size(ep_group) > 1
    # (expert-parallel?, TP-sharded?) -> squared norms
    parts: dict[tuple[bool, bool], list[torch.Tensor]] = {
        (e, s): [] for e in (False, True) for s in (False, True)
    }
    device = torch.device("cpu")
    for p in params:
        if p.grad is None or pipe_replicated(p):
            continue
        device = p.grad.device
        expert = split_experts and getattr(p, "allreduce", True) is False
        parts[expert, bool(getattr(p, "tensor_model_parallel", False))].append(
            p.grad.detach().double().pow(2).sum()
        )
    # summed where the gradients live: no host sync per parameter on the training step
    s = {
        k: torch.stack(v).sum() if v else torch.zeros((), dtype=torch.float64, device=device)
        for k, v in parts.items()
    }
    with no_counting():
        total = all_reduce(s[False, True], tp_group) + s[False, False]
        if split_experts:
            total = total + all_reduce(
                all_reduce(s[True, True], tp_group) + s[True, False], ep_group
            )
        if pp_group is not None:
            total = all_reduce(total, pp_group)
    return float(total.sqrt())


@torch.no_grad()
def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float, norm: float) -> None:
    """g <- g * min(1, max_norm / (norm + 1e-6)) for every gradient, given the global ``norm``."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


class GradNormClipper:
    """Measures the global norm (:func:`global_grad_norm`) of ``params()`` and clips by it.

    ``measure_and_clip()`` runs after the gradients are complete and before the update;
    ``norm_for_step()`` is the norm of the step being taken (measured now when not clipping)."""

    def __init__(
        self,
        params: Callable[[], Iterable[torch.nn.Parameter]],
        tp_group: Any,
        pp_group: Any,
        max_norm: float,
        ep_group: Any = None,
    ) -> None:
        self.params, self.groups, self.max_norm = params, (tp_group, pp_group, ep_group), max_norm
        self.norm: Optional[float] = None

    def measure(self) -> float:
        self.norm = global_grad_norm(self.params(), *self.groups)
        return self.norm

    def measure_and_clip(self) -> None:
        clip_grads_(self.params(), self.max_norm, self.measure())

    def norm_for_step(self) -> float:
        if self.max_norm == 0:  # otherwise measure_and_clip measured it just before the step
            self.measure()
        assert self.norm is not None
        return self.norm
