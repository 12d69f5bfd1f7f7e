"""GPT2LMHeadModel <-> megaformer: learned positions, LayerNorm, GELU (tanh or exact), MHA, biases.

GPT-2's linear layers are ``Conv1D``: y = x W + b with W stored [in, out], the transpose of
``nn.Linear``'s [out, in]. Attention's q, k, v are one matrix c_attn = [W_q | W_k | W_v] ([d, 3d]):

    transformer.wte / wpe        <-> tok_embeddings / pos_embeddings
    h.{i}.ln_1 / ln_2            <-> layers.{i}.attn_norm / mlp_norm
    h.{i}.attn.c_attn            <-> [attn.wq; attn.wk; attn.wv]^T     (weight), concatenated (bias)
    h.{i}.attn.c_proj            <-> attn.wo^T
    h.{i}.mlp.c_fc / c_proj      <-> mlp.w1^T / mlp.w2^T
    transformer.ln_f             <-> final_norm            lm_head <-> lm_head (absent when tied)

GPT-2 always has biases; a megaformer model without them exports zero biases (the same function).
"""

from __future__ import annotations

from typing import Any

import torch

from megaformer.checkpoint.hf.arch import Architecture, hf_get
from megaformer.checkpoint.hf.stream import Entry, rename, zeros
from megaformer.config import ModelConfig

_ACT_TO_HF = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
_ACT_FROM_HF = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


def _qkv_weight(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat((q, k, v), dim=0).t().contiguous()


def _qkv_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.cat((q, k, v), dim=0)


def _part(d: int, j: int, transpose: bool):
    """The j-th of q, k, v from c_attn (weight [d, 3d] -> [d, d] as nn.Linear; bias [3d] -> [d])."""
    if transpose:
        return lambda w: w[:, j * d : (j + 1) * d].t().contiguous()
    return lambda b: b[j * d : (j + 1) * d].contiguous()


class GPT2(Architecture):
    name, hf_class, model_type = "gpt2", "GPT2LMHeadModel", "gpt2"

    def refusals(self, m: ModelConfig) -> list[str]:
        out = (
            self.need(m, "position", ("learned",), "it has a learned position table")
            + self.need(m, "norm", ("layernorm",), "it uses LayerNorm")
            + self.need(m, "activation", tuple(_ACT_TO_HF), "its MLP is GELU with two matrices")
            + self.need(m, "residual", ("sequential",), "its residual is sequential")
        )
        if m.kv_heads != m.n_heads:
            out.append(
                f"model.n_kv_heads={m.n_kv_heads} cannot be expressed by {self.hf_class} "
                "(it has multi-head attention only)"
            )
        if m.attn_bias != m.bias:
            out.append(
                f"model.qkv_bias={m.qkv_bias} cannot be expressed by {self.hf_class} (its "
                "attention biases follow model.bias)"
            )
        return out + self.attention_refusals(m)

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        return {
            "n_embd": m.d_model,
            "n_layer": m.n_layers,
            "n_head": m.n_heads,
            "n_inner": m.ffn_dim,
            "n_positions": m.max_seq_len,
            "n_ctx": m.max_seq_len,
            "activation_function": _ACT_TO_HF[m.activation],
            "layer_norm_epsilon": m.norm_eps,
            "resid_pdrop": m.dropout,
            "embd_pdrop": m.dropout,
            "attn_pdrop": m.attention_dropout,
            "initializer_range": m.init_std,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "tie_word_embeddings": m.tie_embeddings,
        }

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        act = hf.get("activation_function", "gelu_new")
        self.refuse_hf(
            act not in _ACT_FROM_HF,
            f"activation_function={act}",
            f"supported: {', '.join(_ACT_FROM_HF)}",
        )
        self.refuse_hf(
            not hf.get("scale_attn_weights", True),
            "scale_attn_weights=false",
            "attention is always scaled by 1/sqrt(d_k)",
        )
        self.refuse_hf(
            bool(hf.get("scale_attn_by_inverse_layer_idx")),
            "scale_attn_by_inverse_layer_idx=true",
            "no per-layer attention scaling",
        )
        self.refuse_hf(
            bool(hf.get("add_cross_attention")), "add_cross_attention=true", "decoder-only"
        )
        d = hf["n_embd"]
        return {
            "d_model": d,
            "n_layers": hf["n_layer"],
            "n_heads": hf["n_head"],
            "n_kv_heads": None,
            "d_ffn": hf_get(hf, "n_inner", default=4 * d),
            "max_seq_len": hf["n_positions"],
            "position": "learned",
            "norm": "layernorm",
            "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
            "activation": _ACT_FROM_HF[act],
            "residual": "sequential",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "bias": True,
            "dropout": float(hf.get("resid_pdrop", 0.0)),
            "attention_dropout": float(hf.get("attn_pdrop", 0.0)),
            "init_std": float(hf.get("initializer_range", 0.02)),
        }

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        d, f = m.d_model, m.ffn_dim
        plan = [
            rename("transformer.wte.weight", "tok_embeddings.weight"),
            rename("transformer.wpe.weight", "pos_embeddings.weight"),
        ]

        def bias(out: str, src: str, size: int) -> Entry:
            return rename(out, src) if m.bias else zeros(out, size)

        for i in range(m.n_layers):
            h, a, p = f"transformer.h.{i}", f"layers.{i}.attn", f"layers.{i}.mlp"
            qkv = tuple(f"{a}.w{x}" for x in "qkv")
            plan += [
                rename(f"{h}.ln_1.weight", f"layers.{i}.attn_norm.weight"),
                bias(f"{h}.ln_1.bias", f"layers.{i}.attn_norm.bias", d),
                Entry(f"{h}.attn.c_attn.weight", tuple(f"{n}.weight" for n in qkv), _qkv_weight),
                (
                    Entry(f"{h}.attn.c_attn.bias", tuple(f"{n}.bias" for n in qkv), _qkv_bias)
                    if m.bias
                    else zeros(f"{h}.attn.c_attn.bias", 3 * d)
                ),
                Entry(f"{h}.attn.c_proj.weight", (f"{a}.wo.weight",), _t),
                bias(f"{h}.attn.c_proj.bias", f"{a}.wo.bias", d),
                rename(f"{h}.ln_2.weight", f"layers.{i}.mlp_norm.weight"),
                bias(f"{h}.ln_2.bias", f"layers.{i}.mlp_norm.bias", d),
                Entry(f"{h}.mlp.c_fc.weight", (f"{p}.w1.weight",), _t),
                bias(f"{h}.mlp.c_fc.bias", f"{p}.w1.bias", f),
                Entry(f"{h}.mlp.c_proj.weight", (f"{p}.w2.weight",), _t),
                bias(f"{h}.mlp.c_proj.bias", f"{p}.w2.bias", d),
            ]
        plan += [
            rename("transformer.ln_f.weight", "final_norm.weight"),
            bias("transformer.ln_f.bias", "final_norm.bias", d),
        ]
        if not m.tie_embeddings:
            plan.append(rename("lm_head.weight", "lm_head.weight"))
        return plan

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        d = m.d_model
        plan = [
            rename("tok_embeddings.weight", "transformer.wte.weight"),
            rename("pos_embeddings.weight", "transformer.wpe.weight"),
        ]
        for i in range(m.n_layers):
            h, a, p = f"transformer.h.{i}", f"layers.{i}.attn", f"layers.{i}.mlp"
            for norm, ln in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                plan += [
                    rename(f"layers.{i}.{norm}.{s}", f"{h}.{ln}.{s}") for s in ("weight", "bias")
                ]
            for j, x in enumerate("qkv"):
                plan += [
                    Entry(f"{a}.w{x}.weight", (f"{h}.attn.c_attn.weight",), _part(d, j, True)),
                    Entry(f"{a}.w{x}.bias", (f"{h}.attn.c_attn.bias",), _part(d, j, False)),
                ]
            plan += [
                Entry(f"{a}.wo.weight", (f"{h}.attn.c_proj.weight",), _t),
                rename(f"{a}.wo.bias", f"{h}.attn.c_proj.bias"),
                Entry(f"{p}.w1.weight", (f"{h}.mlp.c_fc.weight",), _t),
                rename(f"{p}.w1.bias", f"{h}.mlp.c_fc.bias"),
                Entry(f"{p}.w2.weight", (f"{h}.mlp.c_proj.weight",), _t),
                rename(f"{p}.w2.bias", f"{h}.mlp.c_proj.bias"),
            ]
        plan += [rename(f"final_norm.{s}", f"transformer.ln_f.{s}") for s in ("weight", "bias")]
        if not m.tie_embeddings:
            plan.append(rename("lm_head.weight", "lm_head.weight"))
        return plan

    def ignore_on_import(self, name: str) -> bool:  # old checkpoints' causal-mask buffers
        return name.endswith(".attn.bias") or name.endswith(".attn.masked_bias")
