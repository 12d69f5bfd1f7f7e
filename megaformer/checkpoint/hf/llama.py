"""LlamaForCausalLM <-> megaformer: RMSNorm, SwiGLU, RoPE (rotate_half), GQA, optional biases,
Llama 3.1's and YaRN's scaled rotary frequencies; the base of the Qwen2, Qwen3 and Mistral adapters.

Hugging Face stores Llama's q/k projections already permuted for the rotate_half convention
(pairs (i, i + d_k/2)), which is megaformer's convention too, so every tensor maps by name alone:

    model.embed_tokens        <-> tok_embeddings        self_attn.{q,k,v,o}_proj <-> attn.w{q,k,v,o}
    input_layernorm           <-> attn_norm             mlp.{gate,up,down}_proj  <-> mlp.w{1,3,2}
    post_attention_layernorm  <-> mlp_norm              model.norm / lm_head     <-> final_norm / lm_head
    self_attn.{q,k}_norm      <-> attn.{q,k}_norm       (Qwen3)

Biases: megaformer has one switch for the q/k/v projections (``model.qkv_bias``, default
``model.bias``) and one for the other linears (``model.bias``); each class has its own
(:meth:`LlamaFamily.hf_biases`). A bias one side requires and the other lacks is a zero vector
(the same function); one it cannot hold is refused by name on export.
"""

from __future__ import annotations

from typing import Any

from megaformer.checkpoint.hf.arch import Architecture, hf_get, layer_renames, rope_params
from megaformer.checkpoint.hf.stream import Entry, rename, zeros
from megaformer.config import ModelConfig

_BLOCK = [
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.attn_norm.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "layers.{i}.mlp_norm.weight"),
]
_QK_NORM = [
    ("model.layers.{i}.self_attn.q_norm.weight", "layers.{i}.attn.q_norm.weight"),
    ("model.layers.{i}.self_attn.k_norm.weight", "layers.{i}.attn.k_norm.weight"),
]
_ATTN = [
    ("model.layers.{i}.self_attn.q_proj", "layers.{i}.attn.wq"),
    ("model.layers.{i}.self_attn.k_proj", "layers.{i}.attn.wk"),
    ("model.layers.{i}.self_attn.v_proj", "layers.{i}.attn.wv"),
    ("model.layers.{i}.self_attn.o_proj", "layers.{i}.attn.wo"),
]
_MLP = [
    ("model.layers.{i}.mlp.gate_proj", "layers.{i}.mlp.w1"),
    ("model.layers.{i}.mlp.up_proj", "layers.{i}.mlp.w3"),
    ("model.layers.{i}.mlp.down_proj", "layers.{i}.mlp.w2"),
]
_LINEARS = _ATTN + _MLP
SCALINGS = ("llama3", "yarn")


def _kind(src: str) -> str:
    return src.rsplit(".", 1)[-1]  # wq, wk, wv, wo, w1, w3, w2


class LlamaFamily(Architecture):
    """The Llama layout and what its descendants change: q/k norms, sliding window, biases."""

    qk_norm = False  # the class has per-head q/k RMSNorms (and requires them)
    window = False  # the class can hold a sliding window

    # ---------------------------------------------------------------- per-class differences

    def hf_biases(self, m: ModelConfig) -> dict[str, bool]:
        """Which linears (by megaformer kind) carry a bias in the exported model."""
        return {k: m.bias for k in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")}

    def bias_refusals(self, m: ModelConfig) -> list[str]:
        if m.attn_bias != m.bias:
            return [
                f"model.qkv_bias={m.qkv_bias} cannot be expressed by {self.hf_class} "
                "(attention_bias covers q, k, v and o alike)"
            ]
        return []

    def bias_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"bias": bool(hf.get("attention_bias") or hf.get("mlp_bias"))}

    def class_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": m.bias, "mlp_bias": m.bias, "pretraining_tp": 1}

    def window_field(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {}

    # ---------------------------------------------------------------- shared

    def refusals(self, m: ModelConfig) -> list[str]:
        out = (
            self.need(m, "position", ("rope",), "it uses rotary positions")
            + self.need(m, "rotary_fraction", (1.0,), "it rotates every head dimension")
            + self.need(m, "norm", ("rmsnorm",), "it uses RMSNorm")
            + self.need(m, "activation", ("swiglu",), "its MLP is SwiGLU")
            + self.need(m, "residual", ("sequential",), "its residual is sequential")
            + self.attention_refusals(
                m, head_dim=True, qk_norm=self.qk_norm, window=self.window, scaling=True
            )
            + self.bias_refusals(m)
        )
        if self.qk_norm and not m.qk_norm:
            out.append(
                f"model.qk_norm=false cannot be expressed by {self.hf_class} (it "
                "normalises every head's queries and keys)"
            )
        return out

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        rope = {"rope_type": "default", "rope_theta": m.rope_theta}
        if m.rope_scaling is not None:
            rope = {**m.rope_scaling, "rope_theta": m.rope_theta}
        return {
            "hidden_size": m.d_model,
            "intermediate_size": m.ffn_dim,
            "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": m.max_seq_len,
            "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta,
            "rope_parameters": rope,
            **({"rope_scaling": rope} if m.rope_scaling is not None else {}),
            "attention_dropout": m.attention_dropout,
            "initializer_range": m.init_std,
            "tie_word_embeddings": m.tie_embeddings,
            **self.class_config(m),
        }

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        d, h = hf["hidden_size"], hf["num_attention_heads"]
        act = hf.get("hidden_act", "silu")
        self.refuse_hf(act != "silu", f"hidden_act={act}", "the SwiGLU gate is SiLU")
        head_dim = hf.get("head_dim") or d // h
        theta, fraction, scaling = rope_params(hf, self, 1.0, SCALINGS)
        self.refuse_hf(
            fraction != 1.0,
            f"partial_rotary_factor={fraction}",
            f"{self.hf_class}'s rotary embedding must cover the whole head",
        )
        return {
            "d_model": d,
            "n_layers": hf["num_hidden_layers"],
            "n_heads": h,
            "n_kv_heads": hf_get(hf, "num_key_value_heads", default=h),
            "head_dim": head_dim if head_dim * h != d else None,
            "d_ffn": hf["intermediate_size"],
            "max_seq_len": hf["max_position_embeddings"],
            "position": "rope",
            "rope_theta": theta,
            "rope_scaling": scaling,
            "rotary_fraction": 1.0,
            "norm": "rmsnorm",
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "activation": "swiglu",
            "residual": "sequential",
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "qk_norm": self.qk_norm,
            **self.bias_fields(hf),
            **self.window_field(hf),
            "attention_dropout": float(hf.get("attention_dropout", 0.0)),
            "init_std": float(hf.get("initializer_range", 0.02)),
        }

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        plan = [rename("model.embed_tokens.weight", "tok_embeddings.weight")]
        table = _BLOCK + (_QK_NORM if m.qk_norm else [])
        table += [(f"{o}.weight", f"{src}.weight") for o, src in _LINEARS]
        plan += layer_renames(m.n_layers, table, rename)
        has = self.hf_biases(m)
        for i in range(m.n_layers):
            for hf_name, src in _LINEARS:
                if has[_kind(src)]:  # megaformer's bias, or zeros where it has none
                    out, bias = f"{hf_name}.bias".format(i=i), f"{src}.bias".format(i=i)
                    own = m.attn_bias if _kind(src) in ("wq", "wk", "wv") else m.bias
                    plan.append(rename(out, bias) if own else zeros(out, self._out_width(m, src)))
        plan.append(rename("model.norm.weight", "final_norm.weight"))
        if not m.tie_embeddings:
            plan.append(rename("lm_head.weight", "lm_head.weight"))
        return plan

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        table = [(src, out) for out, src in _BLOCK + (_QK_NORM if m.qk_norm else [])]
        table += [(f"{src}.weight", f"{o}.weight") for o, src in _LINEARS]
        plan = [rename("tok_embeddings.weight", "model.embed_tokens.weight")]
        plan += layer_renames(m.n_layers, table, rename)
        for i in range(m.n_layers):  # biases megaformer's switches give; zeros where HF has none
            for hf_name, src in _LINEARS:
                if m.attn_bias if _kind(src) in ("wq", "wk", "wv") else m.bias:
                    hf_bias, bias = f"{hf_name}.bias".format(i=i), f"{src}.bias".format(i=i)
                    width = self._out_width(m, src)
                    plan.append(rename(bias, hf_bias) if hf_bias in names else zeros(bias, width))
        plan.append(rename("final_norm.weight", "model.norm.weight"))
        if not m.tie_embeddings:
            plan.append(rename("lm_head.weight", "lm_head.weight"))
        return plan

    @staticmethod
    def _out_width(m: ModelConfig, src: str) -> int:
        return {
            "wq": m.n_heads * m.head_dim,
            "wk": m.kv_heads * m.head_dim,
            "wv": m.kv_heads * m.head_dim,
            "wo": m.d_model,
            "w1": m.ffn_dim,
            "w3": m.ffn_dim,
            "w2": m.d_model,
        }[_kind(src)]

    def ignore_on_import(self, name: str) -> bool:
        return name.endswith("rotary_emb.inv_freq")


class Llama(LlamaFamily):
    """LlamaForCausalLM (Llama 2, 3, 3.1+ with ``rope_type: llama3``). ``attention_bias`` and
    ``mlp_bias`` are separate in HF and one ``model.bias`` here: importing a model with only one
    of them fills the other's biases with zeros (the same function)."""

    name, hf_class, model_type = "llama", "LlamaForCausalLM", "llama"
