"""Hang attribution on gloo: a rank that skips a collective is named by the one hang line the
first rank alive writes when the watchdogs fire; SIGUSR2 dumps the same without stopping."""

from __future__ import annotations

import datetime
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megaformer.comm import all_reduce_mean, flight
from megaformer.training.hang import HangReport
from megaformer.training.watchdog import StepWatchdog
from tests.dist_harness import run_ranks

SKIPPER = 2


def _skip_a_collective(rank: int, world: int, run_dir: str) -> str:
    """Three steps of one all-reduce each; rank 2 skips the third step's and stalls instead. The
    watchdogs fire (1.5 s floor), every rank dumps its record, rank 0 writes the line; the group's
    12 s timeout then ends the waiting ranks' all-reduce."""
    flight.recorder()
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=12))
    logs = Path(run_dir) / "logs"
    dog = StepWatchdog(
        factor=3,
        min_seconds=1.5,
        log_path=logs / f"rank_{rank}.log",
        rank=rank,
        poll_seconds=0.1,
        hang=HangReport(logs, rank, gather_s=3.0),
        exit_process=False,
    )
    outcome = "finished"
    try:
        for step in (1, 2, 3):
            dog.step_started(step)
            if step == 3 and rank == SKIPPER:
                time.sleep(8)  # never calls the third all-reduce
                outcome = "skipped"
                break
            try:
                all_reduce_mean(torch.ones(4), group)
            except RuntimeError:  # the group's timeout: rank 2 never came
                outcome = "timed out"
                break
            dog.step_finished()
    finally:
        dog.close()
    return outcome


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_that_skips_a_collective_is_named(tmp_path):
    outcomes = run_ranks(3, _skip_a_collective, str(tmp_path), timeout=120)
    assert outcomes == ["timed out", "timed out", "skipped"]
    lines = (tmp_path / "logs" / "hang.log").read_text().splitlines()
    print(lines[0])
    assert len(lines) == 1, lines  # one line, from rank 0
    line = lines[0]
    assert line.startswith("megaformer hang: all_reduce #3 on ranks 0-2 (16 bytes)"), line
    assert "by ranks 0,1: did not arrive: rank 2 (" in line and ", at #2)" in line
    for rank in range(3):
        assert (tmp_path / "logs" / f"collectives_rank_{rank}.json").is_file()
        assert "Thread 0x" in (tmp_path / "logs" / f"rank_{rank}.log").read_text()


def test_sigusr2_dumps_stacks_and_record_and_the_run_goes_on(tmp_path):
    logs = tmp_path / "logs"
    dog = StepWatchdog(
        factor=4,
        min_seconds=60,
        log_path=logs / "rank_0.log",
        rank=0,
        poll_seconds=0.05,
        hang=HangReport(logs, 0, gather_s=0.0),
    )
    try:
        dog.step_started(1)
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 20
        while not (logs / "hang.log").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.close()
    assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None)
    text = (logs / "rank_0.log").read_text()
    assert "SIGUSR2 received in step 1" in text and "Thread 0x" in text
    assert (logs / "collectives_rank_0.json").is_file()
    assert "megaformer hang: no collective is waiting" in (logs / "hang.log").read_text()
