"""``python -m megaformer.cli.torchrun [TORCHRUN ARGS]``: torchrun (``torch.distributed.run``, the
same arguments) that ends the way its ranks did, without its own failure report.

Plain torchrun answers any failed rank with its traceback and a table of failures (~45 lines) and
exit code 1, whatever the rank's code was. Here the exit code is the first failed rank's (a signal
s as 128 + s), so a user error stays the single line rank 0 printed with exit code 2, Ctrl-C exits
130, and anything else adds one line naming the rank and its code (its traceback is above, in the
rank's own output). ``launch/torchrun.sh`` runs this.
"""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

EXIT_USER_ERROR = 2  # as megaformer.cli.EXIT_USER_ERROR (not imported: that loads every subcommand)
EXIT_INTERRUPTED = 130

# the agent's own lines about a failure, which the exit code and the ranks' output already say
AGENT_FAILURE_LINES = ("failed (exitcode", "Sending process")


class _QuietFailures(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(AGENT_FAILURE_LINES)


def exit_code(code: int) -> int:
    """A process's exit status as a shell reports it: a death by signal s is 128 + s."""
    return 128 - code if code < 0 else code


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_QuietFailures())
    try:
        torchrun.run(torchrun.parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = exit_code(failure.exitcode)
        if code not in (EXIT_USER_ERROR, EXIT_INTERRUPTED):  # those ranks said it already
            print(
                f"megaformer: rank {rank} exited with code {failure.exitcode} (its output is "
                f"above); {len(e.failures)} rank(s) failed",
                file=sys.stderr,
            )
        return code
    except SignalException as e:  # the launcher itself was signalled (Ctrl-C, SIGTERM)
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
