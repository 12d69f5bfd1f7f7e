"""The residual stream, decomposed into what every block writes (a separate no-grad forward).

A pre-norm Transformer's residual stream is a sum of additive writes:

    x_L = x_0 + sum_l a_l + sum_l m_l                         x_0 = embedding output

    sequential:  a_l = Attn_l(Norm_a(x_{l-1})),  m_l = MLP_l(Norm_m(x_{l-1} + a_l))
    parallel:    a_l = Attn_l(Norm_a(x_{l-1})),  m_l = MLP_l(Norm_m(x_{l-1}))
                 x_l = x_{l-1} + a_l + m_l

and each attention write is a sum over heads,

    a_l = sum_h z_h W^O_h + b^O,     W^O_h = W^O[:, h d_k:(h+1) d_k],

with z_h = softmax(q_h k_h^T / sqrt(d_k) + M) v_h head h's context. The output bias b^O (when the
model has biases) belongs to no head: it is counted once, in a_l, and in no per-head write.

In an MoE block the MLP write m_l is the MoE FFN's output (routed and shared experts); the pass
also keeps the block's router logits z = Norm_m(.) W_r^T [B T, E] and the tokens routed to each
expert on this micro-batch (top-k choices, with the load-balancing bias).

:func:`trace_layers` runs the model's own modules (norms, q/k/v/o projections, rotary positions,
MLP) in eval mode without gradients; only the attention core is swapped for an explicit one
(:class:`ProbeAttention`) that keeps the logits and probabilities, which fused kernels never
materialise. The training forward is untouched.

Tensor parallelism: every rank runs the pass on the whole sequence (also under sequence
parallelism, whose reduce-scatters are switched to all-reduces for the pass), so the residual stream,
a_l and m_l are the full tensors on every rank; z, the logits and the probabilities are this rank's
local heads, global head ``head_offset + i``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch
import torch.nn as nn

from megaformer.kernels.attention import attention_scores, share_kv_heads

Rope = Optional[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class LayerTrace:
    """What block ``index`` read and wrote: tensors [B, T, d] and, per local head, [B, h, T, *]."""

    index: int
    attn_write: torch.Tensor  # a_l (bias included)
    mlp_write: torch.Tensor  # m_l
    resid: torch.Tensor  # x_l, the stream after the block
    context: torch.Tensor  # z  [B, h_local, T, d_k]
    scores: torch.Tensor  # q k^T / sqrt(d_k) + M, fp32 [B, h_local, T, T], masked = -inf
    probs: torch.Tensor  # softmax of the scores, fp32
    w_o: torch.Tensor  # this rank's W^O columns [d, h_local * d_k]
    router_logits: Optional[torch.Tensor] = None  # MoE blocks: z [B T, E], fp32
    expert_load: Optional[torch.Tensor] = None  # MoE blocks: tokens routed to each expert [E]


class ProbeAttention(nn.Module):
    """softmax(Q K^T / sqrt(d_k) + M) V written out (fp32), keeping the logits, probabilities and
    per-head context of its last call. Drop-in for ``Attention.core`` (no dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.scores: Optional[torch.Tensor] = None
        self.probs: Optional[torch.Tensor] = None
        self.context: Optional[torch.Tensor] = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool,
        dropout_p: float = 0.0,
        backend: str = "reference",
        scale: Optional[float] = None,
        doc_ids: Optional[torch.Tensor] = None,
        window: Optional[int] = None,
    ) -> torch.Tensor:
        if doc_ids is not None:  # refused by the config (log.diagnostics with document_mask)
            raise ValueError("the diagnostics pass does not support model.document_mask")
        self.scores = attention_scores(q, k, causal, scale, window)
        self.probs = torch.softmax(self.scores, dim=-1)
        self.context = self.probs @ share_kv_heads(v.float(), q.shape[1])
        return self.context.to(q.dtype)


@contextlib.contextmanager
def _probed(block: nn.Module, probe: ProbeAttention) -> Iterator[None]:
    """Swap the block's attention core for ``probe``; row-parallel outputs all-reduce (whole
    sequence) instead of reduce-scattering, so the pass needs no sequence split."""
    from megaformer.model.moe import MoE
    from megaformer.parallel.layers import RowParallelLinear

    attn = block.attn
    saved_core = attn.core
    rows = [
        m
        for m in (attn.wo, *block.mlp.modules())
        if isinstance(m, (RowParallelLinear, MoE)) and m.sequence_parallel
    ]
    attn.core = probe
    for m in rows:
        m.sequence_parallel = False
    try:
        yield
    finally:
        attn.core = saved_core
        for m in rows:
            m.sequence_parallel = True


def block_writes(block: nn.Module, index: int, x: torch.Tensor, rope: Rope) -> LayerTrace:
    """a_l, m_l and x_l of one block on the residual stream x = x_{l-1} (the block's own modules;
    ``forward`` is called directly, past the tensor-parallel input hooks)."""
    from megaformer.model.moe import MoE, expert_counts

    probe = ProbeAttention()
    router = load = None
    with _probed(block, probe):
        a = block.attn.forward(block.attn_norm(x), rope=rope)
        h = block.mlp_norm(x if block.parallel else x + a)
        if isinstance(block.mlp, MoE):
            router, idx, _ = block.mlp.route(h.reshape(-1, h.shape[-1]))
            load = expert_counts(idx.reshape(-1), block.mlp.num_experts)
        m = block.mlp.forward(h)
    return LayerTrace(
        index,
        a,
        m,
        x + a + m,
        probe.context,
        probe.scores,
        probe.probs,
        block.attn.wo.weight,
        router,
        load,
    )


def head_writes(trace: LayerTrace) -> torch.Tensor:
    """Per-head writes z_h W^O_h^T, [B, h_local, T, d] (fp32; the output bias in none of them)."""
    d, h = trace.w_o.shape[0], trace.context.shape[1]
    w = trace.w_o.float().view(d, h, -1)
    return torch.einsum("bhtk,dhk->bhtd", trace.context, w)


def head_write_sq_norms(trace: LayerTrace) -> torch.Tensor:
    """||z_h W^O_h^T||^2 per token, [B, h_local, T], through the Gram matrices G_h = W^O_h^T W^O_h
    (d_k x d_k), without materialising the [B, h, T, d] writes."""
    d, h = trace.w_o.shape[0], trace.context.shape[1]
    w = trace.w_o.float().view(d, h, -1)
    gram = torch.einsum("dhk,dhj->hkj", w, w)
    return torch.einsum("bhtk,hkj,bhtj->bht", trace.context, gram, trace.context).clamp_min(0)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """No dropout and no gradients for the pass; the previous train/eval flags come back after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


def trace_layers(
    model: nn.Module, x: torch.Tensor, rope: Rope, indices: Optional[Iterable[int]] = None
) -> Iterator[LayerTrace]:
    """Run blocks ``indices`` (default all, in order) from the residual stream x, one at a time.

    Call inside :func:`eval_mode`. Lazy: a consumer that keeps only statistics holds one layer's
    probabilities at a time.
    """
    for i in range(len(model.layers)) if indices is None else indices:
        trace = block_writes(model.layers[i], i, x, rope)
        x = trace.resid
        yield trace


def logit_lens_logits(model: nn.Module, resid: torch.Tensor) -> torch.Tensor:
    """The output layer applied early: lm_head(final_norm(x_l)) (vocab-sharded under TP)."""
    return model.lm_head(model.final_norm(resid))
