"""Per-layer and per-head numbers of the residual-stream pass, under the names training logs.

For block l (``LL`` = l zero-padded) on a fixed micro-batch, with means over batch and positions:

    resid/layer_LL/rms                  sqrt(mean x_l^2)          the stream after block l
    attn_write/layer_LL/rms             sqrt(mean a_l^2)          what attention wrote
    mlp_write/layer_LL/rms              sqrt(mean m_l^2)          what the MLP wrote
    attn_write/layer_LL/head_HH/norm    sqrt(mean_t ||z_h W^O_h^T||^2)   head h's write (no bias)
    attn/layer_LL/entropy/head_HH       mean_t -sum_s p_ts log p_ts (nats) of head h's attention
    attn/layer_LL/max_logit             max over heads and unmasked (t, s) of q k^T / sqrt(d_k)
    logit_lens/layer_LL/loss            cross-entropy of lm_head(final_norm(x_l)) on the labels
    router/layer_LL/max_logit           max |z| of an MoE block's router logits
    router/layer_LL/load_cv             std / mean of the tokens each expert got (0: balanced)

plus ``resid/embed/rms`` (x_0). The last layer's logit-lens loss is the model's own loss on the
micro-batch. Under tensor parallelism the per-head numbers are all-gathered over the TP group and
the maximum logit all-reduced, so every rank returns the same dictionary as one process would.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaformer.comm import ProcessGroup, all_reduce
from megaformer.diagnostics.residual import (
    LayerTrace,
    eval_mode,
    head_write_sq_norms,
    logit_lens_logits,
    trace_layers,
)

PREFIXES = ("resid/", "attn_write/", "mlp_write/", "attn/", "logit_lens/", "router/")


def is_diagnostic(key: str) -> bool:
    return key.startswith(PREFIXES)


def layer_name(index: int, n_layers: int) -> str:
    return f"layer_{index:0{max(2, len(str(n_layers - 1)))}d}"


def head_name(index: int, n_heads: int) -> str:
    return f"head_{index:0{max(2, len(str(n_heads - 1)))}d}"


def rms(t: torch.Tensor) -> torch.Tensor:
    return t.float().pow(2).mean().sqrt()


def _gather_heads(local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[h_local, k] per rank -> [h, k] in global head order (TP rank r holds heads r h_local..)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def _layer_stats(
    model: nn.Module, trace: LayerTrace, labels: Optional[torch.Tensor], group: ProcessGroup
) -> dict[str, torch.Tensor]:
    """Tensors (not yet floats: one host sync for the whole pass) of one layer."""
    entropy = torch.special.entr(trace.probs).sum(-1).mean(dim=(0, 2))  # [h_local]
    write = head_write_sq_norms(trace).mean(dim=(0, 2)).sqrt()  # [h_local]
    per_head = _gather_heads(torch.stack((entropy, write), dim=1), group)  # [h, 2]
    # masked logits are -inf and every query sees at least its own key: amax is over unmasked ones
    max_logit = all_reduce(trace.scores.amax().reshape(1), group, op=dist.ReduceOp.MAX)[0]
    out = {
        "resid": rms(trace.resid),
        "attn_write": rms(trace.attn_write),
        "mlp_write": rms(trace.mlp_write),
        "max_logit": max_logit,
        "per_head": per_head,
    }
    if trace.router_logits is not None:  # replicated over TP, the same batch on every EP rank
        load = trace.expert_load.float()
        out["router_max_logit"] = trace.router_logits.abs().amax()
        out["load_cv"] = load.std(unbiased=False) / load.mean()
    if labels is not None:
        out["lens"] = model.loss_fn(logit_lens_logits(model, trace.resid), labels).float()
    return out


def _named(stats: dict[str, torch.Tensor], layer: str, n_heads: int) -> dict[str, float]:
    out = {
        f"resid/{layer}/rms": float(stats["resid"]),
        f"attn_write/{layer}/rms": float(stats["attn_write"]),
        f"mlp_write/{layer}/rms": float(stats["mlp_write"]),
        f"attn/{layer}/max_logit": float(stats["max_logit"]),
    }
    per_head = stats["per_head"].tolist()
    for h, (entropy, norm) in enumerate(per_head):
        head = head_name(h, n_heads)
        out[f"attn/{layer}/entropy/{head}"] = entropy
        out[f"attn_write/{layer}/{head}/norm"] = norm
    if "router_max_logit" in stats:
        out[f"router/{layer}/max_logit"] = float(stats["router_max_logit"])
        out[f"router/{layer}/load_cv"] = float(stats["load_cv"])
    if "lens" in stats:
        out[f"logit_lens/{layer}/loss"] = float(stats["lens"])
    return out


def layer_metrics(
    model: nn.Module,
    x: torch.Tensor,
    rope,
    indices: Iterable[int],
    labels: Optional[torch.Tensor],
    group: ProcessGroup,
    lens: bool = True,
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """Metrics of blocks ``indices`` run from the stream x (inside :func:`eval_mode`), and the
    stream after each block (for a logit lens computed elsewhere when ``lens`` is False)."""
    n_layers, n_heads = model.cfg.n_layers, model.cfg.n_heads
    stats, streams = [], []
    for trace in trace_layers(model, x, rope, indices):
        stats.append((trace.index, _layer_stats(model, trace, labels if lens else None, group)))
        streams.append(trace.resid)
    out: dict[str, float] = {}
    for index, s in stats:
        out.update(_named(s, layer_name(index, n_layers), n_heads))
    return out, streams


def residual_diagnostics(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, tp_group: ProcessGroup = None
) -> dict[str, float]:
    """Every metric above for a whole (possibly tensor-parallel) model on one micro-batch.
    Collective over ``tp_group``: every rank of it calls with the same batch."""
    with eval_mode(model):
        x0, rope = model.embed(input_ids)
        out = {"resid/embed/rms": float(rms(x0))}
        metrics, _ = layer_metrics(model, x0, rope, range(model.cfg.n_layers), labels, tp_group)
    out.update(metrics)
    return out
