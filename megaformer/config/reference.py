"""The configuration reference: every key with its type, default and documentation, read from the
declarations (``megaformer train --help-config`` and docs/configuration.md print it)."""

from __future__ import annotations

import dataclasses
import typing

from megaformer.config.deepspeed import deepspeed_keys_doc
from megaformer.config.fields import choices, type_name
from megaformer.config.root import SECTIONS


def describe_keys() -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every config key, in declaration order."""
    rows = []

    def add(prefix: str, cls: type) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):  # a nested section: its keys, dotted
                add(f"{prefix}.{f.name}", hints[f.name])
                continue
            allowed = choices(hints[f.name])
            doc = f.metadata.get("doc", "")
            if allowed:
                doc += " One of: " + ", ".join(str(c) for c in allowed) + "."
            default = f.default
            rows.append(
                (
                    f"{prefix}.{f.name}",
                    type_name(hints[f.name]),
                    "null" if default is None else repr(default).strip("'"),
                    doc,
                )
            )

    for section, cls in SECTIONS.items():
        add(section, cls)
    rows.append(
        (
            "deepspeed",
            "dict",
            "{}",
            "Passed through into the derived DeepSpeed config "
            "(deep-merged); batch, precision, clipping and ZeRO-stage keys are derived from the "
            "sections above and refused here. Only these reviewed keys are accepted (any other, "
            "e.g. checkpoint, monitors, NVMe offload or torch_autocast, is refused by name; "
            "DeepSpeed's universal-checkpoint loading is always off): "
            + deepspeed_keys_doc()
            + ".",
        )
    )
    return rows
