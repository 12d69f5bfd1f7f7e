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
"""

from __future__ import annotations

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
    pos = torch.arange(n_pos, dtype=torch.float64).unsqueeze(1)                      # [n_pos, 1]
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)           # [d/2]
    angles = pos * inv_freq                                                          # [n_pos, d/2]
    table = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1)              # [n_pos, d/2, 2]
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

    def __init__(self, head_dim: int, rotary_fraction: float = 1.0, theta: float = 10000.0) -> None:
        super().__init__()
        self.rot = rotary_dim(head_dim, rotary_fraction)
        if self.rot < 2 or self.rot % 2 != 0:
            raise ValueError(f"rotary dims per head ({head_dim} * {rotary_fraction} = {self.rot}) "
                             "must be even and >= 2")
        self.theta = theta

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """theta^(-2i/rot) for i = 0 .. rot/2 - 1, fp32 (computed as Hugging Face does)."""
        exponent = torch.arange(0, self.rot, 2, dtype=torch.int64, device=device).float() / self.rot
        return 1.0 / (self.theta ** exponent)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (int) -> (cos, sin), each [T, rot] fp32, halves duplicated: cat(f, f)."""
        freqs = torch.outer(positions.float(), self.inv_freq(positions.device))  # [T, rot/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def tables(self, start: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of positions start .. start + length - 1, cached (see the class docstring)."""
        key = (self.rot, self.theta, str(device), start, length)
        if torch.compiler.is_compiling():
            return self(torch.arange(start, start + length, device=device))
        if key not in _TABLES:
            if len(_TABLES) >= _MAX_TABLES:
                _TABLES.clear()
            with torch.no_grad():
                _TABLES[key] = self(torch.arange(start, start + length, device=device))
        return _TABLES[key]

    def extra_repr(self) -> str:
        return f"rot={self.rot}, theta={self.theta}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, H, T, D]: x_rot * cos + rotate_half(x_rot) * sin on the first rot dims.

    cos, sin: [T, rot] as returned by :class:`RotaryEmbedding` (cast to x's dtype, like HF)."""
    return rope(x, cos, sin)


__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_dim", "rotate_half", "sinusoidal_table"]
