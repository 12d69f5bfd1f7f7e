"""Per-layer FP8 demotion: a block whose FP8 numbers part from its high-precision numbers goes
back to high precision for the rest of the run.

Every ``log.diagnostics_interval`` steps the diagnostics micro-batch runs through each block
twice from the same input x_{l-1} (the FP8 pass's stream) and with the same weights: once with
its FP8 GEMMs, once with every GEMM in high precision. Block l's gap is

    gap_l = max( |R_l^fp8 - R_l^hp| / R_l^hp ,  |M_l^fp8 - M_l^hp| / |M_l^hp| )

with R_l = RMS of the stream after block l and M_l its largest attention logit q k^T / sqrt(d_k)
(both whole-model numbers under tensor parallelism: the logits' maximum is all-reduced). Each
block starts from the same input in both runs, so the gap is the block's own, not what earlier
blocks passed on. A block whose gap exceeds ``train.fp8_demote_threshold`` at
``train.fp8_demote_intervals`` consecutive passes runs in high precision from then on
(:func:`megaformer.parallel.fp8.demote`): logged, kept in the checkpoint (``meta.json``'s
``fp8_demoted``), listed by ``megaformer report``. Every rank computes the same gaps, so every
rank demotes the same blocks.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer.comm import ProcessGroup, all_reduce
from megaformer.diagnostics.metrics import layer_name, rms
from megaformer.diagnostics.residual import block_writes, eval_mode
from megaformer.parallel.fp8 import demote, high_precision

log = logging.getLogger(__name__)


def _relative(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs() / b.abs().clamp(min=1e-12)


def layer_gaps(model: nn.Module, input_ids: torch.Tensor, group: ProcessGroup) -> list[float]:
    """gap_l of every block of ``model`` on ``input_ids`` (see the module docstring); collective
    over the tensor-parallel ``group``."""
    gaps = []
    with eval_mode(model):
        x, rope = model.embed(input_ids)
        for i, block in enumerate(model.layers):
            fp8 = block_writes(block, i, x, rope)
            with high_precision(block):
                hp = block_writes(block, i, x, rope)
            logits = torch.stack([fp8.scores.amax(), hp.scores.amax()])
            logits = all_reduce(logits, group, op=dist.ReduceOp.MAX)
            gap = torch.maximum(
                _relative(rms(fp8.resid), rms(hp.resid)), _relative(logits[0], logits[1])
            )
            gaps.append(gap)
            x = fp8.resid
    return torch.stack(gaps).tolist()  # one host read for the pass


class Fp8Demotion:
    """The demotion rule over the run: a streak of passes above ``threshold`` per block, the
    blocks demoted so far (``demoted``, sorted)."""

    def __init__(self, threshold: float, intervals: int, n_layers: int) -> None:
        self.threshold, self.intervals = threshold, intervals
        self.streak = [0] * n_layers
        self.demoted: list[int] = []

    def restore(self, model: nn.Module, layers: Iterable[int]) -> None:
        """Demote ``layers`` again (a resumed run: the checkpoint's list)."""
        for i in layers:
            demote(model.layers[i])
        self.demoted = sorted(set(self.demoted) | set(layers))

    def __call__(
        self, model: nn.Module, input_ids: torch.Tensor, group: ProcessGroup, step: int
    ) -> dict[str, float]:
        """One pass: the gaps as metrics (``fp8_gap/layer_LL``), the blocks demoted now
        (``fp8_demoted/layer_LL`` = 1) and how many are demoted in all."""
        n = len(model.layers)
        gaps = layer_gaps(model, input_ids, group)
        out = {f"fp8_gap/{layer_name(i, n)}": g for i, g in enumerate(gaps)}
        for i, gap in enumerate(gaps):
            if i in self.demoted:
                continue
            self.streak[i] = self.streak[i] + 1 if gap > self.threshold else 0
            if self.streak[i] >= self.intervals:
                demote(model.layers[i])
                self.demoted = sorted([*self.demoted, i])
                out[f"fp8_demoted/{layer_name(i, n)}"] = 1.0
                log.warning(
                    "FP8: block %d switched to high precision at step %d (gap %.3g above "
                    "train.fp8_demote_threshold=%g at %d consecutive diagnostics passes)",
                    i,
                    step,
                    gap,
                    self.threshold,
                    self.intervals,
                )
        out["fp8_demoted_layers"] = float(len(self.demoted))
        return out
