"""Run a function on N gloo processes on this machine and collect what each rank returns.

    results = run_ranks(4, my_test_fn, arg1, arg2)   # -> [rank0_result, ..., rank3_result]

``fn(rank, world_size, *args)`` must be importable at module level (processes are spawned). The
default group is gloo's, or ``backend`` (``"cuda:gloo"``: gloo serving CUDA tensors only, NCCL's
device map, so a host tensor on it fails as on NCCL). A rank
that raises makes ``run_ranks`` raise with that rank's traceback; a hang ends at ``timeout``.
Later issues (pipeline, checkpoints, diagnostics) reuse this harness.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from tests.helpers import free_port


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, out: Any,
            backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # plain pickle: tensors travel by value, not as shared memory that dies with this process
        out.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including assertion errors, to the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 300,
              backend: str = "gloo") -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, out, backend),
                         daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = out.get(timeout=timeout)
            if status == "error":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)  # our own child processes' results
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(results))} did not "
                             f"finish within {timeout}s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]
