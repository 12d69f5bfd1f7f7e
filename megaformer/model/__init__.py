"""The model in plain PyTorch: norms, positions, attention, mlp, block, transformer."""

from megaformer.model.attention import Attention, KVCache, LayerKVCache
from megaformer.model.block import Block
from megaformer.model.mlp import MLP
from megaformer.model.norms import LayerNorm, RMSNorm, build_norm
from megaformer.model.positions import RotaryEmbedding, apply_rotary, rotate_half, sinusoidal_table
from megaformer.model.transformer import Transformer

__all__ = [
    "Attention",
    "Block",
    "KVCache",
    "LayerKVCache",
    "LayerNorm",
    "MLP",
    "RMSNorm",
    "RotaryEmbedding",
    "Transformer",
    "apply_rotary",
    "build_norm",
    "rotate_half",
    "sinusoidal_table",
]
