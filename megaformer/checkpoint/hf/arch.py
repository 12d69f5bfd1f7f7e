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

from typing import Any, Callable

from megaformer.checkpoint.hf.stream import Entry
from megaformer.config import ModelConfig
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

    # shared helpers --------------------------------------------------------------------------

    def need(self, m: ModelConfig, key: str, allowed: tuple, why: str) -> list[str]:
        """[] when ``model.key`` is one of ``allowed``, else a one-line refusal naming it."""
        value = getattr(m, key)
        if value in allowed:
            return []
        return [f"model.{key}={value} cannot be expressed by {self.hf_class} ({why})"]

    def refuse_hf(self, cond: bool, option: str, why: str) -> None:
        if cond:
            raise ConversionError(f"{self.hf_class} option {option} cannot be expressed by "
                                  f"megaformer's model ({why})")


def hf_get(hf: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present in the HF config dict (names differ between classes)."""
    for k in keys:
        if k in hf and hf[k] is not None:
            return hf[k]
    return default


def rope_params(hf: dict[str, Any], arch: Architecture, default_fraction: float) -> tuple[float, float]:
    """(theta, rotary fraction) from ``rope_parameters`` (transformers 5) or the legacy keys;
    scaled RoPE variants (linear, dynamic, yarn, llama3, ...) are refused by name."""
    rp = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    rope_type = rp.get("rope_type", rp.get("type", scaling.get("rope_type", scaling.get("type", "default"))))
    arch.refuse_hf(rope_type != "default", f"rope_type={rope_type}",
                   "only unscaled rotary embeddings are implemented")
    theta = rp.get("rope_theta", hf_get(hf, "rope_theta", "rotary_emb_base", default=10000.0))
    fraction = rp.get("partial_rotary_factor", hf_get(hf, "partial_rotary_factor", "rotary_pct",
                                                      default=default_fraction))
    return float(theta), float(fraction)


def layer_renames(n_layers: int, table: list[tuple[str, str]],
                  make: Callable[[str, str], Entry]) -> list[Entry]:
    """For each block i, ``make(out, src)`` over ``table`` with ``{i}`` filled in."""
    return [make(out.format(i=i), src.format(i=i)) for i in range(n_layers) for out, src in table]
