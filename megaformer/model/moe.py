"""Mixture-of-Experts FFN: token-choice top-k routing over E expert FFNs (+ shared experts).

For the N tokens x_n of a micro-batch (Shazeer et al. 2017; Switch, Fedus et al. 2021; Mixtral;
DeepSeek-V3):

    logits  z_n = x_n W_r^T                                  router, [N, E], fp32
    scores  s_n = softmax(z_n)  or  sigmoid(z_n)             ``model.moe.score``
    experts T_n = top-k_e (s_ne + b_e),  e in G_n            b: aux-loss-free bias, selection only
    weights g_ne = gamma s_ne (/ sum_{e' in T_n} s_ne')      ``model.moe.renormalize``; gamma
                                                             ``model.moe.routed_scaling_factor``
    y_n     = sum_{e in T_n} g_ne FFN_e(x_n)  (+ FFN_shared(x_n), times sigmoid(x_n w_g) when
                                                  ``model.moe.shared_gate``: Qwen2-MoE)

Group-limited routing (DeepSeek-V3's node-limited routing, ``model.moe.num_groups`` > 1): the E
experts form G groups of E / G consecutive ids; group j scores sum of the two largest s_ne + b_e
in it, and G_n is the union of the ``top_groups`` best groups of token n (every expert without
groups). With the groups on the expert-parallel ranks of one node, a token's routed rows reach at
most ``top_groups`` nodes.

Dispatch sorts the N k (token, expert) assignments by expert (a stable sort: within an expert,
token order), so each expert reads one contiguous block of rows; the experts run as one grouped
GEMM per matrix (``torch._grouped_mm``) or a loop over experts, as the kernel table's ``experts``
rule picks (:mod:`megaformer.kernels.selection`); the combine scatters the weighted rows back with
an index-add, accumulating the k outputs of a token in fp32 and casting once. The expert counts
are a fixed-shape [E] tensor (a scatter-add) and stay on the device: the grouped path reads
nothing back to the host, the loop reads the counts once to split the rows. Dropless (the default), every assignment is
computed, so a token's output depends on that token alone. With a capacity factor, expert e keeps
its first C = ceil(capacity_factor N k / E) assignments; the rest are dropped (counted).

Load balancing (added to the training loss by the Transformer, per MoE block):

    aux  = alpha E sum_e f_e P_e,  f_e = |{(n, e)}| / (N k),  P_e = mean_n p_ne      (1 if balanced)
    z    = beta mean_n (logsumexp_e z_ne)^2                                             (ST-MoE)

with p the router probabilities (softmax; for sigmoid scores the scores normalised per token).
The aux-loss-free bias b (DeepSeek-V3) is no gradient: after each optimizer step,
b_e += rate * sign(mean_e' load_e' - load_e), the load counted over the step's tokens summed over
the data-parallel group (:func:`end_of_step`), so every rank keeps the same b.

Expert parallelism (:mod:`megaformer.parallel.experts`): each rank of the expert-parallel group
holds E / P of the experts; the sorted rows travel to their experts' ranks and back by all-to-all
(``expert_dispatch``, set by the build, which also combines them; under tensor parallelism each
TP rank dispatches its share of the tokens), the shared experts running meanwhile; the routing
above is unchanged.

Context parallelism: each rank routes its part of every sequence; f_e, P_e and the z-loss's mean
are over the whole micro-batch, so their sums are all-reduced over the context group
(``cp_group``; the backward all-reduces too, every rank's loss holding them).

Tensor parallelism (:mod:`megaformer.parallel.plan`): each expert is split like the dense FFN (W1
and W3 by output columns, W2 by input rows) and the router is replicated. The input arrives
through the column-parallel region (copy, or sequence gather); the combined routed output is a
partial sum that one all-reduce (reduce-scatter with sequence parallelism) completes. The gradient
reaching the router through the combine is then partial per rank (summed over the TP group by the
plan); that of the router losses, computed on replicated logits, is scaled by 1/tp before it joins
it, so the sum is the one-process gradient.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaformer.config import ModelConfig
from megaformer.kernels.selection import choose_for
from megaformer.model.mlp import MLP


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


_recomputing = False  # True while activation recomputation re-runs a forward in backward


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Marks a forward re-run by activation recomputation (in backward): MoE blocks do not count
    their load again. A plain flag read at trace time (no graph break under torch.compile)."""
    global _recomputing
    saved, _recomputing = _recomputing, True
    try:
        yield
    finally:
        _recomputing = saved


def expert_counts(
    flat: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """counts[e] = |{a : flat[a] = e (and keep[a])}|, int64 [num_experts]: a fixed shape, no host
    read (unlike ``bincount``, whose output length depends on the values)."""
    ones = torch.ones_like(flat) if keep is None else keep.to(flat.dtype)
    return torch.zeros(num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
        0, flat, ones
    )


def within_capacity(flat: torch.Tensor, counts: torch.Tensor, cap: int) -> torch.Tensor:
    """keep[a]: assignment a (to expert flat[a]) is among its expert's first ``cap`` in token
    order. A fixed shape, no host read."""
    order = torch.argsort(flat, stable=True)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(flat.numel(), device=flat.device) - start[flat[order]]
    return torch.empty_like(flat, dtype=torch.bool).scatter_(0, order, pos < cap)


def limit_to_groups(scores: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """``scores`` [N, E] with the experts outside each row's ``keep`` best groups set to -inf: the
    E experts form ``groups`` groups of consecutive ids, a group ranked by the sum of its two
    largest scores (DeepSeek-V3)."""
    n, E = scores.shape
    per_group = scores.view(n, groups, E // groups)
    rank = per_group.topk(2, dim=-1).values.sum(-1)  # [N, G]
    best = rank.topk(keep, dim=-1).indices
    kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
    return scores.masked_fill(~kept.repeat_interleave(E // groups, dim=1), float("-inf"))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype x's GEMMs compute in: the autocast dtype under autocast, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the experts (first weight ``w`` [E, f, d]) run on rows ``x`` as grouped GEMMs: the
    kernel table's ``experts`` rule (:mod:`megaformer.kernels.selection`)."""
    _, f, d = w.shape
    return (
        choose_for("experts", x, compute_dtype=_compute_dtype(x), d_model=d, d_ffn=f).impl
        == "grouped"
    )


class Router(nn.Linear):
    """z = x W_r^T in fp32, whatever the parameters' and the autocast dtype (called as a module,
    so a framework that gathers a module's parameters around its call, ZeRO-3, sees it)."""

    def __init__(self, d: int, n: int) -> None:
        super().__init__(d, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):  # fp32 under bf16 autocast too
            return F.linear(x.float(), self.weight.float())


class Experts(nn.Module):
    """E FFNs as stacked weights: w1 [E, f, d] (SwiGLU gate / GELU up), w3 [E, f, d] (SwiGLU up),
    w2 [E, d, f]; no biases. ``forward(x, counts)``: rows of ``x`` sorted by expert, ``counts[e]``
    rows for expert e, in that order."""

    def __init__(self, n: int, d: int, f: int, activation: str) -> None:
        super().__init__()
        if activation not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"model.activation={activation!r}: must be gelu or swiglu")
        self.activation = activation
        self.w1 = nn.Parameter(torch.empty(n, f, d))
        self.w3 = nn.Parameter(torch.empty(n, f, d)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(n, d, f))
        self.first_expert = 0  # the global id of w1[0] (expert parallelism holds a slice)
        # FP8 grouped GEMMs (megaformer.parallel.fp8.Fp8Experts), set from outside
        self.fp8: Optional[Any] = None

    def _act(self, h1: torch.Tensor, h3: Optional[torch.Tensor]) -> torch.Tensor:
        if h3 is not None:
            return F.silu(h1) * h3
        return F.gelu(h1, approximate="tanh" if self.activation == "gelu_tanh" else "none")

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.grouped_fp8(x, counts)
        if _grouped_mm_ok(x, self.w1):
            return self.grouped(x, counts, _compute_dtype(x))
        return self.loop(x, counts)

    def grouped(
        self, x: torch.Tensor, counts: torch.Tensor, dtype: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        """One grouped GEMM per matrix over all experts, in ``dtype`` (default x's: under autocast
        the autocast dtype, operands cast here); no host synchronisation."""
        dtype = dtype or x.dtype
        x = x.to(dtype)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        w1, w2 = self.w1.to(dtype), self.w2.to(dtype)
        h1 = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
        h3 = (
            torch._grouped_mm(x, self.w3.to(dtype).transpose(1, 2), offs=offs)
            if self.w3 is not None
            else None
        )
        return torch._grouped_mm(self._act(h1, h3), w2.transpose(1, 2), offs=offs)

    def grouped_fp8(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same grouped GEMMs on FP8 operands (``self.fp8``): x cast once for W1 and W3."""
        x = x.to(_compute_dtype(x))
        first = [w for w in (self.w1, self.w3) if w is not None]
        h = self.fp8.grouped(x, first, counts)
        h1, h3 = h if len(h) == 2 else (h[0], None)
        return self.fp8.grouped(self._act(h1, h3), [self.w2], counts, second=True)[0]

    def loop(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """A loop over experts, each on its block of rows (the counts read on the host once)."""
        outs = []
        # every expert runs, also on zero rows, so each has a gradient (zeros) every step
        for e, xe in enumerate(x.split(counts.tolist())):
            h3 = xe @ self.w3[e].t() if self.w3 is not None else None
            outs.append(self._act(xe @ self.w1[e].t(), h3) @ self.w2[e].t())
        return torch.cat(outs)

    def extra_repr(self) -> str:
        n, f, d = getattr(self.w1, "ds_shape", self.w1.shape)  # (ZeRO-3: the whole shape)
        held = (
            f" (ids {self.first_expert}..{self.first_expert + n - 1})" if self.first_expert else ""
        )
        return f"experts={n}{held}, d_model={d}, d_ffn={f}, activation={self.activation}"


class MoE(nn.Module):
    """The MoE FFN of block ``layer``: router -> top-k -> dispatch -> experts -> weighted combine
    (+ shared experts). Same call as :class:`megaformer.model.mlp.MLP`: [B, T, d] -> [B, T, d].

    After a training forward, ``aux_loss`` holds this block's weighted router losses (taken by
    the Transformer's loss); the step's load, dropped assignments and loss values accumulate in
    the ``step_*`` buffers until :func:`end_of_step`."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        m = cfg.moe
        self.layer = layer
        self.num_experts, self.top_k = m.num_experts, m.top_k
        self.score, self.renormalize = m.score, m.renormalize
        self.num_groups = m.num_groups
        self.top_groups = m.top_groups if m.top_groups is not None else m.num_groups
        self.routed_scale = m.routed_scaling_factor
        self.capacity_factor = None if m.dropless else m.capacity_factor
        self.aux_coef, self.z_coef, self.bias_rate = (
            m.aux_loss_coef,
            m.z_loss_coef,
            m.bias_update_rate,
        )
        self.router = Router(cfg.d_model, m.num_experts)
        self.experts = Experts(m.num_experts, cfg.d_model, cfg.expert_dim, cfg.activation)
        self.shared = MLP(cfg, d_ffn=cfg.shared_dim, bias=False) if cfg.shared_dim > 0 else None
        self.shared_gate = (
            nn.Linear(cfg.d_model, 1, bias=False)
            if self.shared is not None and m.shared_gate
            else None
        )
        # not parameters: the bias moves by its own rule, not by the optimizer; checkpoints carry
        # it (megaformer.checkpoint.router_state)
        self.register_buffer("expert_bias", torch.zeros(m.num_experts), persistent=False)
        self.register_buffer(
            "step_load", torch.zeros(m.num_experts, dtype=torch.long), persistent=False
        )
        # dropped assignments, sum of aux, sum of z, forwards (this step, this rank)
        self.register_buffer("step_sums", torch.zeros(4, dtype=torch.float64), persistent=False)
        self.aux_loss: Optional[torch.Tensor] = None
        self.tp_group: Any = None  # set by the tensor-parallel plan
        self.tp_size, self.sequence_parallel = 1, False
        # expert parallelism: (rows sorted by global expert, counts [E], local experts) -> their
        # outputs, the rows sent to the experts' ranks and back (megaformer.parallel.experts)
        self.expert_dispatch: Any = None
        self.ep_group: Any = None
        self.ep_size = 1
        # context parallelism: each rank routes part of every sequence; the router losses'
        # statistics are summed over this group (megaformer.parallel.experts.configure_routing)
        self.cp_group: Any = None
        self.cp_size = 1

    def _apply(self, fn: Any, recurse: bool = True) -> "MoE":
        # A cast of the module (bf16 training) leaves the bias fp32 and the counters float64:
        # an update of rate 1e-3 is below bf16's spacing once |b_e| >= 0.5.
        super()._apply(fn, recurse)
        self.expert_bias = self.expert_bias.float()
        self.step_sums = self.step_sums.double()
        return self

    @torch.no_grad()
    def reset_state(self) -> None:
        """Zero the aux-loss-free bias and the step's counters (buffers made on the meta device
        hold no values until this runs)."""
        for t in (self.expert_bias, self.step_load, self.step_sums):
            t.zero_()

    # ------------------------------------------------------------------ routing

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [N, E] fp32, selected experts [N, k], their weights [N, k] fp32) of x [N, d]."""
        logits = self.router(x)
        scores = torch.softmax(logits, -1) if self.score == "softmax" else torch.sigmoid(logits)
        with torch.no_grad():
            # b: zero unless trained (bias_update_rate) or imported with the weights
            chooser = scores + self.expert_bias.float()
            if self.top_groups < self.num_groups:
                chooser = limit_to_groups(chooser, self.num_groups, self.top_groups)
            idx = chooser.topk(self.top_k, dim=-1).indices
        gates = scores.gather(1, idx)
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.routed_scale != 1.0:
            gates = gates * self.routed_scale
        return logits, idx, gates

    def router_losses(
        self, logits: torch.Tensor, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(load-balancing loss E sum_e f_e P_e, z-loss mean_n logsumexp(z_n)^2), unweighted."""
        if self.tp_size > 1:  # replicated logits: each rank's share of the gradient is 1/tp
            logits = _ScaleGrad.apply(logits, 1.0 / self.tp_size)
        n, E = logits.shape
        if self.score == "softmax":
            probs = torch.softmax(logits, -1)
        else:
            s = torch.sigmoid(logits)
            probs = s / s.sum(-1, keepdim=True)
        lse2 = torch.logsumexp(logits, -1).square()
        if self.cp_group is None:
            p_mean, z = probs.mean(0), lse2.mean()
        else:  # sums over the whole sequences, every rank's loss taking them (all-reduce both ways)
            from megaformer.comm import sum_over_group

            whole = sum_over_group(
                torch.cat([probs.sum(0), lse2.sum().view(1), counts.to(probs.dtype)]), self.cp_group
            )
            n = n * self.cp_size
            p_mean, z, counts = whole[:E] / n, whole[E] / n, whole[E + 1 :]
        f = counts.to(probs.dtype) / (n * self.top_k)
        aux = E * (f * p_mean).sum()
        return aux, z

    # ------------------------------------------------------------------ forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        n, k, E = x2.shape[0], self.top_k, self.num_experts
        logits, idx, gates = self.route(x2)
        flat = idx.reshape(-1)  # assignment a = n k + j
        counts = expert_counts(flat, E)
        keep, cap = None, None
        if self.capacity_factor is not None:
            cap = math.ceil(self.capacity_factor * n * k / E)
            keep = within_capacity(flat, counts, cap)
        kept = counts if keep is None else expert_counts(flat, E, keep)

        def shared() -> torch.Tensor:
            return self._gated(x, self.shared(x))

        if self.expert_dispatch is not None:  # expert parallelism: the shared experts overlap it
            x3 = x if x.dim() == 3 else x.unsqueeze(0)
            overlap = shared if self.shared is not None else None
            out, shared_out = self.expert_dispatch.block(self, x3, idx, gates, keep, cap, overlap)
            out = out if x.dim() == 3 else out.squeeze(0)
        else:
            order = torch.argsort(flat, stable=True)  # sorted by expert, then token
            if keep is not None:
                order = order[keep[order]]
            token = order // k
            y = self.experts(x2[token], kept)
            # y_n = sum_j g_nj FFN_ej(x_n): the k terms accumulate in fp32, one cast at the end
            w = gates.reshape(-1)[order].unsqueeze(1).float()
            out = (
                x2.new_zeros(x2.shape, dtype=torch.float32)
                .index_add(0, token, y.float() * w)
                .to(y.dtype)
                .view(shape)
            )
            if self.tp_group is not None:
                from megaformer.comm import reduce_from_tp, reduce_scatter_to_seq

                out = (
                    reduce_scatter_to_seq(out, self.tp_group)
                    if self.sequence_parallel
                    else reduce_from_tp(out, self.tp_group)
                )
            shared_out = shared() if self.shared is not None else None
        if shared_out is not None:
            out = out + shared_out

        # a training forward counts the load once: not again when activation recomputation
        # re-runs the block in backward (which must save exactly what the first run saved: the
        # router losses are built with autograd only when they enter the loss)
        record = self.training and torch.is_grad_enabled() and not _recomputing
        in_loss = self.training and (self.aux_coef > 0 or self.z_coef > 0)
        self.aux_loss = None
        if in_loss:
            aux, z = self.router_losses(logits, counts)
            self.aux_loss = self.aux_coef * aux + self.z_coef * z
        elif record:
            with torch.no_grad():
                aux, z = self.router_losses(logits, counts)
        if record:
            with torch.no_grad():
                self.step_load += counts
                self.step_sums += torch.stack(
                    [
                        (counts - kept).sum().double(),
                        aux.detach().double(),
                        z.detach().double(),
                        torch.ones((), dtype=torch.float64, device=x.device),
                    ]
                )
        return out

    def _gated(self, x: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """sigmoid(x w_g) * shared (``shared`` as is without the gate). Under TP the gate logits
        are replicated: each rank's gradient share is 1/tp (w_g's gradient summed over the group
        by the plan); under SP this rank's positions of them are kept."""
        if self.shared_gate is None:
            return shared
        z = self.shared_gate(x)
        if self.tp_size > 1:
            from megaformer.comm import scatter_seq

            z = _ScaleGrad.apply(z, 1.0 / self.tp_size)
            if self.sequence_parallel:
                z = scatter_seq(z, self.tp_group)
        return torch.sigmoid(z) * shared

    def extra_repr(self) -> str:
        cap = (
            "dropless"
            if self.capacity_factor is None
            else f"capacity_factor={self.capacity_factor}"
        )
        groups = (
            f", groups={self.top_groups} of {self.num_groups}"
            if self.top_groups < self.num_groups
            else ""
        )
        return f"layer={self.layer}, top_k={self.top_k}, score={self.score}{groups}, {cap}"


# ---------------------------------------------------------------------- the model's MoE blocks


def moe_layers(module: nn.Module) -> list[MoE]:
    """The MoE FFNs in ``module`` (this rank's pipeline stage when ``module`` is the pipeline)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def take_router_losses(module: nn.Module) -> Optional[torch.Tensor]:
    """Sum of the weighted router losses of the last training forward (None: there are none);
    each block's is taken once."""
    total = None
    for m in moe_layers(module):
        if m.aux_loss is not None:
            total = m.aux_loss if total is None else total + m.aux_loss
            m.aux_loss = None
    return total


@torch.no_grad()
def end_of_step(module: nn.Module, group: Any = None, update_bias: bool = True) -> dict[str, float]:
    """Collective over ``group`` (the data-parallel group; None: this process alone), once per
    optimizer step: sum every MoE block's step load over the group, nudge the aux-loss-free
    biases (``update_bias``: the step was applied) and reset the step's counters.

    Returns the step's metrics: ``moe/aux_loss`` and ``moe/z_loss`` (unweighted, mean over blocks
    and micro-batches), ``moe/dropped`` (assignments dropped by the capacity), and per block i
    ``moe/load_min/i``, ``moe/load_max/i`` (tokens routed to the least and most loaded expert),
    ``moe/load_cv/i`` (std / mean of the per-expert load)."""
    import torch.distributed as dist

    layers = moe_layers(module)
    if not layers:
        return {}
    load = torch.stack([m.step_load for m in layers]).double()
    sums = torch.stack([m.step_sums for m in layers])
    both = torch.cat([load, sums], dim=1)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(both, group=group)
    E = load.shape[1]
    load, sums = both[:, :E], both[:, E:]
    out: dict[str, float] = {}
    forwards = sums[:, 3].clamp(min=1)
    out["moe/aux_loss"] = float((sums[:, 1] / forwards).mean())
    out["moe/z_loss"] = float((sums[:, 2] / forwards).mean())
    out["moe/dropped"] = float(sums[:, 0].sum())
    for m, row in zip(layers, load):
        mean = row.mean()
        out[f"moe/load_min/{m.layer}"] = float(row.min())
        out[f"moe/load_max/{m.layer}"] = float(row.max())
        out[f"moe/load_cv/{m.layer}"] = float(row.std(unbiased=False) / mean) if mean > 0 else 0.0
        if update_bias and m.bias_rate > 0 and mean > 0:
            delta = m.bias_rate * torch.sign(mean - row)
            m.expert_bias.copy_((m.expert_bias.double() + delta).to(m.expert_bias.dtype))
        m.step_load.zero_()
        m.step_sums.zero_()
    return out
