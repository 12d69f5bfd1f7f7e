"""What every Hugging Face architecture adapter provides, and the checks they share.

An adapter translates both ways between megaformer's model (``ModelConfig`` + state-dict names,
see megaformer/model/) and one ``transformers`` class:

- ``refusals(m)``: the megaformer features the class cannot express, each named (empty = exportable);
- ``hf_config(m)`` / ``model_fields(hf)``: the config in each direction (``model_fields`` refuses, by
  name, HF options megaformer's model cannot reproduce);
- ``export_plan(m)`` / ``import_plan(m, names)``: tensor by tensor, how each output is made of inputs
  (:class:`~megaformer.checkpoint.hf.stream.Entry`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from megaformer.checkpoint.hf.stream import Entry
from megaformer.config import ROPE_SCALING_KEYS, ModelConfig
from megaformer.errors import ConversionError


class Architecture:
    name: str = ""
    hf_class: str = ""
    model_type: str = ""

    def refusals(self, m: ModelConfig) -> list[str]:
        raise NotImplementedError

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def export_plan(self, m: ModelConfig) -> list[Entry]:
        raise NotImplementedError

    def import_plan(self, m: ModelConfig, names: set[str]) -> list[Entry]:
        raise NotImplementedError

    def ignore_on_import(self, name: str) -> bool:
        """Source tensors that carry no weights (old checkpoints' cached buffers)."""
        return False

    def router_bias_names(self, m: ModelConfig) -> dict[str, str]:
        """The MoE blocks' aux-loss-free biases the class stores with its weights: megaformer's
        router-state name -> the class's tensor name (none for most classes)."""
        return {}

    def beyond_blocks(self, m: ModelConfig, name: str) -> bool:
        """Source tensors of modules past the model's blocks that are not imported (DeepSeek's
        multi-token prediction modules)."""
        return False

    def moe_refusals(self, m: ModelConfig) -> list[str]:
        """Refusals of the Mixture-of-Experts options (a dense class: any MoE block)."""
        if m.moe.interval > 0:
            return [
                f"model.moe.interval={m.moe.interval} cannot be expressed by {self.hf_class} "
                "(its FFNs are dense)"
            ]
        return []

    def all_refusals(self, m: ModelConfig) -> list[str]:
        """Every reason this class cannot express ``m`` (empty = exportable)."""
        return self.refusals(m) + self.moe_refusals(m)

    # shared helpers --------------------------------------------------------------------------

    def need(self, m: ModelConfig, key: str, allowed: tuple, why: str) -> list[str]:
        """[] when ``model.key`` is one of ``allowed``, else a one-line refusal naming it."""
        value = getattr(m, key)
        if value in allowed:
            return []
        return [f"model.{key}={value} cannot be expressed by {self.hf_class} ({why})"]

    def attention_refusals(
        self,
        m: ModelConfig,
        *,
        head_dim: bool = False,
        qk_norm: bool = False,
        window: bool = False,
        scaling: bool = False,
    ) -> list[str]:
        """Refusals of the attention options this class lacks (those passed as True it has):
        an explicit head width, q/k norms, a sliding window, scaled rotary frequencies."""
        out = []
        if not head_dim and m.head_dim * m.n_heads != m.d_model:
            out.append(
                f"model.head_dim={m.head_dim} cannot be expressed by {self.hf_class} (its "
                f"heads have d_model / n_heads = {m.d_model / m.n_heads:g} dimensions)"
            )
        if not qk_norm and m.qk_norm:
            out.append(
                f"model.qk_norm=true cannot be expressed by {self.hf_class} (it has no "
                "query/key norms)"
            )
        if not window and m.sliding_window is not None:
            out.append(
                f"model.sliding_window={m.sliding_window} cannot be expressed by "
                f"{self.hf_class} (it attends to the whole causal context)"
            )
        if not scaling and m.rope_scaling is not None:
            out.append(
                f"model.rope_scaling={m.rope_scaling.get('rope_type')} cannot be expressed "
                f"by {self.hf_class} (only unscaled rotary embeddings are exported to it)"
            )
        return out

    def refuse_hf(self, cond: bool, option: str, why: str) -> None:
        if cond:
            raise ConversionError(
                f"{self.hf_class} option {option} cannot be expressed by megaformer's model ({why})"
            )


def hf_get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present in the HF config dict (names differ between classes)."""
    for k in keys:
        if k in hf and hf[k] is not None:
            return hf[k]
    return default


def rope_params(
    hf: dict[str, Any], arch: Architecture, default_fraction: float, scaled: tuple[str, ...] = ()
) -> tuple[float, float, Optional[dict]]:
    """(theta, rotary fraction, ``model.rope_scaling``) from ``rope_parameters`` (transformers 5)
    or the legacy keys. Scaled variants in ``scaled`` (llama3, yarn) become a rope_scaling dict
    (the keys transformers reads for them); any other (linear, dynamic, longrope, ...) is refused
    by name."""
    rp = dict(hf.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in rp.values()):
        arch.refuse_hf(
            True, "rope_parameters per layer type", "one rotary embedding serves all layers"
        )
    legacy = hf.get("rope_scaling") or {}
    rp = {**legacy, **rp}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    arch.refuse_hf(
        rope_type != "default" and rope_type not in scaled,
        f"rope_type={rope_type}",
        "the rotary scalings implemented are "
        + (", ".join(scaled) if scaled else "none (unscaled only)"),
    )
    theta = rp.get("rope_theta", hf_get(hf, "rope_theta", "rotary_emb_base", default=10000.0))
    fraction = rp.get(
        "partial_rotary_factor",
        hf_get(hf, "partial_rotary_factor", "rotary_pct", default=default_fraction),
    )
    if rope_type == "default":
        return float(theta), float(fraction), None
    required, optional = ROPE_SCALING_KEYS[rope_type]
    scaling = {k: rp[k] for k in sorted(required | optional) if rp.get(k) is not None}
    scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    if rope_type == "yarn" and scaling.get("factor") is None:  # transformers' implicit factor
        scaling["factor"] = (
            hf["max_position_embeddings"] / scaling["original_max_position_embeddings"]
        )
    missing = sorted(required - set(scaling))
    arch.refuse_hf(
        bool(missing),
        f"rope_type={rope_type} without {', '.join(missing)}",
        "the scaling is undefined without it",
    )
    return float(theta), float(fraction), {"rope_type": rope_type, **scaling}


def layer_renames(
    n_layers: int, table: list[tuple[str, str]], make: Callable[[str, str], Entry]
) -> list[Entry]:
    """For each block i, ``make(out, src)`` over ``table`` with ``{i}`` filled in."""
    return [make(out.format(i=i), src.format(i=i)) for i in range(n_layers) for out, src in table]
