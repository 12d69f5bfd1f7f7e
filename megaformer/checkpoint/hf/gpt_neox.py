"""GPTNeoXForCausalLM <-> megaformer: LayerNorm, GELU, partial rotary, parallel or sequential residual.

GPT-NeoX fuses q, k, v into ``query_key_value`` with the heads outermost: its rows are
[h, 3, d_k] (head 0's q, k, v, then head 1's, ...), i.e. W_qkv = stack(W_q, W_k, W_v) viewed per head:

    W_qkv.view(h, 3, d_k, d)[:, j] = W_j.view(h, d_k, d),   j = q, k, v   (biases likewise)

    gpt_neox.embed_in              <-> tok_embeddings        attention.dense <-> attn.wo
    layers.{i}.input_layernorm     <-> layers.{i}.attn_norm  mlp.dense_h_to_4h / dense_4h_to_h <-> mlp.w1 / w2
    layers.{i}.post_attention_layernorm <-> mlp_norm        final_layer_norm <-> final_norm
    embed_out                      <-> lm_head (absent when tied; transformers 5 also calls it lm_head)

Its rotary embedding (rotate_half on the first ``partial_rotary_factor`` of each head) is megaformer's
``model.rotary_fraction``. Its LayerNorms and MLP always have biases and ``attention_bias`` switches
the attention's: megaformer's single ``model.bias`` is exported with zero biases where it has none,
and an import of a model without attention biases gets zero ones.
"""

from __future__ import annotations

from typing import Any

import torch

from megaformer.checkpoint.hf.arch import Architecture, rope_params
from megaformer.checkpoint.hf.stream import Entry, rename, zeros
from megaformer.config import ModelConfig

_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
_ACT_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": None,
}
OUT_NAMES = ("embed_out.weight", "lm_head.weight")


def _fuse(h: int):
    """(W_q, W_k, W_v) each [h*d_k, ...] -> W_qkv [h*3*d_k, ...] in NeoX's per-head order."""

    def fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        parts = [t.reshape(h, t.shape[0] // h, *t.shape[1:]) for t in (q, k, v)]
        return torch.stack(parts, dim=1).reshape(3 * q.shape[0], *q.shape[1:])

    return fuse


def _split(h: int, j: int):
    """W_qkv [h*3*d_k, ...] -> its j-th part (0 q, 1 k, 2 v) [h*d_k, ...]."""

    def split(w: torch.Tensor) -> torch.Tensor:
        per_head = w.reshape(h, 3, w.shape[0] // (3 * h), *w.shape[1:])
        return per_head[:, j].reshape(w.shape[0] // 3, *w.shape[1:]).contiguous()

    return split


class GPTNeoX(Architecture):
    name, hf_class, model_type = "gpt-neox", "GPTNeoXForCausalLM", "gpt_neox"

    def refusals(self, m: ModelConfig) -> list[str]:
        out = (
            self.need(m, "position", ("rope",), "it uses rotary positions")
            + self.need(m, "norm", ("layernorm",), "it uses LayerNorm")
            + self.need(m, "activation", tuple(_ACT_TO_HF), "its MLP is GELU with two matrices")
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
            "hidden_size": m.d_model,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "intermediate_size": m.ffn_dim,
            "hidden_act": _ACT_TO_HF[m.activation],
            "max_position_embeddings": m.max_seq_len,
            "layer_norm_eps": m.norm_eps,
            "use_parallel_residual": m.residual == "parallel",
            "rotary_pct": m.rotary_fraction,
            "rotary_emb_base": m.rope_theta,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": m.rope_theta,
                "partial_rotary_factor": m.rotary_fraction,
            },
            "attention_bias": m.bias,
            "hidden_dropout": m.dropout,
            "attention_dropout": m.attention_dropout,
            "initializer_range": m.init_std,
            "tie_word_embeddings": m.tie_embeddings,
        }

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        act = hf.get("hidden_act", "gelu")
        self.refuse_hf(
            _ACT_FROM_HF.get(act) is None, f"hidden_act={act}", "supported: gelu, gelu_new"
        )
        theta, fraction, _ = rope_params(hf, self, 0.25)
        return {
            "d_model": hf["hidden_size"],
            "n_layers": hf["num_hidden_layers"],
            "n_heads": hf["num_attention_heads"],
            "n_kv_heads": None,
            "d_ffn": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"],
            "position": "rope",
            "rope_theta": theta,
            "rotary_fraction": fraction,
            "norm": "layernorm",
            "norm_eps": float(hf.get("layer_norm_eps", 1e-5)),
            "activation": _ACT_FROM_HF[act],
            "residual": "parallel" if hf.get("use_parallel_residual", True) else "sequential",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "bias": True,
            "dropout": float(hf.get("hidden_dropout", 0.0)),
            "attention_dropout": float(hf.get("attention_dropout", 0.0)),
            "init_std": float(hf.get("initializer_range", 0.02)),
        }

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        d, f, h = m.d_model, m.ffn_dim, m.n_heads
        plan = [rename("gpt_neox.embed_in.weight", "tok_embeddings.weight")]

        def bias(out: str, src: str, size: int) -> list[Entry]:
            return [rename(out, src) if m.bias else zeros(out, size)]

        for i in range(m.n_layers):
            g, a, p = f"gpt_neox.layers.{i}", f"layers.{i}.attn", f"layers.{i}.mlp"
            plan += [
                rename(f"{g}.input_layernorm.weight", f"layers.{i}.attn_norm.weight"),
                *bias(f"{g}.input_layernorm.bias", f"layers.{i}.attn_norm.bias", d),
                Entry(
                    f"{g}.attention.query_key_value.weight",
                    tuple(f"{a}.w{x}.weight" for x in "qkv"),
                    _fuse(h),
                ),
            ]
            if m.bias:
                plan.append(
                    Entry(
                        f"{g}.attention.query_key_value.bias",
                        tuple(f"{a}.w{x}.bias" for x in "qkv"),
                        _fuse(h),
                    )
                )
            plan.append(rename(f"{g}.attention.dense.weight", f"{a}.wo.weight"))
            if m.bias:
                plan.append(rename(f"{g}.attention.dense.bias", f"{a}.wo.bias"))
            plan += [
                rename(f"{g}.post_attention_layernorm.weight", f"layers.{i}.mlp_norm.weight"),
                *bias(f"{g}.post_attention_layernorm.bias", f"layers.{i}.mlp_norm.bias", d),
                rename(f"{g}.mlp.dense_h_to_4h.weight", f"{p}.w1.weight"),
                *bias(f"{g}.mlp.dense_h_to_4h.bias", f"{p}.w1.bias", f),
                rename(f"{g}.mlp.dense_4h_to_h.weight", f"{p}.w2.weight"),
                *bias(f"{g}.mlp.dense_4h_to_h.bias", f"{p}.w2.bias", d),
            ]
        plan += [
            rename("gpt_neox.final_layer_norm.weight", "final_norm.weight"),
            *bias("gpt_neox.final_layer_norm.bias", "final_norm.bias", d),
        ]
        if not m.tie_embeddings:
            plan.append(rename("embed_out.weight", "lm_head.weight"))
        return plan

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        d, h = m.d_model, m.n_heads
        plan = [rename("tok_embeddings.weight", "gpt_neox.embed_in.weight")]
        for i in range(m.n_layers):
            g, a, p = f"gpt_neox.layers.{i}", f"layers.{i}.attn", f"layers.{i}.mlp"
            qkv_b, dense_b = f"{g}.attention.query_key_value.bias", f"{g}.attention.dense.bias"
            for norm, ln in (
                ("attn_norm", "input_layernorm"),
                ("mlp_norm", "post_attention_layernorm"),
            ):
                plan += [
                    rename(f"layers.{i}.{norm}.{s}", f"{g}.{ln}.{s}") for s in ("weight", "bias")
                ]
            for j, x in enumerate("qkv"):
                plan.append(
                    Entry(
                        f"{a}.w{x}.weight", (f"{g}.attention.query_key_value.weight",), _split(h, j)
                    )
                )
                plan.append(
                    Entry(f"{a}.w{x}.bias", (qkv_b,), _split(h, j))
                    if qkv_b in names
                    else zeros(f"{a}.w{x}.bias", d)
                )
            plan += [
                rename(f"{a}.wo.weight", f"{g}.attention.dense.weight"),
                rename(f"{a}.wo.bias", dense_b) if dense_b in names else zeros(f"{a}.wo.bias", d),
                rename(f"{p}.w1.weight", f"{g}.mlp.dense_h_to_4h.weight"),
                rename(f"{p}.w1.bias", f"{g}.mlp.dense_h_to_4h.bias"),
                rename(f"{p}.w2.weight", f"{g}.mlp.dense_4h_to_h.weight"),
                rename(f"{p}.w2.bias", f"{g}.mlp.dense_4h_to_h.bias"),
            ]
        plan += [
            rename(f"final_norm.{s}", f"gpt_neox.final_layer_norm.{s}") for s in ("weight", "bias")
        ]
        if not m.tie_embeddings:
            out = next((n for n in OUT_NAMES if n in names), OUT_NAMES[0])
            plan.append(rename("lm_head.weight", out))
        return plan

    def ignore_on_import(self, name: str) -> bool:  # old checkpoints' cached buffers
        return name.endswith((".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq"))
