"""Building a :class:`~megaformer.config.root.Config`: YAML file -> dotted overrides -> type checks
per key (``Literal`` choices included) -> the static cross-key checks. Any problem raises
:class:`~megaformer.errors.ConfigError` with one line naming the key, the value and what is allowed,
before any process group starts."""

from __future__ import annotations

import dataclasses
import logging
import os
import typing
from pathlib import Path
from typing import Any, Optional

from megaformer.config.checks import validate
from megaformer.config.fields import choices, type_name
from megaformer.config.overrides import apply_overrides
from megaformer.config.root import SECTIONS, Config
from megaformer.config.yaml_safe import MAX_CONFIG_BYTES, safe_yaml_load
from megaformer.errors import ConfigError

log = logging.getLogger("megaformer")

# Keys that were renamed: (section, old name) -> new name. The old name is still read; in a config
# a user wrote (load_config: the YAML file and the overrides) with a warning, once per process, that
# names the new one. Configs saved in checkpoints are read without it.
RENAMED_KEYS = {("model", "fused_kernels"): "kernels"}
_warned: set[tuple[str, str]] = set()


def _current_name(section: str, key: str, values: dict, warn: bool) -> str:
    """``key`` as declared today: a renamed key's new name (with ``warn``, warned about once),
    else ``key``."""
    new = RENAMED_KEYS.get((section, key))
    if new is None:
        return key
    if new in values:
        raise ConfigError(
            f"{section}.{key} and {section}.{new}: the same key ({key} is its old "
            f"name); keep {section}.{new}"
        )
    if warn and (section, key) not in _warned:
        _warned.add((section, key))
        log.warning(
            "%s.%s is now called %s.%s; the old name will stop working in a later release",
            section,
            key,
            section,
            new,
        )
    return new


def _coerce(key: str, value: Any, tp: Any, warn: bool = False) -> Any:
    """Check ``value`` against the declared type ``tp`` (ints are accepted for floats; a
    ``Literal`` accepts only its values)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        if value is None:
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return _coerce(key, value, inner, warn)
    if origin is list:  # a single scalar is a one-element list
        items = value if isinstance(value, list) else [value]
        return [_coerce(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(items)]
    if dataclasses.is_dataclass(tp):  # a nested section, e.g. model.moe
        return _build_section(key, tp, value, warn)
    allowed = choices(tp)
    if allowed is not None:
        tp = type(allowed[0])
    ok = False
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            value = float(value)
    elif tp is str:
        if (
            value is False and allowed is not None and "off" in allowed
        ):  # YAML 1.1 reads off as false
            value = "off"
        ok = isinstance(value, str)
    elif tp is dict:
        ok = isinstance(value, dict)
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {type_name(tp)}, got {type(value).__name__}")
    if allowed is not None and value not in allowed:
        raise ConfigError(
            f"{key}={value!r}: must be one of {', '.join(str(c) for c in allowed)}"
            f"{_did_you_mean(value, allowed)}"
        )
    return value


def _did_you_mean(word: str, candidates: Any, prefix: str = "") -> str:
    """ ", did you mean 'x'?" for the closest candidate of a likely typo, else ""."""
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in candidates], n=1, cutoff=0.6)
    return f", did you mean '{prefix}{close[0]}'?" if close else ""


def _build_section(name: str, cls: type, values: Any, warn: bool = False) -> Any:
    """The section ``name`` of class ``cls`` from its mapping of keys, each checked against its
    declared type (old names of renamed keys accepted; with ``warn``, warned about)."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for written, value in values.items():
        key = _current_name(name, written, values, warn)
        if key not in fields:
            raise ConfigError(
                f"unknown config key '{name}.{key}'"
                f"{_did_you_mean(key, fields, name + '.')} "
                f"(known keys in '{name}': {', '.join(fields)})"
            )
        kwargs[key] = _coerce(f"{name}.{written}", value, hints[key], warn)
    return cls(**kwargs)


def config_from_dict(raw: dict, name: str = "megaformer", *, warn_renamed: bool = False) -> Config:
    """Build and validate a :class:`Config` from a nested dict; ``warn_renamed``: warn about the
    old names of renamed keys (:data:`RENAMED_KEYS`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a mapping of sections, got {type(raw).__name__}")
    known = list(SECTIONS) + ["deepspeed"]
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"unknown config section '{key}'{_did_you_mean(key, known)} "
                f"(known sections: {', '.join(known)})"
            )
    sections = {n: _build_section(n, cls, raw.get(n), warn_renamed) for n, cls in SECTIONS.items()}
    ds = raw.get("deepspeed") or {}
    if not isinstance(ds, dict):
        raise ConfigError(f"deepspeed: expected a mapping, got {type(ds).__name__}")
    cfg = Config(**sections, deepspeed=ds, name=name)
    validate(cfg)
    return cfg


def load_config(path: str | os.PathLike, overrides: Optional[list[str]] = None) -> Config:
    """Read a YAML config (safe loader), apply dotted overrides, validate."""
    from megaformer.safe_files import read_bounded, refuse_code_folders

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file not found: {p}")
    try:
        text = read_bounded(p, MAX_CONFIG_BYTES, ConfigError).decode()
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not a text file") from None
    raw = safe_yaml_load(text, str(p)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping of sections at the top level")
    refuse_code_folders(raw, p, ConfigError)
    raw = apply_overrides(raw, list(overrides or []))
    return config_from_dict(raw, name=p.stem, warn_renamed=True)
