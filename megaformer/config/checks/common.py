"""The two shapes every static check takes: a condition with its one-line message, a bound."""

from __future__ import annotations

from typing import Optional

from megaformer.errors import ConfigError


def require(cond: bool, msg: str) -> None:
    """ConfigError(``msg``) unless ``cond``."""
    if not cond:
        raise ConfigError(msg)


def positive(key: str, value: Optional[float], allow_zero: bool = False) -> None:
    """ConfigError unless ``value`` is None or > 0 (>= 0 with ``allow_zero``)."""
    if value is None:
        return
    ok = value >= 0 if allow_zero else value > 0
    require(ok, f"{key}={value}: must be {'>= 0' if allow_zero else '> 0'}")
