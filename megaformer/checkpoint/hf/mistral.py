"""MistralForCausalLM <-> megaformer: the Llama layout (:mod:`.llama`) without biases, with a
sliding window over every layer (``sliding_window``, Mistral 7B v0.1: 4096; null from v0.2 on)
and heads whose width may be set on its own (``head_dim``)."""

from __future__ import annotations

from typing import Any

from megaformer.checkpoint.hf.llama import LlamaFamily
from megaformer.config import ModelConfig


class Mistral(LlamaFamily):
    name, hf_class, model_type = "mistral", "MistralForCausalLM", "mistral"
    window = True

    def hf_biases(self, m: ModelConfig) -> dict[str, bool]:
        return {k: False for k in ("wq", "wk", "wv", "wo", "w1", "w3", "w2")}

    def bias_refusals(self, m: ModelConfig) -> list[str]:
        if m.bias or m.attn_bias:
            key = "bias" if m.bias else "qkv_bias"
            return [f"model.{key}=true cannot be expressed by {self.hf_class} (it has no biases)"]
        return []

    def bias_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"bias": False}

    def class_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"sliding_window": m.sliding_window}

    def window_field(self, hf: dict[str, Any]) -> dict[str, Any]:
        self.refuse_hf(
            bool(hf.get("layer_types")) and len(set(hf["layer_types"])) > 1,
            "layer_types mixing sliding and full attention",
            "megaformer's sliding window applies to every layer",
        )
        return {"sliding_window": hf.get("sliding_window")}
