"""Reading YAML safely: PyYAML's safe loader without anchors or aliases, bounded size."""

from __future__ import annotations

from typing import Any

import yaml

from megaformer.errors import ConfigError

MAX_CONFIG_BYTES = 4 * 1024 * 1024


class SafeNoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing anchors and aliases (``&a`` / ``*a``): a config never needs
    them, and nested aliases expand exponentially (an "alias bomb")."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(
                None,
                None,
                "YAML anchors and aliases (&name / *name) are not accepted in configs",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def safe_yaml_load(text: str, where: str) -> Any:
    """``yaml.safe_load`` without anchors/aliases; errors as ConfigError naming ``where``."""
    try:
        return yaml.load(text, Loader=SafeNoAliasLoader)
    except (RecursionError, ValueError) as e:  # nesting deeper than Python recurses, huge ints
        from megaformer.safe_files import unreadable_reason

        raise ConfigError(f"{where}: {unreadable_reason(e)}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None)
        if problem and "anchors and aliases" in problem:
            raise ConfigError(f"{where}: {problem}{at}") from None
        raise ConfigError(f"{where}: not valid YAML{at}") from None
