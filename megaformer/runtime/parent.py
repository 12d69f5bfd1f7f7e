"""Ending with the launcher: a rank whose launcher died (``kill -9`` of torchrun, a lost ssh
session) exits instead of training on unsupervised.

A daemon thread compares ``os.getppid()`` with the parent the process started under, every
:data:`POLL_S` seconds; when the parent is gone the process is re-parented (to init or a
subreaper), the two differ, and the thread ends the process at once with ``os._exit``: nothing is
saved, and a checkpoint being written then stays a temporary folder that the next start
ignores (only complete checkpoints are ever renamed into place). Polling works on every POSIX
system; Linux's ``PR_SET_PDEATHSIG`` would fire when the launcher's *thread* that started the
rank ends, which is not the launcher ending.
"""

from __future__ import annotations

import os
import sys
import threading
import time

POLL_S = 1.0
EXIT_ORPHANED = 1


def exit_with_parent(poll_s: float = POLL_S) -> threading.Thread:
    """Start the watch (daemon thread) on the current parent process; returns the thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        rank = os.environ.get("RANK", "?")
        try:
            print(
                f"megaformer: rank {rank}: the launcher (pid {parent}) is gone; exiting without "
                "saving",
                file=sys.stderr,
                flush=True,
            )
        except (OSError, ValueError):  # its stderr may have gone with it
            pass
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="megaformer-parent-watch", daemon=True)
    thread.start()
    return thread
