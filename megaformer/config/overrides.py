"""Dotted overrides: ``train.steps=50`` strings applied to the nested dict of a YAML config."""

from __future__ import annotations

from typing import Any

import yaml

from megaformer.config.yaml_safe import SafeNoAliasLoader
from megaformer.errors import ConfigError


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}': expected KEY=VALUE, e.g. train.steps=50")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override '{item}': key must be dotted, SECTION.KEY (e.g. train.steps)")
    try:
        value = yaml.load(raw, Loader=SafeNoAliasLoader) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=value`` strings to a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        parts, value = _parse_override(item)
        node = raw
        for p in parts[:-1]:
            child = node.get(p)
            if child is None:
                child = node[p] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{p}' is not a section")
            node = child
        node[parts[-1]] = value
    return raw
