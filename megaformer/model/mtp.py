"""Multi-token prediction (DeepSeek-V3, section 2.2): D extra modules predicting tokens further
ahead, each sequential on the previous one, sharing the embedding and the output head.

For token t_i at depth k = 1..D, with h^0_i the main model's last block output (before its final
norm) and Emb the shared token embedding:

    h'^k_i      = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))]          M_k: [d, 2d]
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                                        one causal block
    P^k_{i+k+1} = softmax(OutHead(Norm_k(h^k_i)))                            shared output head
    L^k_MTP     = -1/(T-k) sum_i log P^k_{i+k+1}[t_{i+k+1}]
    L_MTP       = lambda / D * sum_k L^k_MTP          (lambda: ``model.mtp_loss_coef``)

added to the training loss (and logged apart: ``mtp/loss``, the mean of the L^k). Evaluation,
generation and export use the main model alone. The modules are ``Transformer.mtp[k-1]``; their
block is built as block L + k - 1 of the model would be (dense or MoE by ``model.moe``).

Split sequences (context parallelism) cannot be cut at T - k on each rank. There every module runs
on the whole length with the tokens shifted over the whole sequence before the split
(:func:`shifted_sequences`): position i reads t_{i+k} and is scored on t_{i+k+1}, the last k
positions read a filler token and are ignored. The causal mask keeps the filler out of every scored
position, so the losses equal the cut ones (:class:`ShiftedTokens` carries this rank's part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from megaformer.config import ModelConfig
from megaformer.model.block import Block
from megaformer.model.linear import Linear
from megaformer.model.norms import RMSNorm, build_norm


class MTPModule(nn.Module):
    """Depth k: (h^{k-1} [B, T-k, d], Emb(t_{k:}) [B, T-k, d]) -> Norm_k(h^k) and h^k."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.hidden_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.embed_norm = RMSNorm(d, eps=cfg.norm_eps)
        self.proj = Linear(2 * d, d, bias=False)  # M_k
        self.block = Block(cfg, layer=layer)
        self.norm = build_norm(cfg)  # before the shared output head

    def forward(
        self,
        hidden: torch.Tensor,
        embedded: torch.Tensor,
        positions: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Norm_k(h^k), h^k) of h^{k-1} and the embeddings of the tokens k ahead, at the tokens'
        absolute ``positions`` (default 0..T-1)."""
        h = self.proj(torch.cat((self.hidden_norm(hidden), self.embed_norm(embedded)), dim=-1))
        h = self.block(h, positions=positions)
        return self.norm(h), h


@dataclass
class ShiftedTokens:
    """This rank's part of the sequences shifted over the whole sequence, per depth k = 1..D:
    ``ids[k-1]`` [B, T_local] (t_{i+k}), ``labels[k-1]`` [B, T_local] (t_{i+k+1}, -100 past the
    end), ``scales[k-1]`` (a 0-dim factor turning this rank's mean L^k into its share of the
    whole sequences' mean) and ``weights[k-1]`` (that factor over the main loss's, which the
    caller applies to the whole loss afterwards)."""

    ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    scales: list[torch.Tensor]
    weights: list[torch.Tensor]


def shifted_sequences(
    input_ids: torch.Tensor, labels: torch.Tensor, depth: int, filler: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(ids_k, labels_k) for k = 1..depth] of whole sequences [B, T]: ids_k[:, i] = t_{i+k}
    (``filler`` past the end), labels_k[:, i] = labels[:, i+k] (-100 past the end)."""
    out = []
    for k in range(1, depth + 1):
        ids = torch.cat((input_ids[:, k:], input_ids.new_full((input_ids.shape[0], k), filler)), 1)
        lab = torch.cat((labels[:, k:], labels.new_full((labels.shape[0], k), -100)), 1)
        out.append((ids, lab))
    return out


def mtp_losses(
    modules: nn.ModuleList,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    shifted: Optional[ShiftedTokens] = None,
    positions: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """[L^1_MTP, ..., L^D_MTP] for the main model's last block output ``hidden`` [B, T, d] of
    ``input_ids`` [B, T] with ``labels`` [B, T] (labels[:, i] = t_{i+1}, -100 ignored);
    ``embed(ids)`` is the shared embedding, ``head_loss(h, labels)`` the shared head's loss.

    With ``shifted`` (this rank's part of split sequences, at ``positions``) each module runs on
    the whole local length and L^k is this rank's mean of the shifted labels."""
    if shifted is not None:
        losses, h = [], hidden
        for module, ids, lab in zip(modules, shifted.ids, shifted.labels):
            normed, h = module(h, embed(ids), positions)
            losses.append(head_loss(normed, lab))
        return losses
    T = input_ids.shape[1]
    losses = []
    h = hidden
    for k, module in enumerate(modules, start=1):
        if T - k < 1:
            break
        normed, h = module(h[:, : T - k], embed(input_ids[:, k:]))
        losses.append(head_loss(normed, labels[:, k:]))
    return losses


class MTPMetrics:
    """The step's MTP loss sums on this rank: sum of the mean L^k over the micro-batches, and the
    number of micro-batches (a float64 pair, on the model's device; no host read per step)."""

    def __init__(self) -> None:
        self.sums: Optional[torch.Tensor] = None

    def add(self, losses: list[torch.Tensor]) -> None:
        value = torch.stack([x.detach().double() for x in losses]).mean()
        pair = torch.stack((value, torch.ones_like(value)))
        self.sums = pair if self.sums is None else self.sums + pair

    def take(
        self, group: Any = None, stages: Any = None, device: Optional[torch.device] = None
    ) -> dict[str, float]:
        """{'mtp/loss': the step's mean over micro-batches and the ``group``'s ranks} (collective
        over ``group`` when it has more than one rank); resets the sums. ``stages`` (pipeline
        parallelism: the pipeline group, whose last stage alone holds the modules): the sums
        are first summed over it, so that every stage (on ``device``) reports them."""
        import torch.distributed as dist

        if stages is not None and dist.get_world_size(stages) > 1:
            if self.sums is None:
                self.sums = torch.zeros(2, dtype=torch.float64, device=device)
            dist.all_reduce(self.sums, group=stages)
        if self.sums is None:
            return {}
        sums, self.sums = self.sums, None
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(sums, group=group)
        return {"mtp/loss": float(sums[0] / sums[1])}
