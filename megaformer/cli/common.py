"""What several subcommands share: the CONFIG and KEY=VALUE arguments, and loading them."""

from __future__ import annotations

import argparse
from typing import Any


def config_args(p: argparse.ArgumentParser) -> None:
    """CONFIG, KEY=VALUE overrides and --json."""
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. train.global_batch_size=512")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def load(args: argparse.Namespace) -> Any:
    """The validated config of ``args.config`` with ``args.overrides``."""
    from megaformer.config import load_config

    return load_config(args.config, args.overrides)
