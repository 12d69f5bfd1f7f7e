"""Attention over one block of keys with its log-sum-exp, forward and backward: the kernel that
each step of ring attention runs.

    S = Q K^T * scale + M,   lse = logsumexp_rows(S) (natural log, fp32),   O = exp(S - lse) V

with q [B, H, Tq, Dqk], k [B, Hkv, Tk, Dqk], v [B, Hkv, Tk, Dv] (H a multiple of Hkv; Dv may
differ from Dqk), O [B, H, Tq, Dv] in the inputs' dtype. The mask M is one of: none (every query
sees every key), ``causal`` (top-left aligned, Tq == Tk: a block on the diagonal), or an explicit
boolean ``mask`` [B|1, 1, Tq, Tk] (True where a query may see a key). A row that sees no key of the
block gets lse = -inf and O = 0, so merging it changes nothing.

The backward takes the *final* O and lse of the rows -- those of the whole attention, after every
block was merged -- and returns this block's share of the gradients, exactly (FlashAttention-2's
backward needs nothing else): with P = exp(S - lse) and D = rowsum(dO o O),

    dV = P^T dO,   dS = P o (dO V^T - D),   dQ = dS K * scale,   dK = dS^T Q * scale.

Implementations (the rule: op ``attention_block`` of :mod:`megaformer.kernels.selection`), all in
the inputs' dtype with fp32 accumulation inside the kernel:

  * ``cpu-flash``  -- aten's ``_scaled_dot_product_flash_attention_for_cpu`` and its backward op
                      (any float dtype; the mask as an additive bias; grouped-query heads native)
  * ``flash``      -- aten's ``_scaled_dot_product_flash_attention`` (FlashAttention-2, CUDA,
                      fp16/bf16, no explicit mask) and ``_scaled_dot_product_flash_attention_backward``
  * ``efficient``  -- aten's memory-efficient kernel, ``_efficient_attention_forward`` and
                      ``_efficient_attention_backward`` called as torch's SDPA calls them (CUDA,
                      any float dtype, the mask as an additive bias)

Unequal head dimensions (Dv != Dqk) are padded with zeros to the larger one for the kernel call
(exact: zero columns add nothing to Q K^T, zero value columns give zero outputs), the scale stays
the caller's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megaformer.kernels.selection import choose_for

_aten = torch.ops.aten


def _bias(
    mask: Optional[torch.Tensor], dtype: torch.dtype, pad_to: int = 1
) -> Optional[torch.Tensor]:
    """The boolean mask as an additive bias (0 where seen, -inf where hidden) in ``dtype``; the
    key dimension padded to a multiple of ``pad_to`` in memory (a view of the first Tk columns)."""
    if mask is None:
        return None
    tk = mask.shape[-1]
    width = -(-tk // pad_to) * pad_to
    bias = torch.zeros((*mask.shape[:-1], width), dtype=dtype, device=mask.device)
    bias[..., :tk].masked_fill_(~mask, float("-inf"))
    return bias[..., :tk]


def _pad_last(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    g = heads // t.shape[1]
    return t.repeat_interleave(g, dim=1) if g > 1 else t


def _sum_heads(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    B, H, T, D = t.shape
    return t if H == kv_heads else t.reshape(B, kv_heads, H // kv_heads, T, D).sum(2)


def _impl(q: torch.Tensor, mask: Optional[torch.Tensor]) -> str:
    return choose_for(
        "attention_block", q, head_dim=max(q.shape[-1], 1), masked=mask is not None
    ).impl


def _efficient_lse_len(t: int) -> int:
    """The memory-efficient kernel's log-sum-exp rows are padded to a multiple of 32 (on CUDA;
    ROCm's are not)."""
    return t if torch.version.hip else -(-t // 32) * 32


def _efficient_bias(mask: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor):
    """The mask as the memory-efficient kernel takes a bias: in q's dtype, rows 16-element
    aligned, expanded to [B, H, Tq, Tk] (what torch's SDPA front end hands it)."""
    bias = _bias(mask, q.dtype, 16)
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    mask: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, H, Tq, Dv] in q's dtype, lse [B, H, Tq] fp32) of one key block (module docstring)."""
    dv = v.shape[-1]
    d = max(q.shape[-1], dv)
    q, k, v = (_pad_last(t, d) for t in (q, k, v))
    impl = _impl(q, mask)
    if impl == "cpu-flash":
        o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale
        )
    elif impl == "flash":
        o, lse = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    else:  # torch's own call of it from SDPA: [B, T, H, D] views, causal top-left (mask type 1)
        h = q.shape[1]
        o, lse = _aten._efficient_attention_forward(
            q.transpose(1, 2),
            _repeat_heads(k, h).transpose(1, 2),
            _repeat_heads(v, h).transpose(1, 2),
            _efficient_bias(mask, q, k),
            None,
            None,
            None,
            None,
            0.0,
            int(causal),
            True,
            scale=scale,
        )[:2]
        o, lse = o.transpose(1, 2), lse[..., : q.shape[2]]
    if mask is not None:  # a row that sees no key of this block: lse = -inf, O = 0 (kernels differ)
        blind = ~mask.any(-1)
        lse = lse.masked_fill(blind, float("-inf"))
        o = o.masked_fill(blind.unsqueeze(-1), 0.0)
    return o[..., :dv], lse


def block_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    mask: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dQ, dK, dV) of one key block from the final O and lse of the rows (module docstring); in
    the inputs' dtype. ``do`` and ``o`` [B, H, Tq, Dv] in q's dtype, ``lse`` [B, H, Tq] fp32."""
    dqk, dv = q.shape[-1], v.shape[-1]
    d = max(dqk, dv)
    q, k, v, o, do = (_pad_last(t, d) for t in (q, k, v, o, do))
    if mask is not None:  # a row that sees no key anywhere (lse -inf): P = exp(-inf - 0) = 0
        lse = lse.masked_fill(torch.isinf(lse), 0.0)
    lse = lse.contiguous()
    impl = _impl(q, mask)
    if impl == "cpu-flash":
        dq, dk, dvv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale
        )
    elif impl == "flash":
        tq, tk = q.shape[2], k.shape[2]
        rng = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: not read
        # no cumulative sequence lengths (None): the dense kernel, not the varlen one
        dq, dk, dvv = _aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, None, None, tq, tk, 0.0, causal, rng, rng, scale=scale
        )
    else:
        hkv, h, tq, tk = k.shape[1], q.shape[1], q.shape[2], k.shape[2]
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
        dq, dk, dvv, _ = _aten._efficient_attention_backward(
            do.transpose(1, 2),
            q.transpose(1, 2),
            _repeat_heads(k, h).transpose(1, 2),
            _repeat_heads(v, h).transpose(1, 2),
            _efficient_bias(mask, q, k),
            o.transpose(1, 2),
            None,
            None,
            tq,
            tk,
            F.pad(lse, (0, _efficient_lse_len(tq) - tq)),
            0.0,
            seed,
            seed,
            int(causal),
            False,
            scale=scale,
        )
        dq, dk, dvv = (t.transpose(1, 2) for t in (dq, dk, dvv))
        dk, dvv = _sum_heads(dk, hkv), _sum_heads(dvv, hkv)
    return dq[..., :dqk], dk[..., :dqk], dvv[..., :dv]
