"""Declaring a config key: a dataclass field whose annotation is its type (a choice is a
``Literal[...]``, declared once: loading, the reference and ``--help-config`` read it) and whose
metadata carries its documentation."""

from __future__ import annotations

import typing
from dataclasses import field
from typing import Any, Literal, Optional


def option(default: Any, doc: str, factory: Any = None) -> Any:
    """A dataclass field carrying its documentation in metadata (``doc``)."""
    meta = {"doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _optional_inner(tp: Any) -> Any:
    """``X`` of ``Optional[X]``; ``tp`` itself otherwise."""
    if typing.get_origin(tp) is typing.Union:
        return [a for a in typing.get_args(tp) if a is not type(None)][0]
    return tp


def choices(tp: Any) -> Optional[tuple]:
    """The allowed values of a ``Literal[...]`` type (also inside Optional or list), else None."""
    tp = _optional_inner(tp)
    if typing.get_origin(tp) is list:
        tp = _optional_inner(typing.get_args(tp)[0])
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


def type_name(tp: Any) -> str:
    """The type as the reference prints it: ``int or null``, ``list of str``; a Literal by the type
    of its values (its choices are listed in the key's documentation)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return f"{type_name(_optional_inner(tp))} or null"
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if origin is Literal:
        return type(typing.get_args(tp)[0]).__name__
    return getattr(tp, "__name__", str(tp))
