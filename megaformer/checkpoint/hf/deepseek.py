"""DeepseekV3ForCausalLM <-> megaformer: multi-head latent attention (:mod:`megaformer.model.mla`)
and the DeepSeek-V3 MoE (sigmoid scores, group-limited routing, the routed scale, shared experts,
the first blocks dense). Kimi K2's config.json is read by transformers as this class too.

    self_attn.q_proj                  <-> attn.wq          (without q_lora_rank)
    self_attn.q_a_proj / q_a_layernorm / q_b_proj  <-> attn.wq_a / q_norm / wq_b
    self_attn.kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj  <-> attn.wkv_a / kv_norm / wkv_b
    self_attn.o_proj                  <-> attn.wo
    mlp.gate.weight                   <-> mlp.router.weight
    mlp.gate.e_score_correction_bias  <-> layers.{i}.mlp.expert_bias (the checkpoint's router
                                          state: the aux-loss-free bias, not a parameter here)
    mlp.experts.{e}.gate/up/down_proj <-> mlp.experts.w1/w3/w2 [e]
    mlp.shared_experts.gate/up/down_proj <-> mlp.shared.w1/w3/w2
    the first first_k_dense_replace blocks: mlp.gate/up/down_proj <-> mlp.w1/w3/w2

Rotary layout: DeepSeek's checkpoints (``rope_interleave: true``) rotate pairs of adjacent
dimensions (x_0, x_1), (x_2, x_3), ...; megaformer rotates (x_i, x_{i + d_r/2}). Import reorders
the rows of each head's rotary part of the query projection, and of the shared rotary key's part
of kv_a, to [x_0, x_2, ..., x_1, x_3, ...]; q^R . k^R is unchanged (both reordered alike), and
export restores the interleaved order. The multi-token prediction modules of the released
weights (``model.layers.{L}..``, ``num_nextn_predict_layers``) are not read (a note says so).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

import torch

from megaformer.checkpoint.hf.llama import SCALINGS
from megaformer.checkpoint.hf.moe import _MoEFamily
from megaformer.checkpoint.hf.stream import Entry, rename
from megaformer.config import ModelConfig

log = logging.getLogger("megaformer")

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _rope_order(d_r: int) -> torch.Tensor:
    """[0, 2, ..., d_r - 2, 1, 3, ..., d_r - 1]: interleaved pairs -> rotate-half halves."""
    return torch.cat((torch.arange(0, d_r, 2), torch.arange(1, d_r, 2)))


def reorder_rope_rows(
    width: int, d_r: int, to_halves: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A weight [n * width, in] whose every block of ``width`` rows ends with d_r rotary rows:
    those rows reordered from interleaved pairs to halves (``to_halves``) or back."""
    order = _rope_order(d_r)
    if not to_halves:
        order = torch.argsort(order)
    index = torch.cat((torch.arange(width - d_r), width - d_r + order))

    def fn(w: torch.Tensor) -> torch.Tensor:
        blocks = w.reshape(-1, width, w.shape[-1])
        return blocks[:, index.to(w.device)].reshape(w.shape)

    return fn


class DeepseekV3(_MoEFamily):
    name, hf_class, model_type = "deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3"
    router = "mlp.gate"
    experts = "mlp.experts.{e}"
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    # ---------------------------------------------------------------- refusals

    def refusals(self, m: ModelConfig) -> list[str]:
        c = self.hf_class
        out = (
            []
            if m.attention == "mla"
            else [
                f"model.attention={m.attention} cannot be expressed by {c} (its attention is "
                "multi-head latent attention)"
            ]
        )
        out += (
            self.need(m, "position", ("rope",), "it uses rotary positions")
            + self.need(m, "norm", ("rmsnorm",), "it uses RMSNorm")
            + self.need(m, "activation", ("swiglu",), "its FFNs are SwiGLU")
            + self.need(m, "residual", ("sequential",), "its residual is sequential")
            + self.need(m, "bias", (False,), "its linears have no biases")
        )
        if m.rope_scaling is not None and m.rope_scaling.get("rope_type") not in SCALINGS:
            out.append(f"model.rope_scaling cannot be expressed by {c}")
        return out

    def moe_refusals(self, m: ModelConfig) -> list[str]:
        moe, c = m.moe, self.hf_class
        if moe.interval != 1:
            return [
                f"model.moe.interval={moe.interval} cannot be expressed by {c} (every block "
                "after the first first_k_dense_replace is MoE)"
            ]
        out = []
        for key, ok, why in (
            ("score", moe.score == "sigmoid", "its router scores are sigmoids"),
            ("num_shared_experts", moe.num_shared_experts > 0, "it has shared experts"),
            (
                "d_shared",
                moe.d_shared in (None, m.expert_dim),
                "a shared expert is as wide as a routed one",
            ),
            ("shared_gate", not moe.shared_gate, "its shared experts are not gated"),
            ("dropless", moe.dropless, "it computes every routed token"),
        ):
            if not ok:
                out.append(
                    f"model.moe.{key}={getattr(moe, key)} cannot be expressed by {c} ({why})"
                )
        return out

    # ---------------------------------------------------------------- config both ways

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        mla, moe = m.mla, m.moe
        return {
            **super().hf_config(m),
            "head_dim": mla.qk_rope_head_dim,
            "q_lora_rank": mla.q_lora_rank,
            "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_nope_head_dim,
            "qk_rope_head_dim": mla.qk_rope_head_dim,
            "v_head_dim": mla.v_head_dim,
            "rope_interleave": True,
            "attention_bias": False,
            "num_nextn_predict_layers": 0,
            "n_group": moe.num_groups,
            "topk_group": moe.top_groups or moe.num_groups,
            "routed_scaling_factor": moe.routed_scaling_factor,
        }

    def class_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": False, "pretraining_tp": 1}

    def moe_config(self, m: ModelConfig) -> dict[str, Any]:
        moe = m.moe
        return {
            "intermediate_size": m.ffn_dim,
            "moe_intermediate_size": m.expert_dim,
            "n_routed_experts": moe.num_experts,
            "n_shared_experts": moe.num_shared_experts,
            "num_experts_per_tok": moe.top_k,
            "norm_topk_prob": moe.renormalize,
            "first_k_dense_replace": moe.first_dense,
        }

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        self.refuse_hf(
            bool(hf.get("attention_bias")), "attention_bias=true", "MLA here has no biases"
        )
        h = hf["num_attention_heads"]
        kv = hf.get("num_key_value_heads") or h
        self.refuse_hf(kv != h, f"num_key_value_heads={kv}", "every MLA head has its own key")
        fields = super().model_fields(hf)
        fields.update(
            head_dim=None,
            n_kv_heads=None,
            attention="mla",
            mla={
                "q_lora_rank": hf.get("q_lora_rank"),
                "kv_lora_rank": hf["kv_lora_rank"],
                "qk_nope_head_dim": hf["qk_nope_head_dim"],
                "qk_rope_head_dim": hf["qk_rope_head_dim"],
                "v_head_dim": hf["v_head_dim"],
            },
        )
        self._interleaved = bool(hf.get("rope_interleave", True))
        return fields

    def moe_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        experts = hf.get("n_routed_experts") or 0
        self.refuse_hf(experts < 1, f"n_routed_experts={experts}", "an MoE model needs experts")
        groups = hf.get("n_group") or 1
        return {
            "interval": 1,
            "first_dense": hf.get("first_k_dense_replace") or 0,
            "num_experts": experts,
            "top_k": hf.get("num_experts_per_tok") or 8,
            "score": "sigmoid",
            "renormalize": bool(hf.get("norm_topk_prob", True)),
            "d_expert": hf["moe_intermediate_size"],
            "num_shared_experts": hf.get("n_shared_experts") or 0,
            "num_groups": groups,
            "top_groups": hf.get("topk_group") or groups,
            "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
            "aux_loss_coef": 0.0,  # DeepSeek-V3 balances by the expert bias
            "bias_update_rate": 0.001,  # its update speed gamma (DeepSeek-V3 section 4.2)
        }

    # ---------------------------------------------------------------- tensors

    def _attention_pairs(self, m: ModelConfig, i: int) -> list[tuple[str, str]]:
        hf, ours = f"model.layers.{i}.self_attn.", f"layers.{i}.attn."
        pairs = [
            ("kv_a_proj_with_mqa.weight", "wkv_a.weight"),
            ("kv_a_layernorm.weight", "kv_norm.weight"),
            ("kv_b_proj.weight", "wkv_b.weight"),
            ("o_proj.weight", "wo.weight"),
        ]
        if m.mla.q_lora_rank is None:
            pairs.append(("q_proj.weight", "wq.weight"))
        else:
            pairs += [
                ("q_a_proj.weight", "wq_a.weight"),
                ("q_a_layernorm.weight", "q_norm.weight"),
                ("q_b_proj.weight", "wq_b.weight"),
            ]
        return [(hf + a, ours + b) for a, b in pairs]

    def _attention_entries(self, m: ModelConfig, i: int, export: bool) -> list[Entry]:
        mla = m.mla
        d_r = mla.qk_rope_head_dim
        reorder = {  # the rotary rows: per head of the queries, once in kv_a
            "wq.weight": mla.qk_nope_head_dim + d_r,
            "wq_b.weight": mla.qk_nope_head_dim + d_r,
            "wkv_a.weight": mla.kv_lora_rank + d_r,
        }
        interleaved = export or getattr(self, "_interleaved", True)
        out = []
        for theirs, ours in self._attention_pairs(m, i):
            dst, src = (theirs, ours) if export else (ours, theirs)
            width = reorder.get(ours.rsplit(".attn.", 1)[1])
            if width is None or not interleaved:
                out.append(rename(dst, src))
            else:
                out.append(Entry(dst, (src,), reorder_rope_rows(width, d_r, not export)))
        return out

    def _moe_entries(self, m: ModelConfig, i: int, export: bool) -> list[Entry]:
        hf, ours = f"model.layers.{i}.mlp.shared_experts.", f"layers.{i}.mlp.shared."
        shared = [(f"{hf}{name}.weight", f"{ours}{w}.weight") for w, name in self.names.items()]
        return super()._moe_entries(m, i, export) + [
            rename(a, b) if export else rename(b, a) for a, b in shared
        ]

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        plan = [e for e in super().export_plan(m) if ".self_attn." not in e.out]
        for i in range(m.n_layers):
            plan += self._attention_entries(m, i, export=True)
        return plan

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        plan = [e for e in super().import_plan(m, names) if ".attn." not in e.out]
        for i in range(m.n_layers):
            plan += self._attention_entries(m, i, export=False)
        return plan

    def router_bias_names(self, m: ModelConfig) -> dict[str, str]:
        return {
            f"layers.{i}.mlp.expert_bias": f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            for i in range(m.n_layers)
            if m.is_moe_layer(i)
        }

    def ignore_on_import(self, name: str) -> bool:
        return name.endswith(("rotary_emb.inv_freq", "e_score_correction_bias"))

    def beyond_blocks(self, m: ModelConfig, name: str) -> bool:
        match = _LAYER.match(name)
        return match is not None and int(match.group(1)) >= m.n_layers
