"""While rank 0 builds data indices, the other ranks wait past the training collective timeout."""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch.distributed as tdist

from tests.dist_harness import run_ranks
from tests.helpers import free_port


def _slow_rank0(rank: int, world: int, port: int) -> float:
    from megaformer.data.wait import wait_barrier

    # a default group whose timeout (2 s) is shorter than rank 0's build (4 s)
    tdist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port)
    tdist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=2)
    )
    barrier = wait_barrier(tdist.barrier)
    t0 = time.perf_counter()
    if rank == 0:
        time.sleep(4)
    barrier()
    waited = time.perf_counter() - t0
    tdist.barrier()  # the default group still works afterwards
    return waited


@pytest.mark.multiprocess
def test_ranks_wait_for_rank0_beyond_the_collective_timeout():
    waited = run_ranks(2, _slow_rank0, free_port(), timeout=120)
    assert waited[1] >= 3.9  # rank 1 waited the whole build, longer than the 2 s timeout
