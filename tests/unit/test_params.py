"""Analytic parameter counts equal the module's, and the published totals of real models."""

from __future__ import annotations

import itertools

import pytest
import torch

from megaformer.analysis import count_parameters
from megaformer.config import ModelConfig
from megaformer.model import Transformer
from tests.helpers import tiny_model

TINY = [
    dict(position=pos, norm=norm, activation=act, bias=bias, tie_embeddings=tie, n_kv_heads=kv)
    for pos, norm, act, bias, tie, kv in itertools.product(
        ("rope", "learned", "sinusoidal", "none"),
        ("rmsnorm", "layernorm"),
        ("gelu", "swiglu"),
        (False, True),
        (True, False),
        (None, 2, 1),
    )
]


def tiny(**kw) -> ModelConfig:
    return tiny_model(**kw)


@pytest.mark.parametrize("kw", TINY, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_analytic_equals_module_on_meta(kw):
    cfg = tiny(**kw)
    with torch.device("meta"):
        m = Transformer(cfg)
    counts = count_parameters(cfg)
    assert m.num_parameters() == counts["total"]
    assert m.num_parameters(exclude_embeddings=True) == counts["non_embedding"]
    assert counts["embedding"] + counts["non_embedding"] == counts["total"]


@pytest.mark.parametrize("kw", TINY[::7])
def test_analytic_equals_real_module(kw):
    cfg = tiny(d_ffn=48, **kw)
    m = Transformer(cfg)
    assert (
        sum(p.numel() for p in m.parameters())
        == count_parameters(cfg)["total"]
        == m.num_parameters()
    )


PUBLISHED = {
    "llama-2-7b": (
        dict(
            vocab_size=32000,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            d_ffn=11008,
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            tie_embeddings=False,
            bias=False,
            max_seq_len=4096,
        ),
        6_738_415_616,
    ),
    "llama-2-70b": (
        dict(
            vocab_size=32000,
            d_model=8192,
            n_layers=80,
            n_heads=64,
            n_kv_heads=8,
            d_ffn=28672,
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            tie_embeddings=False,
            bias=False,
            max_seq_len=4096,
        ),
        68_976_648_192,
    ),
    "gpt2-124m": (
        dict(
            vocab_size=50257,
            d_model=768,
            n_layers=12,
            n_heads=12,
            position="learned",
            max_seq_len=1024,
            norm="layernorm",
            activation="gelu",
            bias=True,
            tie_embeddings=True,
        ),
        124_439_808,
    ),
    "llama-3.2-1b": (
        dict(
            vocab_size=128256,
            d_model=2048,
            n_layers=16,
            n_heads=32,
            n_kv_heads=8,
            d_ffn=8192,
            norm="rmsnorm",
            activation="swiglu",
            position="rope",
            rope_theta=500000.0,
            tie_embeddings=True,
            bias=False,
            max_seq_len=8192,
        ),
        1_235_814_400,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_totals(name):
    kw, published = PUBLISHED[name]
    cfg = ModelConfig(**kw)
    with torch.device("meta"):
        m = Transformer(cfg)
    assert m.num_parameters() == count_parameters(cfg)["total"] == published


def test_gpt2_default_ffn_and_embedding_split():
    kw, _ = PUBLISHED["gpt2-124m"]
    counts = count_parameters(ModelConfig(**kw))
    assert counts["embedding"] == 50257 * 768 + 1024 * 768
    assert counts["non_embedding"] == 124_439_808 - counts["embedding"]


def test_vocab_size_required():
    with pytest.raises(ValueError, match="vocab_size"):
        count_parameters(ModelConfig())
