"""Scaled dot-product attention with one interface and three implementations.

    Attention(Q, K, V) = softmax(Q K^T * scale + M) V,   scale = 1 / sqrt(d_k) by default,

with q of shape [B, H, T, D] and k, v of shape [B, Hkv, S, D], H a multiple of Hkv (grouped-query
attention: query head i reads key/value head i // (H / Hkv); Hkv = 1 is multi-query attention).
When T < S the queries are the *last* T positions of the S keys (decoding with a KV cache), so the
causal mask M is aligned bottom-right: query i (absolute position S - T + i) sees keys j <= S - T + i.

Paths:
  * ``flash``     -- ``flash_attn.flash_attn_func`` (CUDA, fp16/bf16; GQA and bottom-right causal native)
  * ``sdpa``      -- ``torch.nn.functional.scaled_dot_product_attention``
  * ``reference`` -- the formula above written out, in fp32
  * ``auto``      -- flash when usable, else sdpa
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megaformer.errors import ConfigError

logger = logging.getLogger("megaformer")

BACKENDS = ("auto", "flash", "sdpa", "reference")
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_MAX_HEAD_DIM = 256
_logged: set = set()  # (backend, reason) pairs already announced in this process


@functools.lru_cache(maxsize=None)
def _flash_status() -> tuple[Optional[object], str]:
    """(flash_attn_func or None, why not). Imported lazily, once."""
    if importlib.util.find_spec("flash_attn") is None:
        return None, "flash-attn not installed"
    try:
        module = importlib.import_module("flash_attn")
        return module.flash_attn_func, "flash-attn available"
    except Exception as e:  # a broken build (ABI mismatch, missing CUDA libs) must not kill the run
        first = (str(e).splitlines() or [""])[0]
        return None, f"flash-attn failed to import: {type(e).__name__}: {first}"


def _flash_unusable(device: torch.device, dtype: torch.dtype, head_dim: Optional[int]) -> Optional[str]:
    """Why flash-attn cannot run these tensors, or None when it can."""
    func, why = _flash_status()
    if func is None:
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
        return "flash", f"flash-attn on {device.type} {str(dtype).replace('torch.', '')}"
    return "sdpa", why_not


@functools.lru_cache(maxsize=None)
def _resolve_cached(requested: str, device_type: str, dtype: torch.dtype, head_dim: int) -> tuple[str, str]:
    return resolve_backend(requested, torch.device(device_type), dtype, head_dim)


def _announce(name: str, reason: str) -> None:
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


def _reference(q, k, v, causal: bool, dropout_p: float, scale: float) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V written out, in fp32."""
    vf = share_kv_heads(v.float(), q.shape[1])
    probs = torch.softmax(attention_scores(q, k, causal, scale), dim=-1)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return (probs @ vf).to(q.dtype)


def _sdpa(q, k, v, causal: bool, dropout_p: float, scale: float) -> torch.Tensor:
    """torch SDPA; its is_causal is top-left aligned, so T < S gets an explicit bottom-right mask."""
    T, S = q.shape[2], k.shape[2]
    mask, is_causal = None, False
    if causal and T == S:
        is_causal = True
    elif causal and T > 1:  # T == 1 (one new token) sees every key: no mask needed
        mask = causal_mask(T, S, q.device)
    groups = q.shape[1] // k.shape[1]
    extra = {}
    if groups > 1 and _sdpa_has_gqa():
        extra["enable_gqa"] = True
    elif groups > 1:  # torch < 2.5
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, **extra)


@functools.lru_cache(maxsize=None)
def _sdpa_has_gqa() -> bool:
    """torch >= 2.5 shares key/value heads inside SDPA (``enable_gqa``)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def _flash(q, k, v, causal: bool, dropout_p: float, scale: float) -> torch.Tensor:
    """flash_attn_func works in [B, T, H, D]; GQA and bottom-right causal alignment are native."""
    func, _ = _flash_status()
    out = func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
               dropout_p=dropout_p, softmax_scale=scale, causal=causal)
    return out.transpose(1, 2)


_IMPLS = {"reference": _reference, "sdpa": _sdpa, "flash": _flash}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              dropout_p: float = 0.0, backend: str = "auto", scale: Optional[float] = None) -> torch.Tensor:
    """softmax(Q K^T * scale + M) V for q [B, H, T, D], k, v [B, Hkv, S, D] -> [B, H, T, D].

    ``dropout_p`` is applied as given (pass 0 in eval mode). ``scale`` defaults to 1/sqrt(D).
    """
    _check_shapes(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    name, reason = _resolve_cached(backend, q.device.type, q.dtype, q.shape[-1])
    _announce(name, reason)
    return _IMPLS[name](q, k, v, causal, dropout_p, scale)
