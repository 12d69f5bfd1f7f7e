"""After a hang: what each rank was in, and one line naming the ranks that did not arrive.

When a rank's watchdog fires (or the rank receives SIGUSR2), :meth:`HangReport.dump` writes

    RUN_DIR/logs/collectives_rank_N.json    megaformer's record of the rank's collectives
                                            (:mod:`megaformer.comm.flight`: per group, how many it
                                            entered and left, the one it is in, the last ones)
    RUN_DIR/logs/nccl_trace_rank_N.pickle   on CUDA, NCCL's flight recorder (written only, for
                                            torch's fr_trace tool; megaformer never loads it)

and, :attr:`HangReport.gather_s` seconds later (the other ranks' watchdogs fire within a poll of
each other: the previous step ended in a collective), :meth:`HangReport.conclude` on the lowest
rank with a fresh dump -- rank 0, or the first rank still alive -- reads the dumps and appends to
``RUN_DIR/logs/hang.log`` (and its stderr and ``logs/rank_N.log``) one line::

    megaformer hang: all_reduce #3 on ranks 0-2 (16 bytes), waited 2.1 s by ranks 0,1: did not
    arrive: rank 2 (node7, at #2)

Reading the dumps is one small file per rank, once, after the hang.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from megaformer.comm import flight
from megaformer.safe_files import (
    json_or_none,
    make_dir,
    open_append,
    read_text_bounded,
    refuse_link,
    write_atomic,
)

HANG_LOG = "hang.log"
DUMP = "collectives_rank_{}.json"
NCCL_DUMP = "nccl_trace_rank_{}.pickle"
FRESH_S = 120.0  # dumps older than this (an earlier hang of the run) are not read
MAX_DUMP_BYTES = 1 << 22
NCCL_TRACE_ENTRIES = "2000"


def nccl_flight_recorder_env(logs: Path) -> None:
    """Turn NCCL's flight recorder on (unless the user set it): a ring of the last collectives per
    rank, dumped by :meth:`HangReport.dump` and by NCCL's own watchdog on a collective timeout.
    Set before the NCCL process group is created."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", NCCL_TRACE_ENTRIES)
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(logs / "nccl_trace_rank_"))


class HangReport:
    """Dumps this rank's collective record to ``logs`` and, on the first rank alive, names the
    ranks the others wait for."""

    def __init__(self, logs: Path, rank: int, gather_s: float = 5.0) -> None:
        self.logs, self.rank, self.gather_s = logs, rank, gather_s
        self.dumped_at: Optional[float] = None

    def dump(self) -> None:
        """This rank's record (and NCCL's, on CUDA) to ``logs``."""
        make_dir(self.logs)
        rec = flight.installed()
        snap = (
            rec.snapshot(self.rank)
            if rec is not None
            else {"rank": self.rank, "host": os.uname().nodename, "groups": [], "time": time.time()}
        )
        self.dumped_at = snap["time"]
        write_atomic(self.logs / DUMP.format(self.rank), json.dumps(snap), fsync=True)
        if torch.cuda.is_available() and torch.distributed.is_initialized():
            try:
                trace = torch._C._distributed_c10d._dump_nccl_trace()
            except (AttributeError, RuntimeError):  # no NCCL group, or a torch without it
                return
            path = self.logs / NCCL_DUMP.format(self.rank)
            refuse_link(path)
            write_atomic(path, trace, fsync=True)

    def dumps(self) -> dict[int, dict]:
        """The ranks' dumps of this hang (written within :data:`FRESH_S` of this rank's)."""
        found = {}
        since = (self.dumped_at or time.time()) - FRESH_S
        for path in self.logs.glob(DUMP.format("*")):
            if path.is_symlink() or not path.is_file():
                continue
            data = json_or_none(read_text_bounded(path, MAX_DUMP_BYTES))
            if isinstance(data, dict) and isinstance(data.get("rank"), int):
                if float(data.get("time", 0)) >= since:
                    found[data["rank"]] = data
        return found

    def conclude(self) -> Optional[str]:
        """After :attr:`gather_s`: on the lowest rank with a fresh dump, the hang line (written to
        ``logs/hang.log`` and stderr, and returned); None on the other ranks."""
        time.sleep(self.gather_s)
        dumps = self.dumps()
        if not dumps or min(dumps) != self.rank:
            return None
        line = flight.hang_line(dumps)
        with open_append(self.logs / HANG_LOG) as fh:
            fh.write(line + "\n")
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return line
