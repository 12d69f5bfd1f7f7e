"""Positional information.

Absolute (added to the token embedding, Vaswani et al. 2017, section 3.5):

    PE(pos, 2i)   = sin(pos / 10000^(2i / d))
    PE(pos, 2i+1) = cos(pos / 10000^(2i / d))

or a learned table E_pos[pos] (GPT-2). Relative, rotary (Su et al. 2021, RoPE), applied to q and k
inside attention: the first ``rot = int(d_k * rotary_fraction)`` dimensions of each head are split in
two halves (x1, x2) = (x[:rot/2], x[rot/2:rot]), and pair (i, i + rot/2) is rotated by the angle
pos * theta^(-2i/rot):

    RoPE(x, pos) = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin,  x[rot:]]

This is the "rotate_half" convention of GPT-NeoX and Hugging Face Llama / GPT-NeoX, so checkpoints
convert without permuting q/k weights. The remaining d_k - rot dimensions pass through unchanged.

Scaled frequencies for a context longer than the one pretrained (``model.rope_scaling``), computed
as transformers' ``modeling_rope_utils`` does, with w_i = theta^(-2i/rot), wavelength 2 pi / w_i and
L the original context (``original_max_position_embeddings``), s the factor:

    llama3:  w_i' = w_i                      wavelength < L / high_freq_factor
             w_i' = w_i / s                  wavelength > L / low_freq_factor
             w_i' = (1 - a) w_i / s + a w_i  between,  a = (L / wavelength - low) / (high - low)
    yarn:    w_i' = w_i / s (1 - r_i) + w_i r_i,   r_i = 1 - clamp((i - lo) / (hi - lo), 0, 1)
             (lo, hi: the dimensions turning beta_fast and beta_slow times over L), and cos, sin
             multiplied by the attention factor 0.1 ln(s) + 1 (or as mscale / mscale_all_dim /
             attention_factor say), which scales the attention logits by its square.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from megaformer.kernels.rope import rope, rotate_half

_TABLES: dict = {}  # (rot, theta, device, start, T) -> (cos, sin): shared by every layer
_MAX_TABLES = 8


def sinusoidal_table(n_pos: int, d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[n_pos, d] table with PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(same).

    Angles are computed in float64 (pos * w loses ~1e-4 rad in fp32 at pos ~ 10^4), then cast.
    """
    if d % 2 != 0:
        raise ValueError(f"sinusoidal positions need an even width, got d={d}")
    pos = torch.arange(n_pos, dtype=torch.float64).unsqueeze(1)  # [n_pos, 1]
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    angles = pos * inv_freq  # [n_pos, d/2]
    table = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1)  # [n_pos, d/2, 2]
    return table.reshape(n_pos, d).to(dtype)


def rotary_dim(head_dim: int, rotary_fraction: float) -> int:
    """Number of rotated dimensions per head: int(head_dim * rotary_fraction)."""
    return int(head_dim * rotary_fraction)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for given positions: angle(pos, i) = pos * theta^(-2i/rot), i < rot/2.

    Holds no parameters and no buffers, so it is safe under meta-device construction and never goes
    stale after ``to_empty``. The tables are computed on the positions' device (no host copy) and
    kept for the last few (start, length, device) asked for, shared by all layers, so a model or a
    pipeline stage computes them once, not per layer and step.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_fraction: float = 1.0,
        theta: float = 10000.0,
        scaling: Optional[dict] = None,
    ) -> None:
        super().__init__()
        self.rot = rotary_dim(head_dim, rotary_fraction)
        if self.rot < 2 or self.rot % 2 != 0:
            raise ValueError(
                f"rotary dims per head ({head_dim} * {rotary_fraction} = {self.rot}) "
                "must be even and >= 2"
            )
        self.theta = theta
        self.scaling = dict(scaling) if scaling else None
        self.attention_factor = (
            yarn_attention_factor(self.scaling)
            if self.scaling and self.scaling["rope_type"] == "yarn"
            else 1.0
        )
        self._key = (self.rot, self.theta, tuple(sorted((self.scaling or {}).items())))

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """theta^(-2i/rot) for i = 0 .. rot/2 - 1, fp32 (computed as Hugging Face does), scaled
        as ``scaling`` says (the module docstring)."""
        exponent = torch.arange(0, self.rot, 2, dtype=torch.int64, device=device).float() / self.rot
        inv_freq = 1.0 / (self.theta**exponent)
        if self.scaling is None:
            return inv_freq
        if self.scaling["rope_type"] == "llama3":
            return llama3_inv_freq(inv_freq, self.scaling)
        return yarn_inv_freq(inv_freq, self.rot, self.theta, self.scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int) -> (cos, sin), each [T, rot] fp32, halves duplicated: cat(f, f);
        both times the attention factor (1 unless YaRN)."""
        freqs = torch.outer(positions.float(), self.inv_freq(positions.device))  # [T, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()

    def tables(
        self, start: int, length: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions start .. start + length - 1, cached (see the class docstring)."""
        key = (self._key, str(device), start, length)
        if torch.compiler.is_compiling():
            return self(torch.arange(start, start + length, device=device))
        if key not in _TABLES:
            if len(_TABLES) >= _MAX_TABLES:
                _TABLES.clear()
            with torch.no_grad():
                _TABLES[key] = self(torch.arange(start, start + length, device=device))
        return _TABLES[key]

    def extra_repr(self) -> str:
        scaled = f", scaling={self.scaling['rope_type']}" if self.scaling else ""
        return f"rot={self.rot}, theta={self.theta}{scaled}"


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1's frequency scaling of ``inv_freq`` (module docstring; transformers' formula)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_attention_factor(scaling: dict) -> float:
    """YaRN's factor on cos and sin: ``attention_factor`` if given, else 0.1 ln(s) + 1 (or the
    ratio of that with ``mscale`` and ``mscale_all_dim`` when both are given)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def yarn_inv_freq(inv_freq: torch.Tensor, rot: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's blend of interpolated (w / s) and original frequencies (module docstring)."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension turning `rotations` times over L
        return (rot * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rot - 1)
    if lo == hi:
        hi += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(rot // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrapolation = (1 - ramp).to(inv_freq.device)
    # theta^(2i/rot), from which transformers forms both frequency sets
    pos_freqs = theta ** (torch.arange(0, rot, 2, device=inv_freq.device).float() / rot)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, H, T, D]: x_rot * cos + rotate_half(x_rot) * sin on the first rot dims.

    cos, sin: [T, rot] as returned by :class:`RotaryEmbedding` (cast to x's dtype, like HF)."""
    return rope(x, cos, sin)


__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_dim", "rotate_half", "sinusoidal_table"]
