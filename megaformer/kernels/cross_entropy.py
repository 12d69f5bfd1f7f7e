"""Cross-entropy fused with the output projection, over chunks of tokens (never the full logits).

For final hidden states H [N, d], output weight W [V, d] (this rank's vocabulary slice
[v0, v0 + V/p) under tensor parallelism) and labels y:

    z_t      = W h_t                                       logits of token t (one chunk of t at a time)
    m_t      = max_v z_tv                                  (max over all ranks)
    lse_t    = m_t + log sum_v exp(z_tv - m_t)             (sum over all ranks)
    loss_t   = lse_t - z_t,y_t                             (the target logit lives on one rank)
    dz_t     = (softmax(z_t) - onehot(y_t)) * dloss_t
    dH_t     = dz_t W,    dW = sum_t dz_t^T h_t

The plain path materialises z for all N tokens in fp32 ([N, V] floats, e.g. 8 x 4096 x 128k x 4 B =
16 GiB) and keeps softmax(z) for backward. Here only one chunk of ``chunk_tokens`` rows of z exists
at a time. Because the loss is the last operation, dL/dz of each chunk is known in forward (up to the
scalar dL/dloss): forward computes dH and dW chunk by chunk while the chunk's logits are at hand,
and backward only scales them -- the same 6 N d V matmul FLOPs as the plain path, no recomputation.
(Without autograd -- evaluation -- only the 2 N d V of the logits run.) Under tensor parallelism each
chunk needs three all-reduces of [chunk] floats (max, sum of exponentials, target logit), as
:func:`megaformer.parallel.layers.vocab_parallel_cross_entropy` does for the whole batch.
Columns at global ids >= ``vocab_size`` (vocabulary padding) are excluded from the softmax.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaformer.comm import ProcessGroup, all_reduce
from megaformer.kernels import native
from megaformer.kernels.gemm import mm_nt
from megaformer.kernels.selection import choose_for


def _reduce(x: torch.Tensor, group: Optional[ProcessGroup], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce over the tensor-parallel group; nothing when there is none (TP = 1)."""
    return x if group is None else all_reduce(x, group, op=op)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when it is on (as nn.Linear would run), else the input's."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum_t keep_t (lse_t - z_t,y_t) with z = H W^T computed ``chunk`` rows at a time; dH, dW of
    that sum are computed in forward (see the module docstring) and scaled in backward."""

    @staticmethod
    def forward(
        ctx,
        h,
        w,
        labels,
        keep,
        vocab_start: int,
        vocab_size: Optional[int],  # type: ignore[override]
        group: Optional[ProcessGroup],
        chunk: int,
    ):
        cd = _compute_dtype(h)
        n_local = w.shape[0]
        real = n_local if vocab_size is None else max(0, min(n_local, vocab_size - vocab_start))
        local = labels - vocab_start
        inside = (local >= 0) & (local < n_local)
        local = local.masked_fill(~inside, 0)
        grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if grads else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if grads else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        wc = w.to(cd)
        for s in range(0, h.shape[0], chunk):
            e = s + chunk
            hc = h[s:e].to(cd)
            z = _chunk_logits(hc, wc, real)
            m = _reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            sum_exp = _reduce((z - m.unsqueeze(-1)).exp_().sum(dim=-1), group)
            target = z.gather(-1, local[s:e].unsqueeze(-1)).squeeze(-1)
            target = _reduce(target.masked_fill(~inside[s:e], 0.0), group)
            lse = m + sum_exp.log()
            total += ((lse - target) * keep[s:e]).sum()
            if grads:  # dloss/dz = (softmax(z) - onehot(y)) for kept tokens, in place of z
                p = z.sub_(lse.unsqueeze(-1)).exp_()
                p.scatter_add_(-1, local[s:e].unsqueeze(-1), -inside[s:e].to(p.dtype).unsqueeze(-1))
                pc = p.mul_(keep[s:e].to(p.dtype).unsqueeze(-1)).to(cd)
                if dh.dtype == cd:
                    torch.matmul(pc, wc, out=dh[s:e])
                else:
                    dh[s:e] = (pc @ wc).to(h.dtype)
                if cd == torch.float32:
                    dw.addmm_(pc.t(), hc)
                else:
                    dw += (pc.t() @ hc).float()
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w.dtype
        return total

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        dh, dw = ctx.saved_tensors
        return (
            dh * grad.to(dh.dtype),
            (dw * grad).to(ctx.w_dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, real: int) -> torch.Tensor:
    """fp32 logits of one chunk, padding columns (index >= real) at -inf."""
    z = mm_nt(h, w).float()
    if real < z.shape[-1]:
        z[:, real:] = float("-inf")
    return z


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    *,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    group: Optional[ProcessGroup] = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean cross-entropy over labels != ignore_index of logits hidden @ weight^T, chunk by chunk.

    hidden [..., d]; weight [V_local, d] holding global vocabulary rows [vocab_start, vocab_start + V_local)
    (the whole table when ``group`` is None); labels [...] global ids. Under tensor parallelism the
    caller passes ``hidden`` through the column-parallel input op (identity forward, all-reduce of the
    gradient backward), as for the lm_head it replaces.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    choose_for("cross_entropy", hidden, chunked=True)  # recorded for track()
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    keep = y != ignore_index
    total = _ChunkedLinearCrossEntropy.apply(
        h, weight, y.masked_fill(~keep, 0), keep, vocab_start, vocab_size, group, chunk_tokens
    )
    return total / keep.sum().clamp(min=1)


class _NativeCrossEntropy(torch.autograd.Function):
    """Mean over labels != ignore_index of lse_t - z_t,y_t on fp32 CPU logits [..., Vp] whose first
    ``vocab`` columns are the vocabulary: one native pass over z forward (max, sum of exponentials)
    and one backward writing dz = (softmax(z) - onehot(y)) / n with zeros in the padding columns
    (:mod:`megaformer.kernels.native`). The plain path slices the padding off, runs log_softmax
    (a [N, V] copy kept for backward), then in backward fills and scatters the nll gradient, runs
    log_softmax's backward and copies the result into a zeroed [N, Vp] buffer: about eight passes
    over the logits instead of three. Saves the logits and one lse per row."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab: int,  # type: ignore[override]
        ignore_index: int,
    ) -> torch.Tensor:
        flat = labels.reshape(-1)
        counted = flat != ignore_index
        bad = counted & ((flat < 0) | (flat >= vocab))
        if bool(bad.any()):
            raise IndexError(
                f"cross-entropy target {int(flat[bad][0])} is out of bounds (vocabulary of {vocab})"
            )
        loss, lse = native.cross_entropy_forward(logits, flat, vocab, ignore_index)
        ctx.n = int(counted.sum())
        ctx.vocab, ctx.ignore_index = vocab, ignore_index
        ctx.save_for_backward(logits, flat, lse)
        return loss.sum() / ctx.n if ctx.n else loss.sum() * float("nan")

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        logits, flat, lse = ctx.saved_tensors
        scale = float(g) / ctx.n if ctx.n else 0.0
        dz = native.cross_entropy_backward(logits, flat, lse, ctx.vocab, ctx.ignore_index, scale)
        return dz.view(logits.shape), None, None, None


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, ignore_index: int = -100
) -> torch.Tensor:
    """Mean cross-entropy (fp32) over labels != ignore_index of logits [..., Vp] whose first
    ``vocab_size`` columns are the vocabulary (the rest: padding, excluded from the softmax)."""
    if choose_for("cross_entropy", logits).impl == "native":
        return native_cross_entropy(logits, labels, vocab_size, ignore_index)
    z = logits[..., :vocab_size]
    return F.cross_entropy(z.float().flatten(0, -2), labels.flatten(), ignore_index=ignore_index)


def native_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab: int, ignore_index: int
) -> torch.Tensor:
    """F.cross_entropy(logits[..., :vocab].flatten(0, -2), labels.flatten(), ignore_index) in native
    passes over fp32 CPU logits (the ``native`` implementation of :func:`cross_entropy`)."""
    return _NativeCrossEntropy.apply(logits, labels, vocab, ignore_index)
