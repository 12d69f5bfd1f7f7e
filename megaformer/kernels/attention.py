"""Scaled dot-product attention with one interface and three implementations.

    Attention(Q, K, V) = softmax(Q K^T * scale + M) V,   scale = 1 / sqrt(d_k) by default,

with q of shape [B, H, T, D] and k, v of shape [B, Hkv, S, D], H a multiple of Hkv (grouped-query
attention: query head i reads key/value head i // (H / Hkv); Hkv = 1 is multi-query attention).
When T < S the queries are the *last* T positions of the S keys (decoding with a KV cache), so the
causal mask M is aligned bottom-right: query i (absolute position S - T + i) sees keys j <= S - T + i.

Paths:
  * ``flash``     -- FlashAttention (CUDA, fp16/bf16; GQA and bottom-right causal native), the first
                     installed of: FA3's ``flash_attn_interface`` (Hopper only), FA2's
                     ``flash_attn.flash_attn_func``, the ``flash-attn-4`` CuTe kernels (``flash_attn.cute``)
  * ``sdpa``      -- ``torch.nn.functional.scaled_dot_product_attention``; on CUDA with an explicit
                     backend priority (cuDNN first on Hopper and newer, else flash; then
                     memory-efficient, then math)
  * ``reference`` -- the formula above written out, in fp32
  * ``auto``      -- flash when usable, else sdpa

Document masking (packed sequences): with ``doc_ids`` [B, T] (the document index of each position),
M also hides keys of other documents, so query i sees keys j <= i with doc(j) = doc(i): flash-attn's
varlen kernel over the documents (cu_seqlens) on the flash path, a block-diagonal causal mask else.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import logging
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from megaformer.errors import ConfigError
from megaformer.kernels import native
from megaformer.kernels.dropout import dropout

logger = logging.getLogger("megaformer")

BACKENDS = ("auto", "flash", "sdpa", "reference")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_logged: set = set()  # (backend, reason) pairs already announced in this process


@dataclasses.dataclass(frozen=True)
class FlashImpl:
    """One FlashAttention package: its dense and varlen entry points (layout [B, T, H, D])."""
    name: str
    func: Callable
    varlen: Optional[Callable]
    dropout: bool  # whether it implements attention dropout


def _try_import(module: str) -> tuple[Optional[object], str]:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        return None, f"{module} not installed"
    try:
        return importlib.import_module(module), ""
    except Exception as e:  # a broken build (ABI mismatch, missing CUDA libs) must not kill the run
        first = (str(e).splitlines() or [""])[0]
        return None, f"{module} failed to import: {type(e).__name__}: {first}"


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@functools.lru_cache(maxsize=None)
def _flash_status() -> tuple[Optional[FlashImpl], str]:
    """(the FlashAttention implementation to use or None, why). Imported lazily, once."""
    reasons = []
    if _hopper():
        fa3, why = _try_import("flash_attn_interface")
        if fa3 is not None:
            return FlashImpl("FA3 flash_attn_interface", fa3.flash_attn_func,
                             getattr(fa3, "flash_attn_varlen_func", None), False), "FA3 on Hopper"
        reasons.append(why)
    fa2, why = _try_import("flash_attn")
    if fa2 is not None and hasattr(fa2, "flash_attn_func"):
        return FlashImpl("FA2 flash_attn", fa2.flash_attn_func,
                         getattr(fa2, "flash_attn_varlen_func", None), True), "flash-attn available"
    reasons.append(why or "flash_attn has no flash_attn_func")
    fa4, why = _try_import("flash_attn.cute")
    if fa4 is not None and hasattr(fa4, "flash_attn_func"):
        return FlashImpl("flash-attn-4 CuTe", fa4.flash_attn_func,
                         getattr(fa4, "flash_attn_varlen_func", None), False), "flash-attn-4 available"
    reasons.append(why or "flash_attn.cute has no flash_attn_func")
    return None, "; ".join(r for r in reasons if r)


def _flash_unusable(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> Optional[str]:
    """Why flash-attn cannot run these tensors, or None when it can."""
    impl, why = _flash_status()
    if impl is None:
        return why
    if device.type != "cuda":
        return f"flash-attn needs CUDA tensors, got device {device.type}"
    if dtype not in _FLASH_DTYPES:
        return f"flash-attn needs fp16/bf16 tensors, got {str(dtype).replace('torch.', '')}"
    if head_dim is not None and (head_dim > _FLASH_MAX_HEAD_DIM or head_dim % 8 != 0):
        return f"flash-attn needs head_dim <= {_FLASH_MAX_HEAD_DIM} and a multiple of 8, got {head_dim}"
    return None


def resolve_backend(requested: str, device: torch.device | str, dtype: torch.dtype,
                    head_dim: Optional[int] = None) -> tuple[str, str]:
    """The backend that will run for tensors on ``device`` with ``dtype``, and why.

    Returns ``(name, reason)`` with name in {flash, sdpa, reference}. Raises
    :class:`~megaformer.errors.ConfigError` for an unknown backend or a forced ``flash`` that cannot run.
    """
    device = torch.device(device)
    if requested not in BACKENDS:
        raise ConfigError(f"model.attention_backend={requested!r}: must be one of {', '.join(BACKENDS)}")
    if requested in ("sdpa", "reference"):
        return requested, "requested in config"
    why_not = _flash_unusable(device, dtype, head_dim)
    if requested == "flash":
        if why_not is not None:
            raise ConfigError(f"model.attention_backend=flash: {why_not}; use auto or sdpa")
        return "flash", "requested in config"
    if why_not is None:
        impl = _flash_status()[0]
        return "flash", f"{impl.name} on {device.type} {str(dtype).replace('torch.', '')}"
    return "sdpa", f"{why_not}; {_sdpa_priority_text(device)}"


_RESOLVED: dict = {}


def _resolve_cached(requested: str, device_type: str, dtype: torch.dtype,
                    head_dim: int) -> tuple[str, str]:
    """resolve_backend, once per key. :func:`mark_constant_for_compile` makes it a trace-time
    constant under torch.compile (no graph break)."""
    key = (requested, device_type, dtype, head_dim)
    if key not in _RESOLVED:
        _RESOLVED[key] = resolve_backend(requested, torch.device(device_type), dtype, head_dim)
    return _RESOLVED[key]


def mark_constant_for_compile() -> None:
    """Tell torch.compile that the backend resolution is constant (marks the function in place;
    done when compiling, not at import, because it imports torch._dynamo)."""
    torch.compiler.assume_constant_result(_resolve_cached)


def _announce(name: str, reason: str) -> None:
    if torch.compiler.is_compiling():
        return  # announced by the eager calls; logging would break the graph
    if (name, reason) not in _logged:
        _logged.add((name, reason))
        logger.info("attention backend: %s (%s)", name, reason)


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"attention expects 4-d tensors [B, H, T, D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"attention shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if H % Hkv != 0:
        raise ValueError(f"attention: query heads {H} not a multiple of key/value heads {Hkv}")
    if T > S:
        raise ValueError(f"attention: {T} queries but only {S} keys (queries must be the last T positions)")
    return H // Hkv, S - T


def causal_mask(T: int, S: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean [T, S] mask, True where query i may attend key j: j <= i + (S - T) (bottom-right aligned)."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def share_kv_heads(t: torch.Tensor, query_heads: int) -> torch.Tensor:
    """Key/value heads [B, Hkv, S, D] repeated to [B, H, S, D] (query head i reads i // (H / Hkv))."""
    groups = query_heads // t.shape[1]
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def attention_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: Optional[float] = None
                     ) -> torch.Tensor:
    """The attention logits Q K^T * scale + M in fp32, [B, H, T, S]; masked entries are -inf."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q.float() @ share_kv_heads(k.float(), q.shape[1]).transpose(-2, -1)) * scale
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    return scores


def document_ids(input_ids: torch.Tensor, eod_id: int) -> torch.Tensor:
    """doc[b, t] = number of EOD tokens in input_ids[b, :t] (an EOD ends, and belongs to, its document)."""
    eod = (input_ids == eod_id).to(torch.int32)
    return eod.cumsum(dim=-1, dtype=torch.int32) - eod


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T]: True where query i may attend key j (j <= i, same document)."""
    T = doc_ids.shape[-1]
    same = doc_ids.unsqueeze(-1) == doc_ids.unsqueeze(-2)
    return (same & causal_mask(T, T, doc_ids.device)).unsqueeze(1)


def _mask_for(q, k, causal: bool, doc_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The explicit boolean mask (broadcastable to [B, H, T, S]) or None for 'no mask / is_causal'."""
    if doc_ids is not None:
        return document_causal_mask(doc_ids)
    T, S = q.shape[2], k.shape[2]
    if causal and T < S and T > 1:  # T == 1 (one new token) sees every key: no mask needed
        return causal_mask(T, S, q.device)
    return None


def _reference(q, k, v, causal: bool, dropout_p: float, scale: float,
               doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V written out, in fp32 (M: causal, or causal within documents)."""
    vf = share_kv_heads(v.float(), q.shape[1])
    if doc_ids is None:
        scores = attention_scores(q, k, causal, scale)
    else:
        scores = attention_scores(q, k, False, scale).masked_fill(~document_causal_mask(doc_ids),
                                                                   float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return (probs @ vf).to(q.dtype)


def _sdpa_priority(device: torch.device) -> list:
    """SDPA backends in the order tried on CUDA: cuDNN first on Hopper and newer, else flash."""
    from torch.nn.attention import SDPBackend

    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    if _hopper():
        fast.reverse()
    return fast + [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _sdpa_priority_text(device: torch.device) -> str:
    if device.type != "cuda":
        return "torch SDPA"
    names = [b.name.replace("_ATTENTION", "").lower() for b in _sdpa_priority(device)]
    return "torch SDPA, backend priority " + " > ".join(names)


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
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,  # type: ignore[override]
                scale: float) -> torch.Tensor:
        o, lse = native.flash_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale = causal, scale
        return o.transpose(1, 2)

    @staticmethod
    def backward(ctx, do: torch.Tensor):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = native.flash_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def _native_attention_applies(q: torch.Tensor, k: torch.Tensor, dropout_p: float,
                              doc_ids: Optional[torch.Tensor]) -> bool:
    """backend=auto on fp32 CPU without dropout or document mask, where the kernel takes the shape."""
    return (dropout_p == 0 and doc_ids is None and native.usable(q) and k.dtype == torch.float32
            and native.flash_supported(q.shape[-1]))


def trains_on_native_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                            attention_dropout: float, document_mask: bool, compiled: bool) -> bool:
    """Whether a model's training steps take the native CPU attention kernel (for the trainer's
    start-up summary; :func:`attention` decides per call by the same rule)."""
    return (requested == "auto" and device.type == "cpu" and dtype == torch.float32 and not compiled
            and native.flash_supported(head_dim) and attention_dropout == 0 and not document_mask
            and native.library() is not None)


def _cpu_dropout_attention(q, k, v, causal: bool, dropout_p: float, scale: float,
                           mask: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax((Q scale) K^T + M) with dropout, times V, on CPU: what torch's SDPA runs there when
    dropout_p > 0 (its math path), with megaformer's int16 dropout (one-byte mask, 3x faster than
    the float Bernoulli draw; :mod:`megaformer.kernels.dropout`), or where the native CPU kernels load
    and no explicit mask is needed, softmax, causal mask and dropout in one pass each way."""
    k, v = share_kv_heads(k, q.shape[1]), share_kv_heads(v, q.shape[1])
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if mask is None and native.applies(scores, "auto"):
        return torch.matmul(SoftmaxDropoutFunction.apply(scores, causal, dropout_p), v)
    if mask is None and causal:
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
    if mask is not None:
        scores = scores.masked_fill_(~mask, float("-inf"))
    probs = dropout(torch.softmax(scores, dim=-1), dropout_p)
    return torch.matmul(probs, v)


def _sdpa(q, k, v, causal: bool, dropout_p: float, scale: float,
          doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """torch SDPA; its is_causal is top-left aligned, so T < S gets an explicit bottom-right mask.
    On CPU with dropout: :func:`_cpu_dropout_attention` (the same math, a faster dropout)."""
    mask = _mask_for(q, k, causal, doc_ids)
    if dropout_p > 0 and q.device.type == "cpu":
        return _cpu_dropout_attention(q, k, v, causal, dropout_p, scale, mask)
    is_causal = causal and mask is None and q.shape[2] == k.shape[2]
    groups = q.shape[1] // k.shape[1]
    extra = {}
    if groups > 1 and _sdpa_has_gqa():
        extra["enable_gqa"] = True
    elif groups > 1:  # torch < 2.5
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    context = contextlib.nullcontext()
    if q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        context = sdpa_kernel(_sdpa_priority(q.device), set_priority=True)
    with context:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, **extra)


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


def _flash(q, k, v, causal: bool, dropout_p: float, scale: float,
           doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlashAttention works in [B, T, H, D]; GQA and bottom-right causal alignment are native.
    With doc_ids, the varlen kernel runs over the documents of all rows as one ragged batch."""
    impl, _ = _flash_status()
    if (dropout_p > 0 and not impl.dropout) or (doc_ids is not None and impl.varlen is None):
        return _sdpa(q, k, v, causal, dropout_p, scale, doc_ids)
    drop = {"dropout_p": dropout_p} if impl.dropout else {}
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if doc_ids is None:
        return _first(impl.func(qt, kt, vt, softmax_scale=scale, causal=causal, **drop)).transpose(1, 2)
    B, T = doc_ids.shape
    cu, longest = cu_seqlens(doc_ids)
    flat = [t.reshape(B * T, *t.shape[2:]) for t in (qt, kt, vt)]
    out = _first(impl.varlen(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                             max_seqlen_k=longest, softmax_scale=scale, causal=True, **drop))
    return out.reshape(B, T, *out.shape[1:]).transpose(1, 2)


_IMPLS = {"reference": _reference, "sdpa": _sdpa, "flash": _flash}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              dropout_p: float = 0.0, backend: str = "auto", scale: Optional[float] = None,
              doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V for q [B, H, T, D], k, v [B, Hkv, S, D] -> [B, H, T, D].

    ``dropout_p`` is applied as given (pass 0 in eval mode). ``scale`` defaults to 1/sqrt(D).
    ``doc_ids`` [B, T] (causal, T == S only): keys of other documents are masked too.
    """
    _check_shapes(q, k, v)
    if doc_ids is not None and (not causal or q.shape[2] != k.shape[2]
                                or tuple(doc_ids.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"attention: doc_ids {tuple(doc_ids.shape)} need causal self-attention "
                         f"with T == S and shape [B, T] = {(q.shape[0], q.shape[2])}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    name, reason = _resolve_cached(backend, q.device.type, q.dtype, q.shape[-1])
    if backend == "auto" and name == "sdpa" and _native_attention_applies(q, k, dropout_p, doc_ids):
        _announce("native", "megaformer's native CPU FlashAttention-2 kernel (fp32, no dropout; "
                            "torch SDPA otherwise)")
        return NativeFlashAttention.apply(q, k, v, causal, scale)
    _announce(name, reason)
    return _IMPLS[name](q, k, v, causal, dropout_p, scale, doc_ids)
