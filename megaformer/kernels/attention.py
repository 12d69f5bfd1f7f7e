"""Scaled dot-product attention with one interface and three implementations.

    Attention(Q, K, V) = softmax(Q K^T * scale + M) V,   scale = 1 / sqrt(d_k) by default,

with q, k of shape [B, H, T, D], [B, Hkv, S, D] and v of shape [B, Hkv, S, Dv] (Dv = D but for
multi-head latent attention), H a multiple of Hkv (grouped-query
attention: query head i reads key/value head i // (H / Hkv); Hkv = 1 is multi-query attention).
When T < S the queries are the *last* T positions of the S keys (decoding with a KV cache), so the
causal mask M is aligned bottom-right: query i (absolute position S - T + i) sees keys j <= S - T + i.
With a sliding window W (``window``, Mistral) it sees only the W most recent of those keys,
S - T + i - W < j <= S - T + i: flash-attn's ``window_size=(W - 1, 0)``, a banded mask elsewhere.

Paths:
  * ``flash``     -- FlashAttention (CUDA, fp16/bf16; GQA and bottom-right causal native), the first
                     installed of: FA3's ``flash_attn_interface`` (Hopper only), FA2's
                     ``flash_attn.flash_attn_func``, the ``flash-attn-4`` CuTe kernels (``flash_attn.cute``)
  * ``sdpa``      -- ``torch.nn.functional.scaled_dot_product_attention``; torch picks its backend
                     (its own guards know which cuDNN versions are safe for which masks);
                     ``MEGAFORMER_SDPA_BACKENDS=cudnn,flash,efficient,math`` (any subset, in order)
                     sets a priority instead
  * ``native``    -- megaformer's native CPU FlashAttention-2 kernel (fp32, no dropout, document
                     mask or sliding window; :mod:`megaformer.kernels.native`)
  * ``reference`` -- the formula above written out, in fp32
  * ``auto``      -- flash when usable, else native on fp32 CPU, else sdpa
                     (the rule: op ``attention`` of :mod:`megaformer.kernels.selection`)

Document masking (packed sequences): with ``doc_ids`` [B, T] (the document index of each position),
M also hides keys of other documents, so query i sees keys j <= i with doc(j) = doc(i): flash-attn's
varlen kernel over the documents (cu_seqlens) on the flash path, a block-diagonal causal mask else.
:class:`DocumentMask` computes either form once per forward, outside the blocks, so no layer
syncs with the host or builds a [B, 1, T, T] mask of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from typing import Optional, Union

import torch
import torch.nn.functional as F

from megaformer.errors import ConfigError
from megaformer.kernels import capabilities, native
from megaformer.kernels.dropout import dropout
from megaformer.kernels.selection import choose, choose_for


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects 4-d tensors [B, H, T, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if k.shape[:3] != v.shape[:3] or Bk != B or Dk != D:
        raise ValueError(
            f"attention shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if H % Hkv != 0:
        raise ValueError(f"attention: query heads {H} not a multiple of key/value heads {Hkv}")
    if T > S:
        raise ValueError(
            f"attention: {T} queries but only {S} keys (queries must be the last T positions)"
        )
    return H // Hkv, S - T


def causal_mask(
    T: int, S: int, device: torch.device | str | None = None, window: Optional[int] = None
) -> torch.Tensor:
    """Boolean [T, S] mask, True where query i may attend key j: j <= i + (S - T) (bottom-right
    aligned), and with a sliding ``window`` W also j > i + (S - T) - W."""
    mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)
    if window is not None and window < S:
        mask = mask.triu(diagonal=S - T - window + 1)
    return mask


def windowed(window: Optional[int], S: int) -> Optional[int]:
    """The sliding window where it hides keys of a sequence of S keys (W < S), else None."""
    return window if window is not None and window < S else None


def share_kv_heads(t: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Key/value heads [B, Hkv, S, D] repeated to [B, H, S, D] (query head i reads i // (H / Hkv))."""
    groups = query_heads // t.shape[1]
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """The attention logits Q K^T * scale + M in fp32, [B, H, T, S]; masked entries are -inf."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q.float() @ share_kv_heads(k.float(), q.shape[1]).transpose(-2, -1)) * scale
    if causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device, window)
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def document_ids(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """doc[b, t] = number of EOD tokens in input_ids[b, :t] (an EOD ends, and belongs to, its document)."""
    eod = (input_ids == eod_id).to(torch.int32)
    return eod.cumsum(dim=-1, dtype=torch.int32) - eod


def document_causal_mask(doc_ids: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """Boolean [B, 1, T, T]: True where query i may attend key j (j <= i, same document, and
    i - j < window when a sliding window is set)."""
    T = doc_ids.shape[-1]
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    return (same & causal_mask(T, T, doc_ids.device, window)).unsqueeze(1)


@dataclasses.dataclass
class DocumentMask:
    """The document boundaries of a packed batch, in the form the attention implementation needs,
    computed once per forward: ``cu_seqlens`` (int32 offsets of every document of every row,
    flattened) and the longest document for flash-attn's varlen kernel, or the dense boolean
    [B, 1, T, T] mask for SDPA and the reference."""

    doc_ids: torch.Tensor
    cu_seqlens: Optional[torch.Tensor] = None
    longest: Optional[int] = None
    dense: Optional[torch.Tensor] = None
    window: Optional[int] = None  # the sliding window the dense form includes

    @classmethod
    def build(
        cls, doc_ids: torch.Tensor, impl: str, window: Optional[int] = None
    ) -> "DocumentMask":
        """Precompute the form ``impl`` ("flash", "sdpa", "reference") reads."""
        mask = cls(doc_ids, window=window)
        if impl == "flash":
            mask.cu_seqlens, mask.longest = cu_seqlens(doc_ids)
        else:
            mask.dense = document_causal_mask(doc_ids, window)
        return mask

    def dense_mask(self) -> torch.Tensor:
        if self.dense is None:  # a fallback path (e.g. dropout with a flash package without it)
            self.dense = document_causal_mask(self.doc_ids, self.window)
        return self.dense

    def varlen(self) -> tuple[torch.Tensor, int]:
        if self.cu_seqlens is None:
            self.cu_seqlens, self.longest = cu_seqlens(self.doc_ids)
        return self.cu_seqlens, int(self.longest)


def document_mask(
    input_ids: torch.Tensor,
    eod_id: int,
    *,
    backend: str,
    head_dim: int,
    dtype: torch.dtype,
    window: Optional[int] = None,
) -> DocumentMask:
    """The :class:`DocumentMask` of a batch of token ids for attention on tensors of ``dtype``
    (with a sliding ``window``: the dense form includes it)."""
    window = windowed(window, input_ids.shape[-1])
    impl = choose(
        "attention",
        input_ids.device,
        dtype,
        backend=backend,
        head_dim=head_dim,
        dropout=False,
        doc_mask=True,
        window=window is not None,
    ).impl
    return DocumentMask.build(document_ids(input_ids, eod_id), impl, window)


DocIds = Union[torch.Tensor, DocumentMask, None]


def _as_mask(doc_ids: DocIds, impl: str, window: Optional[int]) -> Optional[DocumentMask]:
    if doc_ids is None or isinstance(doc_ids, DocumentMask):
        return doc_ids
    return DocumentMask.build(doc_ids, impl, window)


def _mask_for(
    q, k, causal: bool, doc: Optional[DocumentMask], window: Optional[int] = None
) -> Optional[torch.Tensor]:
    """The explicit boolean mask (broadcastable to [B, H, T, S]) or None for 'no mask / is_causal'."""
    if doc is not None:
        return doc.dense_mask()
    T, S = q.shape[2], k.shape[2]
    if causal and window is not None:  # a band (windowed() left only windows that hide keys)
        return causal_mask(T, S, q.device, window)
    if causal and T < S and T > 1:  # T == 1 (one new token) sees every key: no mask needed
        return causal_mask(T, S, q.device)
    return None


def _reference(
    q,
    k,
    v,
    causal: bool,
    dropout_p: float,
    scale: float,
    doc: Optional[DocumentMask] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V written out, in fp32 (M: causal, or causal within documents;
    banded with a sliding window)."""
    vf = share_kv_heads(v.float(), q.shape[1])
    if doc is None:
        scores = attention_scores(q, k, causal, scale, window)
    else:
        scores = attention_scores(q, k, False, scale).masked_fill(~doc.dense_mask(), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return (probs @ vf).to(q.dtype)


_SDPA_NAMES = {
    "cudnn": "CUDNN_ATTENTION",
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_priority() -> Optional[list]:
    """The SDPA backends named by ``MEGAFORMER_SDPA_BACKENDS`` (comma-separated, in priority
    order), or None: torch chooses (its guards know e.g. which cuDNN versions handle which masks)."""
    text = os.environ.get("MEGAFORMER_SDPA_BACKENDS", "").strip()
    if not text:
        return None
    from torch.nn.attention import SDPBackend

    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in _SDPA_NAMES]
    if unknown:
        raise ConfigError(
            f"MEGAFORMER_SDPA_BACKENDS={text!r}: unknown backend {unknown[0]!r} "
            f"(choose from {', '.join(_SDPA_NAMES)})"
        )
    return [getattr(SDPBackend, _SDPA_NAMES[n]) for n in names]


class SoftmaxDropoutFunction(torch.autograd.Function):
    """Pd = dropout(softmax(S + M_causal)) in one native pass; saves P and the byte mask (what
    softmax and dropout save between them), backward in one pass (:mod:`megaformer.kernels.native`)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, causal: bool, p: float) -> torch.Tensor:  # type: ignore[override]
        probs, dropped, m, ctx.scale = native.softmax_dropout_forward(scores, causal, p)
        ctx.save_for_backward(probs, m)
        return dropped

    @staticmethod
    def backward(ctx, d_dropped: torch.Tensor):  # type: ignore[override]
        probs, m = ctx.saved_tensors
        return native.softmax_dropout_backward(probs, m, d_dropped, ctx.scale), None, None


class NativeFlashAttention(torch.autograd.Function):
    """softmax(scale Q K^T + M_causal) V on fp32 CPU by megaformer's native FlashAttention-2 kernel
    (:mod:`megaformer.kernels.native`); saves q, k, v, O and lse as SDPA's flash kernel does. O is
    [B, T, H, D] in memory, so the output projection reads it without a transpose copy."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,  # type: ignore[override]
        scale: float,
    ) -> torch.Tensor:
        o, lse = native.flash_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o.transpose(1, 2)

    @staticmethod
    def backward(ctx, do: torch.Tensor):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = native.flash_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def _cpu_dropout_attention(
    q, k, v, causal: bool, dropout_p: float, scale: float, mask: Optional[torch.Tensor]
) -> torch.Tensor:
    """softmax((Q scale) K^T + M) with dropout, times V, on CPU: what torch's SDPA runs there when
    dropout_p > 0 (its math path), with megaformer's int16 dropout (one-byte mask instead of
    the float Bernoulli draw; :mod:`megaformer.kernels.dropout`), or where the native CPU kernels load
    and no explicit mask is needed, softmax, causal mask and dropout in one pass each way."""
    k, v = share_kv_heads(k, q.shape[1]), share_kv_heads(v, q.shape[1])
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if mask is None and choose_for("dropout", scores).impl == "native":
        return torch.matmul(SoftmaxDropoutFunction.apply(scores, causal, dropout_p), v)
    if mask is None and causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p)
    return torch.matmul(probs, v)


def _sdpa(
    q,
    k,
    v,
    causal: bool,
    dropout_p: float,
    scale: float,
    doc: Optional[DocumentMask] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """torch SDPA; its is_causal is top-left aligned, so T < S gets an explicit bottom-right mask
    (as does a sliding window: a banded one).
    On CPU with dropout: :func:`_cpu_dropout_attention` (the same math, a faster dropout)."""
    mask = _mask_for(q, k, causal, doc, window)
    if dropout_p > 0 and q.device.type == "cpu" and choose_for("dropout", q).impl != "torch":
        return _cpu_dropout_attention(q, k, v, causal, dropout_p, scale, mask)
    is_causal = causal and mask is None and q.shape[2] == k.shape[2]
    groups = q.shape[1] // k.shape[1]
    extra = {}
    if groups > 1 and _sdpa_has_gqa():
        extra["enable_gqa"] = True
    elif groups > 1:  # torch < 2.5
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    context = contextlib.nullcontext()
    priority = sdpa_priority() if q.is_cuda else None
    if priority is not None:
        from torch.nn.attention import sdpa_kernel

        context = sdpa_kernel(priority, set_priority=True)
    with context:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
        )


def _sdpa_has_gqa() -> bool:
    """torch >= 2.5 shares key/value heads inside SDPA (``enable_gqa``)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def _first(out):
    """FA3 / flash-attn-4 may return (out, softmax_lse); FA2 returns out."""
    return out[0] if isinstance(out, tuple) else out


def cu_seqlens(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Boundaries of the documents of every row, flattened: (int32 [n_docs + 1] offsets, longest).

    A new segment starts at each row start and wherever doc_ids changes."""
    B, T = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    idx = starts.flatten().nonzero().flatten().to(torch.int32)
    bounds = torch.cat([idx, idx.new_tensor([B * T])])
    return bounds, int((bounds[1:] - bounds[:-1]).max())


def _flash(
    q,
    k,
    v,
    causal: bool,
    dropout_p: float,
    scale: float,
    doc: Optional[DocumentMask] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """FlashAttention works in [B, T, H, D]; GQA and bottom-right causal alignment are native, a
    sliding window W is ``window_size=(W - 1, 0)``.
    With a document mask, the varlen kernel runs over the documents of all rows as one ragged batch."""
    impl = capabilities.resolved_flash()  # a plain read: no import or signature in a graph
    windows = impl.func_window if doc is None else impl.varlen_window
    if (
        (dropout_p > 0 and not impl.dropout)
        or (doc is not None and impl.varlen is None)
        or (window is not None and not windows)
    ):
        return _sdpa(q, k, v, causal, dropout_p, scale, doc, window)
    drop = {"dropout_p": dropout_p} if impl.dropout else {}
    if window is not None:
        drop["window_size"] = (window - 1, 0)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if doc is None:
        return _first(impl.func(qt, kt, vt, softmax_scale=scale, causal=causal, **drop)).transpose(
            1, 2
        )
    B, T = doc.doc_ids.shape
    cu, longest = doc.varlen()
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (qt, kt, vt)]
    out = _first(
        impl.varlen(
            *flat,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scale,
            causal=True,
            **drop,
        )
    )
    return out.reshape(B, T, *out.shape[1:]).transpose(1, 2)


def _native(
    q,
    k,
    v,
    causal: bool,
    dropout_p: float,
    scale: float,
    doc: Optional[DocumentMask] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    return NativeFlashAttention.apply(q, k, v, causal, scale)  # chosen only without a window


_IMPLS = {"reference": _reference, "sdpa": _sdpa, "flash": _flash, "native": _native}
# the kernels whose value heads must be as wide as the query/key heads (the others take any width)
_SAME_HEAD_DIMS = ("flash", "native")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    dropout_p: float = 0.0,
    backend: str = "auto",
    scale: Optional[float] = None,
    doc_ids: DocIds = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V for q [B, H, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] ->
    [B, H, T, Dv]. Dv != D (multi-head latent attention) runs as is on sdpa and reference; flash
    and native pad the narrower side with zero columns and drop them from the output.

    ``dropout_p`` is applied as given (pass 0 in eval mode). ``scale`` defaults to 1/sqrt(D).
    ``doc_ids`` (causal, T == S only): a :class:`DocumentMask`, or the [B, T] document index of
    each position; keys of other documents are masked too. ``window`` (causal only): each query
    sees its ``window`` most recent keys, itself included. ``backend``: model.attention_backend.
    """
    _check_shapes(q, k, v)
    if doc_ids is not None:
        ids = doc_ids.doc_ids if isinstance(doc_ids, DocumentMask) else doc_ids
        if not causal or q.shape[2] != k.shape[2] or tuple(ids.shape) != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"attention: doc_ids {tuple(ids.shape)} need causal self-attention "
                f"with T == S and shape [B, T] = {(q.shape[0], q.shape[2])}"
            )
    if window is not None and (not causal or window < 1):
        raise ValueError(
            f"attention: a sliding window ({window}) needs causal attention and >= 1 key"
        )
    window = windowed(window, k.shape[2]) if causal else None
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    impl = choose_for(
        "attention",
        q,
        backend=backend,
        head_dim=q.shape[-1],
        dropout=dropout_p > 0,
        doc_mask=doc_ids is not None,
        window=window is not None,
    ).impl
    mask = _as_mask(doc_ids, impl, window)
    Dv = v.shape[-1]
    if Dv != q.shape[-1] and impl in _SAME_HEAD_DIMS:
        # value heads of another width (multi-head latent attention): zero columns make the
        # widths equal, and the output's extra columns (zeros) are dropped: the same values
        width = max(Dv, q.shape[-1])
        q, k = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k))
        out = _IMPLS[impl](q, k, F.pad(v, (0, width - Dv)), causal, dropout_p, scale, mask, window)
        return out[..., :Dv]
    return _IMPLS[impl](q, k, v, causal, dropout_p, scale, mask, window)
