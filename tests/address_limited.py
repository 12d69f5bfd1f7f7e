"""``python -m tests.address_limited LIMIT ARGS``: ``megaformer ARGS`` with the process's address
space capped at LIMIT bytes (``RLIMIT_AS``), so that an allocation sized by a crafted file fails
in this process, never on the machine. Tests run it on a rank forked from the preloaded server
(``tests.helpers.run_module``): the cap applies to that process alone."""

from __future__ import annotations

import resource
import sys

if __name__ == "__main__":
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from megaformer.cli import main

    sys.exit(main(sys.argv[2:]))
