"""LlamaForCausalLM <-> megaformer: RMSNorm, SwiGLU, RoPE (rotate_half), GQA, optional biases.

Hugging Face stores Llama's q/k projections already permuted for the rotate_half convention
(pairs (i, i + d_k/2)), which is megaformer's convention too, so every tensor maps by name alone:

    model.embed_tokens        <-> tok_embeddings        self_attn.{q,k,v,o}_proj <-> attn.w{q,k,v,o}
    input_layernorm           <-> attn_norm             mlp.{gate,up,down}_proj  <-> mlp.w{1,3,2}
    post_attention_layernorm  <-> mlp_norm              model.norm / lm_head     <-> final_norm / lm_head

``attention_bias`` and ``mlp_bias`` are separate in HF and one ``model.bias`` here: importing a model
with only one of them fills the other's biases with zeros (the same function).
"""

from __future__ import annotations

from typing import Any

from megaformer.checkpoint.hf.arch import Architecture, hf_get, layer_renames, rope_params
from megaformer.checkpoint.hf.stream import Entry, rename, zeros
from megaformer.config import ModelConfig

_BLOCK = [("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight"),
          ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight")]
_ATTN = [("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.wq"),
         ("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.wk"),
         ("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.wv"),
         ("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.wo")]
_MLP = [("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.w1"),
        ("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.w3"),
        ("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.w2")]


class Llama(Architecture):
    name, hf_class, model_type = "llama", "LlamaForCausalLM", "llama"

    def refusals(self, m: ModelConfig) -> list[str]:
        return (self.need(m, "position", ("rope",), "it uses rotary positions")
                + self.need(m, "rotary_fraction", (1.0,), "it rotates every head dimension")
                + self.need(m, "norm", ("rmsnorm",), "it uses RMSNorm")
                + self.need(m, "activation", ("swiglu",), "its MLP is SwiGLU")
                + self.need(m, "residual", ("sequential",), "its residual is sequential"))

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"hidden_size": m.d_model, "intermediate_size": m.ffn_dim,
                "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
                "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
                "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
                "rope_theta": m.rope_theta,
                "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
                "attention_bias": m.bias, "mlp_bias": m.bias,
                "attention_dropout": m.attention_dropout, "initializer_range": m.init_std,
                "tie_word_embeddings": m.tie_embeddings, "pretraining_tp": 1}

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        d, h = hf["hidden_size"], hf["num_attention_heads"]
        act = hf.get("hidden_act", "silu")
        self.refuse_hf(act != "silu", f"hidden_act={act}", "the SwiGLU gate is SiLU")
        head_dim = hf.get("head_dim") or d // h
        self.refuse_hf(head_dim * h != d, f"head_dim={head_dim}",
                       f"megaformer's heads have d_model / n_heads = {d / h:g} dimensions")
        theta, fraction = rope_params(hf, self, 1.0)
        self.refuse_hf(fraction != 1.0, f"partial_rotary_factor={fraction}",
                       "Llama's rotary embedding must cover the whole head")
        return {"d_model": d, "n_layers": hf["num_hidden_layers"], "n_heads": h,
                "n_kv_heads": hf_get(hf, "num_key_value_heads", default=h),
                "d_ffn": hf["intermediate_size"], "max_seq_len": hf["max_position_embeddings"],
                "position": "rope", "rope_theta": theta, "rotary_fraction": 1.0,
                "norm": "rmsnorm", "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
                "activation": "swiglu", "residual": "sequential",
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                "bias": bool(hf.get("attention_bias", False) or hf.get("mlp_bias", False)),
                "attention_dropout": float(hf.get("attention_dropout", 0.0)),
                "init_std": float(hf.get("initializer_range", 0.02))}

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        suffixes = ("weight", "bias") if m.bias else ("weight",)
        linear = [(f"{o}.{s}", f"{src}.{s}") for o, src in _ATTN + _MLP for s in suffixes]
        plan = [rename("model.embed_tokens.weight", "tok_embeddings.weight")]
        plan += layer_renames(m.n_layers, _BLOCK + linear, rename)
        plan.append(rename("model.norm.weight", "final_norm.weight"))
        if not m.tie_embeddings:
            plan.append(rename("lm_head.weight", "lm_head.weight"))
        return plan

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        table = [(src, out) for out, src in _BLOCK]
        table += [(f"{src}.weight", f"{o}.weight") for o, src in _ATTN + _MLP]
        plan = [rename("tok_embeddings.weight", "model.embed_tokens.weight")]
        plan += layer_renames(m.n_layers, table, rename)
        if m.bias:  # one flag here, two in HF: biases HF lacks are zero
            for i in range(m.n_layers):
                for hf_name, src in _ATTN + _MLP:
                    hf_bias, bias = f"{hf_name}.bias".format(i=i), f"{src}.bias".format(i=i)
                    width = self._out_width(m, src)
                    plan.append(rename(bias, hf_bias) if hf_bias in names else zeros(bias, width))
        plan.append(rename("final_norm.weight", "model.norm.weight"))
        if not m.tie_embeddings:
            plan.append(rename("lm_head.weight", "lm_head.weight"))
        return plan

    @staticmethod
    def _out_width(m: ModelConfig, src: str) -> int:
        kind = src.rsplit(".", 1)[-1]
        return {"wq": m.n_heads * m.head_dim, "wk": m.kv_heads * m.head_dim,
                "wv": m.kv_heads * m.head_dim, "wo": m.d_model, "w1": m.ffn_dim,
                "w3": m.ffn_dim, "w2": m.d_model}[kind]

    def ignore_on_import(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")
