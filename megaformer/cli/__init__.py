"""``megaformer <subcommand>``: the command line.

One module per subcommand, each holding its parser (``add_parser``) and its handler (``run``);
:data:`SUBCOMMANDS` lists them in the order ``megaformer --help`` shows them, so a new subcommand
is one new module and one entry there. Parsers import nothing heavy; handlers import what they run.

User errors (:class:`~megaformer.errors.UserError`) end as one line on stderr and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from megaformer import __version__
from megaformer.cli import (
    bench,
    check,
    convert,
    env,
    flops,
    generate,
    plan,
    prepare_data,
    replay,
    report,
    train,
)
from megaformer.cli import eval as eval_command
from megaformer.cli import inspect as inspect_command
from megaformer.errors import ConfigError, DataError, UserError

EXIT_USER_ERROR = 2

SUBCOMMANDS = [
    train,
    generate,
    prepare_data,
    convert,
    inspect_command,
    flops,
    plan,
    report,
    replay,
    bench,
    check,
    env,
    eval_command,
]


def build_parser() -> argparse.ArgumentParser:
    """The ``megaformer`` parser with every subcommand's; each subparser carries its handler as
    ``run``."""
    parser = argparse.ArgumentParser(
        prog="megaformer", description="Distributed pretraining of decoder-only Transformers."
    )
    parser.add_argument("--version", action="version", version=f"megaformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(sub).set_defaults(run=command.run)
    return parser


CONFIG_ERROR_GRACE_S = 15.0  # how long ranks > 0 wait for rank 0 to print an error all ranks share


def _report(error: UserError) -> None:
    """One line on stderr. Under a launcher, errors that every rank meets alike (config and data
    errors: rank 0 finds them and shares them) are printed by rank 0 only: another rank waits for
    the launcher to stop it once rank 0 has exited, and prints its own line (naming its rank) only
    when that does not come; other errors may be rank-specific and name their rank at once."""
    rank = os.environ.get("RANK")
    if rank in (None, "", "0"):
        print(f"megaformer: error: {error}", file=sys.stderr)
        return
    if isinstance(error, (ConfigError, DataError)):
        import time

        time.sleep(CONFIG_ERROR_GRACE_S)
    print(f"megaformer: error (rank {rank}): {error}", file=sys.stderr)


def _parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse ``argv`` with overrides and flags in any order: KEY=VALUE words after a flag (which
    argparse leaves over once the positionals are filled) join the subcommand's overrides."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        overrides = [e for e in extra if "=" in e and not e.startswith("-")]
        if hasattr(args, "overrides") and len(overrides) == len(extra):
            args.overrides = list(args.overrides or []) + overrides
        else:
            parser.error(
                f"unrecognized arguments: {' '.join(e for e in extra if e not in overrides)}"
            )
    return args


# Third-party messages that say nothing about the user's run, dropped from those libraries' loggers
# (docs/troubleshooting.md lists them): torchao's CUDA/C++ extensions that do not load on a CPU-only
# torch (megaformer uses none of them; FP8 on CPU is emulated), and lm-evaluation-harness's advice
# about its own command line, repeated for every task with a custom dataset.
KNOWN_NOISE = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "lm_eval.api.task": ("Custom kwargs can be passed",),
}


class _DropPrefixes(logging.Filter):
    def __init__(self, messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        return not any(m in text for m in self.messages)


def quiet_known_noise() -> None:
    """Filters on the loggers of :data:`KNOWN_NOISE` (nothing is imported)."""
    for name, messages in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(messages))


def main(argv: Optional[Sequence[str]] = None) -> int:
    quiet_known_noise()
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    try:
        return args.run(args)
    except UserError as e:
        _report(e)
        return EXIT_USER_ERROR
    except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
        print(f"megaformer: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("megaformer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
