"""MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM <-> megaformer's MoE blocks
(:mod:`megaformer.model.moe`).

All are the Llama layout (:mod:`.llama`) whose FFN is, in the MoE blocks, a softmax top-k router
and E SwiGLU experts (Qwen2-MoE: plus one shared expert scaled by a sigmoid gate). Hugging Face stores each expert's matrices as separate
tensors; megaformer stacks them per block ([E, f, d] for w1 and w3, [E, d, f] for w2):

    Mixtral     block_sparse_moe.gate              <-> mlp.router
                block_sparse_moe.experts.{e}.w1/w3/w2  <-> mlp.experts.w1/w3/w2 [e]
    Qwen3-MoE   mlp.gate                           <-> mlp.router
                mlp.experts.{e}.gate/up/down_proj  <-> mlp.experts.w1/w3/w2 [e]
    Qwen2-MoE   as Qwen3-MoE, and
                mlp.shared_expert.gate/up/down_proj <-> mlp.shared.w1/w3/w2
                mlp.shared_expert_gate             <-> mlp.shared_gate  (y += sigmoid(x w_g) FFN_s(x))

Mixtral: every block MoE, the k weights renormalised (softmax over the top-k logits), the expert
width ``intermediate_size``, a sliding window as Mistral's. Qwen3-MoE: Qwen3's attention (q/k
norms, explicit head width), MoE in block i when (i + 1) % ``decoder_sparse_step`` == 0 (dense
``intermediate_size`` FFNs elsewhere, as megaformer's ``model.moe.interval``), expert width
``moe_intermediate_size``, renormalisation ``norm_topk_prob``. Qwen2-MoE: Qwen2's attention (q/k/v
biases), the sparse-step rule of Qwen3-MoE, and in every MoE block one shared expert of width
``shared_expert_intermediate_size`` with its gate (``model.moe.num_shared_experts: 1``,
``d_shared``, ``shared_gate: true``). The router's training-only settings
(auxiliary loss coefficient, jitter) do not change the function and are not carried over.
"""

from __future__ import annotations

from typing import Any

from megaformer.checkpoint.hf.arch import hf_get
from megaformer.checkpoint.hf.llama import LlamaFamily
from megaformer.checkpoint.hf.mistral import Mistral
from megaformer.checkpoint.hf.qwen import Qwen2, Qwen3
from megaformer.checkpoint.hf.stream import Entry, rename, stack
from megaformer.config import ModelConfig


def _pick(e: int):
    return lambda stacked: stacked[e]


class _MoEFamily(LlamaFamily):
    """A Llama-family class with softmax top-k MoE FFNs (no shared experts, no biases)."""

    router = ""  # HF name of block {i}'s router, after "model.layers.{i}."
    experts = ""  # HF prefix of expert {e}, after "model.layers.{i}."
    names = {"w1": "", "w3": "", "w2": ""}  # megaformer matrix -> HF matrix of one expert
    every_block = False  # the class has MoE in every block (no interval)

    def moe_refusals(self, m: ModelConfig) -> list[str]:
        moe, c = m.moe, self.hf_class
        if moe.interval == 0:
            return [f"model.moe.interval=0 cannot be expressed by {c} (its FFNs are MoE)"]
        out = []
        if self.every_block and moe.interval != 1:
            out.append(
                f"model.moe.interval={moe.interval} cannot be expressed by {c} (every block is MoE)"
            )
        for key, want, why in (
            ("score", "softmax", "its router is a softmax"),
            ("num_shared_experts", 0, "it has no shared experts"),
            ("dropless", True, "it computes every routed token"),
            ("bias_update_rate", 0.0, "its routing has no expert bias"),
            ("num_groups", 1, "its routing has no expert groups"),
            ("routed_scaling_factor", 1.0, "its expert weights are not scaled"),
            ("first_dense", 0, "its sparse step alone picks the MoE blocks"),
        ):
            if getattr(moe, key) != want:
                out.append(
                    f"model.moe.{key}={getattr(moe, key)} cannot be expressed by {c} ({why})"
                )
        return out

    def moe_config(self, m: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def moe_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        return {**super().hf_config(m), **self.moe_config(m)}

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = super().model_fields(hf)
        moe = self.moe_fields(hf)
        experts, k = moe["num_experts"], moe["top_k"]
        self.refuse_hf(
            not (1 <= k <= min(8, experts)),
            f"num_experts_per_tok={k}",
            f"megaformer routes each token to 1..8 of its {experts} experts",
        )
        fields["moe"] = {"score": "softmax", "dropless": True, "num_shared_experts": 0, **moe}
        return fields

    def _moe_entries(self, m: ModelConfig, i: int, export: bool) -> list[Entry]:
        hf = f"model.layers.{i}."
        ours = f"layers.{i}.mlp."
        router = rename(f"{hf}{self.router}.weight", f"{ours}router.weight")
        if not export:
            router = rename(f"{ours}router.weight", f"{hf}{self.router}.weight")
        out = [router]
        for w, name in self.names.items():
            per = [
                f"{hf}{self.experts.format(e=e)}.{name}.weight" for e in range(m.moe.num_experts)
            ]
            if export:
                out += [Entry(p, (f"{ours}experts.{w}",), _pick(e)) for e, p in enumerate(per)]
            else:
                out.append(stack(f"{ours}experts.{w}", tuple(per)))
        return out

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        moe = [i for i in range(m.n_layers) if m.is_moe_layer(i)]
        dense_ffn = tuple(f"model.layers.{i}.mlp." for i in moe)
        plan = [e for e in super().export_plan(m) if not e.out.startswith(dense_ffn)]
        for i in moe:
            plan += self._moe_entries(m, i, export=True)
        return plan

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        moe = [i for i in range(m.n_layers) if m.is_moe_layer(i)]
        dense_ffn = tuple(f"layers.{i}.mlp." for i in moe)
        plan = [e for e in super().import_plan(m, names) if not e.out.startswith(dense_ffn)]
        for i in moe:
            plan += self._moe_entries(m, i, export=False)
        return plan


class Mixtral(_MoEFamily, Mistral):
    name, hf_class, model_type = "mixtral", "MixtralForCausalLM", "mixtral"
    router = "block_sparse_moe.gate"
    experts = "block_sparse_moe.experts.{e}"
    names = {"w1": "w1", "w3": "w3", "w2": "w2"}
    every_block = True

    def moe_refusals(self, m: ModelConfig) -> list[str]:
        out = super().moe_refusals(m)
        if m.moe.interval and not m.moe.renormalize:
            out.append(
                f"model.moe.renormalize=false cannot be expressed by {self.hf_class} "
                "(its top-k weights are a softmax over the selected logits)"
            )
        return out

    def moe_config(self, m: ModelConfig) -> dict[str, Any]:
        return {
            "intermediate_size": m.expert_dim,
            "num_local_experts": m.moe.num_experts,
            "num_experts_per_tok": m.moe.top_k,
            "router_jitter_noise": 0.0,
        }

    def moe_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {
            "interval": 1,
            "num_experts": hf_get(hf, "num_local_experts", "num_experts", default=8),
            "top_k": hf.get("num_experts_per_tok", 2),
            "renormalize": True,
            "d_expert": hf["intermediate_size"],
        }


class Qwen3Moe(_MoEFamily, Qwen3):
    name, hf_class, model_type = "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"
    router = "mlp.gate"
    experts = "mlp.experts.{e}"
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def moe_config(self, m: ModelConfig) -> dict[str, Any]:
        return {
            "intermediate_size": m.ffn_dim,
            "moe_intermediate_size": m.expert_dim,
            "num_experts": m.moe.num_experts,
            "num_experts_per_tok": m.moe.top_k,
            "norm_topk_prob": m.moe.renormalize,
            "decoder_sparse_step": m.moe.interval,
            "mlp_only_layers": [],
        }

    def moe_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        self.refuse_hf(
            bool(hf.get("mlp_only_layers")),
            f"mlp_only_layers={hf.get('mlp_only_layers')}",
            "dense blocks are every block not picked by decoder_sparse_step",
        )
        experts = hf_get(hf, "num_experts", "num_local_experts", default=0)
        self.refuse_hf(experts < 1, f"num_experts={experts}", "an MoE model needs experts")
        return {
            "interval": hf.get("decoder_sparse_step", 1) or 1,
            "num_experts": experts,
            "top_k": hf.get("num_experts_per_tok", 2),
            "renormalize": bool(hf.get("norm_topk_prob", False)),
            "d_expert": hf["moe_intermediate_size"],
        }


class Qwen2Moe(_MoEFamily, Qwen2):
    name, hf_class, model_type = "qwen2_moe", "Qwen2MoeForCausalLM", "qwen2_moe"
    router = "mlp.gate"
    experts = "mlp.experts.{e}"
    names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def moe_refusals(self, m: ModelConfig) -> list[str]:
        out = [r for r in super().moe_refusals(m) if "num_shared_experts" not in r]
        moe = m.moe
        if moe.interval and (moe.num_shared_experts != 1 or not moe.shared_gate):
            out.append(
                f"model.moe.num_shared_experts={moe.num_shared_experts} with shared_gate="
                f"{str(moe.shared_gate).lower()} cannot be expressed by {self.hf_class} "
                "(each MoE block has one shared expert behind a sigmoid gate)"
            )
        return out

    def moe_config(self, m: ModelConfig) -> dict[str, Any]:
        return {
            "intermediate_size": m.ffn_dim,
            "moe_intermediate_size": m.expert_dim,
            "shared_expert_intermediate_size": m.shared_dim,
            "num_experts": m.moe.num_experts,
            "num_experts_per_tok": m.moe.top_k,
            "norm_topk_prob": m.moe.renormalize,
            "decoder_sparse_step": m.moe.interval,
            "mlp_only_layers": [],
            "qkv_bias": m.qkv_bias,
        }

    def moe_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        fields = Qwen3Moe.moe_fields(self, hf)  # type: ignore[arg-type]
        shared = hf.get("shared_expert_intermediate_size") or 0
        self.refuse_hf(
            shared < 1,
            f"shared_expert_intermediate_size={shared}",
            "its MoE blocks always hold a shared expert",
        )
        return {**fields, "num_shared_experts": 1, "d_shared": shared, "shared_gate": True}

    def bias_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        return {"bias": False, "qkv_bias": bool(hf.get("qkv_bias", True))}

    def _moe_entries(self, m: ModelConfig, i: int, export: bool) -> list[Entry]:
        hf, ours = f"model.layers.{i}.mlp.", f"layers.{i}.mlp."
        pairs = [
            (f"{hf}shared_expert.{name}.weight", f"{ours}shared.{w}.weight")
            for w, name in self.names.items()
        ]
        pairs.append((f"{hf}shared_expert_gate.weight", f"{ours}shared_gate.weight"))
        return super()._moe_entries(m, i, export) + [
            rename(theirs, mine) if export else rename(mine, theirs) for theirs, mine in pairs
        ]
