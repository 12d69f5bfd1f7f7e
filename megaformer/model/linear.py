"""Linear layers of the model: ``nn.Linear`` (same parameters, same state-dict names) whose GEMM is
dispatched by :mod:`megaformer.kernels.gemm`, and projections that share one input fused into one GEMM.

Fused projections: q, k, v = X W_q^T, X W_k^T, X W_v^T (and the SwiGLU gate and up) are one product

    [Q | K | V] = X [W_q; W_k; W_v]^T

with the weights concatenated inside forward and again inside backward (:class:`FusedLinear` saves
X and the separate weights, so no concatenated copy is held in between), so the parameters stay
separate tensors (checkpoints, conversion and the tensor-parallel plan see ``wq``, ``wk``, ``wv``)
while the backward computes dX once, with K = N_q + N_k + N_v, instead of three products and two
additions. Under DeepSpeed ZeRO-3 a module's parameters are gathered only
when that module is called, so there each projection is called on its own.

Under FP8 (the projections' ``fp8`` set, :mod:`megaformer.parallel.fp8`) the weights keep one
scale each, so the products stay separate GEMMs, but X is cast to FP8 once for all of them
(``fp8.many``): a block input is cast twice (attention, FFN), not five times.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from megaformer.deepspeed_attrs import zero3_partitioned
from megaformer.kernels.gemm import FusedLinear, linear
from megaformer.kernels.selection import choose_for


class Linear(nn.Linear):
    """y = x W^T + b, W [out, in], through the GEMM dispatch of :mod:`megaformer.kernels.gemm`
    (or ``fp8``'s FP8 GEMMs when set: :mod:`megaformer.parallel.fp8`)."""

    fp8: Optional[Callable[..., torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fp8 or linear)(x, self.weight, self.bias)


def _zero3_partitioned(module: nn.Module) -> bool:
    return any(zero3_partitioned(p) for p in module.parameters(recurse=False))


def fused_product(x: torch.Tensor, projections: Sequence[nn.Module]) -> Optional[torch.Tensor]:
    """[p_1(x) | ... | p_n(x)] (concatenated on the last dimension) as one GEMM, or None where the
    projections run one by one: where the rule for ``projections`` says so (CUDA: no weight
    concatenation per call), ZeRO-3 partitioned parameters, a projection applying its own input
    communication, FP8 GEMMs (one scale per weight), or a mix of present and absent biases."""
    if (
        len(projections) == 1
        or choose_for("projections", x).impl != "fused"
        or any(_zero3_partitioned(p) for p in projections)
        or any(getattr(p, "input_comm", False) for p in projections)
        or any(getattr(p, "fp8", None) is not None for p in projections)
    ):
        return None
    weights = [p.weight for p in projections]
    biases: list[Optional[torch.Tensor]] = [p.bias for p in projections]
    if any(b is None for b in biases):
        if not all(b is None for b in biases):
            return None
        biases = []
    if torch.is_autocast_enabled(x.device.type):
        b = torch.cat(biases) if biases else None  # type: ignore[arg-type]
        # autocast's cast of the concatenated weight is saved (as nn.Linear's own)
        return linear(x, torch.cat(weights), b)
    return FusedLinear.apply(x, len(weights), *weights, *biases)


def shared_fp8_projections(
    x: torch.Tensor, projections: Sequence[nn.Module]
) -> Optional[list[torch.Tensor]]:
    """[p(x) for p in projections] on FP8 GEMMs from one FP8 cast of x, or None where that does
    not apply: the projections do not share one FP8 setting, ZeRO-3 partitioned parameters, a
    projection applying its own input communication."""
    fp8 = getattr(projections[0], "fp8", None)
    if (
        fp8 is None
        or len(projections) == 1
        or any(getattr(p, "fp8", None) is not fp8 for p in projections)
        or any(_zero3_partitioned(p) for p in projections)
        or any(getattr(p, "input_comm", False) for p in projections)
    ):
        return None
    return fp8.many(x, [p.weight for p in projections], [p.bias for p in projections])


def fused_projections(x: torch.Tensor, projections: Sequence[nn.Module]) -> list[torch.Tensor]:
    """[p(x) for p in projections] as one GEMM over the concatenated weights (see the docstring),
    or under FP8 as GEMMs sharing one cast of x.

    Each projection is a linear module applying no input communication of its own (nn.Linear, or a
    column-parallel shard whose input region the caller entered); their biases are all present or
    all absent (else they run one by one)."""
    shared = shared_fp8_projections(x, projections)
    if shared is not None:
        return shared
    y = fused_product(x, projections)
    if y is None:
        return [p(x) for p in projections]
    return list(y.split([p.weight.shape[0] for p in projections], dim=-1))
