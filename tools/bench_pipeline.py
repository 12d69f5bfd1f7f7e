"""Pipeline bubble and per-stage activation memory, measured beside the 1F1B theory.

    python tools/bench_pipeline.py [--stages 4] [--micro-batches 4 8 16] [--layers 8]

Runs DeepSpeed's pipeline engine (1F1B) on gloo processes of this machine and prints, for each
number of micro-batches m:

* the measured bubble: per stage, 1 - (time in forward/backward compute) / (step time), the mean
  over stages, beside the theory (p-1)/(m+p-1);
* per stage, the peak bytes of activations held for backward (saved-tensor hooks: a tensor counts
  from the moment autograd saves it until it is freed) without recomputation and with each
  recomputation mode.

On a CPU with fewer cores than stages the processes share cores, so measured compute times include
contention; the numbers are for checking the schedule's shape, not GPU timings.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class LiveActivations:
    """Peak bytes of tensors saved for backward that are still alive."""

    def __init__(self) -> None:
        self.live: dict[int, list] = {}
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._release, key)
        return t

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]


def _stage(
    rank: int,
    world: int,
    port: int,
    args: argparse.Namespace,
    m: int,
    recompute: str,
    out: "mp.Queue",
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    import logging

    import deepspeed

    from megaformer.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    topo = build_topology(world, rank, pp=world)
    cfg = ModelConfig(
        vocab_size=257,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=8,
        max_seq_len=args.seq,
        tie_embeddings=False,
    )
    run = Config(
        model=cfg,
        parallel=ParallelConfig(pipeline=world, pipeline_partition="layers"),
        train=TrainConfig(seed=0, recompute=recompute),
    )
    pipe = build_model(run, topo).model  # the pipeline stages, as training builds them
    ds = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": m,
        "train_batch_size": args.batch * m,
        "steps_per_print": 2**31 - 1,
    }
    engine, _, _, _ = deepspeed.initialize(
        model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=1e-4), config=ds
    )
    busy = [0.0]

    def timed(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                busy[0] += time.perf_counter() - t0

        return run

    from deepspeed.runtime.pipe import schedule

    # the engine dispatches instructions through a class-level map of functions
    engine._INSTRUCTION_MAP = dict(engine._INSTRUCTION_MAP)
    for kind in (schedule.ForwardPass, schedule.BackwardPass):
        engine._INSTRUCTION_MAP[kind] = timed(engine._INSTRUCTION_MAP[kind])
    x = torch.randint(0, 257, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batches = [(x, x)] * m
    engine.train_batch(iter(batches))  # warm-up
    tracker = LiveActivations()
    step_times, busy_times = [], []
    for _ in range(args.steps):
        busy[0] = 0.0
        torch.distributed.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            engine.train_batch(iter(batches))
        step_times.append(time.perf_counter() - t0)
        busy_times.append(busy[0])
    out.put(
        (rank, sum(busy_times) / len(busy_times), sum(step_times) / len(step_times), tracker.peak)
    )


def run(world: int, args: argparse.Namespace, m: int, recompute: str) -> list[tuple]:
    from megaformer.runtime.spawn import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_stage, args=(r, world, port, args, m, recompute, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    p = args.stages
    print(
        f"PP={p}, {args.layers} layers, d_model {args.d_model}, seq {args.seq}, micro-batch "
        f"{args.batch}, fp32, gloo on {os.cpu_count()} CPU cores"
    )
    print(f"{'m':>3} {'bubble (measured, per stage)':<34} {'mean':>6} {'theory':>7}")
    for m in args.micro_batches:
        res = run(p, args, m, "none")
        bubbles = [1 - busy / step for _, busy, step, _ in res]
        per = " ".join(f"{b:.2f}" for b in bubbles)
        print(f"{m:>3} {per:<34} {sum(bubbles) / p:6.2f} {(p - 1) / (m + p - 1):7.2f}")
    m = args.micro_batches[0]
    print(f"\npeak activation memory per stage (MB held for backward), m={m}:")
    print(f"{'recompute':<10} " + " ".join(f"{'stage ' + str(s):>9}" for s in range(p)))
    for mode in ("none", "selective", "full"):
        res = run(p, args, m, mode)
        print(f"{mode:<10} " + " ".join(f"{peak / 1e6:9.2f}" for *_, peak in res))


if __name__ == "__main__":
    main()
