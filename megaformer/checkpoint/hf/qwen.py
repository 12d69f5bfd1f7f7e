"""Qwen2ForCausalLM and Qwen3ForCausalLM <-> megaformer: the Llama layout (:mod:`.llama`) with

    Qwen2: biases on the q/k/v projections only (``model.qkv_bias: true``, ``model.bias: false``)
    Qwen3: RMSNorm over each head's queries and keys before RoPE (``model.qk_norm``), heads whose
           width is set on its own (``model.head_dim``), ``attention_bias`` on q/k/v/o

Both may attend through a sliding window (``use_sliding_window``); megaformer's window applies to
every layer, so a config whose ``layer_types`` mix sliding and full attention is refused by name.
"""

from __future__ import annotations

from typing import Any

from megaformer.checkpoint.hf.llama import LlamaFamily
from megaformer.config import ModelConfig


class _Qwen(LlamaFamily):
    window = True

    def window_field(self, hf: dict[str, Any]) -> dict[str, Any]:
        layers = hf.get("layer_types") or []
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        if layers:
            kinds = set(layers)
            self.refuse_hf(
                kinds - {"full_attention", "sliding_attention"} != set(),
                f"layer_types={sorted(kinds)}",
                "only full or sliding attention exist here",
            )
            self.refuse_hf(
                len(kinds) > 1,
                "layer_types mixing sliding_attention and full_attention (max_window_layers)",
                "megaformer's sliding window applies to every layer",
            )
            if kinds == {"full_attention"}:
                sliding = None
        return {"sliding_window": sliding}

    def window_config(self, m: ModelConfig) -> dict[str, Any]:
        w = m.sliding_window
        kind = "sliding_attention" if w is not None else "full_attention"
        return {
            "use_sliding_window": w is not None,
            "sliding_window": w,
            "max_window_layers": 0 if w is not None else m.n_layers,
            "layer_types": [kind] * m.n_layers,
        }

    def bias_refusals(self, m: ModelConfig) -> list[str]:
        if m.bias:
            return [
                f"model.bias=true cannot be expressed by {self.hf_class} (its MLP has no biases)"
            ]
        return []


class Qwen2(_Qwen):
    name, hf_class, model_type = "qwen2", "Qwen2ForCausalLM", "qwen2"

    def hf_biases(self, m: ModelConfig) -> dict[str, bool]:
        return {
            "wq": True,
            "wk": True,
            "wv": True,
            "wo": False,
            "w1": False,
            "w3": False,
            "w2": False,
        }

    def bias_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"bias": False, "qkv_bias": True}

    def class_config(self, m: ModelConfig) -> dict[str, Any]:
        return self.window_config(m)


class Qwen3(_Qwen):
    name, hf_class, model_type = "qwen3", "Qwen3ForCausalLM", "qwen3"
    qk_norm = True

    def hf_biases(self, m: ModelConfig) -> dict[str, bool]:
        return {
            "wq": m.attn_bias,
            "wk": m.attn_bias,
            "wv": m.attn_bias,
            "wo": m.attn_bias,
            "w1": False,
            "w3": False,
            "w2": False,
        }

    def bias_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        # attention_bias also covers o_proj, a "model.bias" linear here: the MLP's are then zero
        return {"bias": bool(hf.get("attention_bias"))}

    def class_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": m.attn_bias, **self.window_config(m)}
