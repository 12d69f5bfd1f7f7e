"""Pipeline bubble, step time and per-rank activation memory of each schedule, measured beside the
schedules' formulas and the memory estimator.

    python tools/bench_pipeline.py [--stages 2 4] [--micro-batches 8 16]
        [--schedules 1f1b interleaved dualpipev] [--virtual-stages 2]

Runs DeepSpeed's pipeline engine (1F1B, its DualPipeV engine, or megaformer's interleaved engine
with v = --virtual-stages stages per rank) on gloo processes of this machine over equal-cost
stages, built as training builds them, and prints, for each PP, schedule and number of
micro-batches m:

* the measured bubble: per rank, 1 - (time in forward/backward compute) / (step time) from
  timestamps around each pass (less the time the interleaved engine waits inside a pass for the
  batch that brings its input), and the mean over ranks, beside the formula
  (:func:`megaformer.analysis.schedules.formula_bubble`: (p-1)/(m+p-1) under 1F1B,
  (p-1)/(vm+p-1) interleaved, (2p - 5/2)/(2p - 5/2 + 3m) under DualPipeV with a backward costing
  two forwards);
* the step time over 1F1B's at the same PP and m;
* per rank, the peak bytes of activations held for backward (saved-tensor hooks: a tensor counts
  from the moment autograd saves it until it is freed), the busiest rank's beside the estimator's
  activation bytes (:func:`megaformer.analysis.memory.activation_bytes`);
* for 1F1B, the per-stage peak with each recomputation mode.

On a CPU with fewer cores than ranks the processes share cores, so measured compute times include
contention; the idle fractions and the ratios are the point, not the absolute times.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import time
import weakref
from pathlib import Path
from typing import Any

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
    schedule_name: str,
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

    from megaformer.config import Config, ParallelConfig, TrainConfig
    from megaformer.parallel.build import build_model
    from megaformer.parallel.interleaved_engine import engine_for
    from megaformer.parallel.topology import build_topology
    from megaformer.training.distributed import disable_cpu_shm_comm_op

    disable_cpu_shm_comm_op()
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    topo = build_topology(world, rank, pp=world)
    cfg = model_config(args)
    run = Config(
        model=cfg,
        parallel=ParallelConfig(
            pipeline=world,
            pipeline_partition="layers",
            pipeline_schedule=schedule_name,
            pipeline_virtual_stages=args.virtual_stages,
        ),
        train=TrainConfig(seed=0, recompute=recompute),
    )
    pipe = build_model(run, topo).model  # the pipeline stages, as training builds them
    ds = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": m,
        "train_batch_size": args.batch * m,
        "steps_per_print": 2**31 - 1,
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
    }
    with engine_for(pipe):  # the interleaved schedule's engine for its module, as training
        engine, _, _, _ = deepspeed.initialize(
            model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=1e-4), config=ds
        )
    busy = [0.0]

    def timed(fn, sign: float = 1.0):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                busy[0] += sign * (time.perf_counter() - t0)

        return run

    from deepspeed.runtime.pipe import schedule

    # the engine dispatches instructions through a class-level map of functions
    engine._INSTRUCTION_MAP = dict(engine._INSTRUCTION_MAP)
    for kind in (schedule.ForwardPass, schedule.BackwardPass):
        engine._INSTRUCTION_MAP[kind] = timed(engine._INSTRUCTION_MAP[kind])
    if hasattr(engine, "_arrived"):  # the interleaved engine waits for a pass's input inside it
        engine._arrived = timed(engine._arrived, sign=-1.0)  # waiting, not computing
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


def run(
    world: int, args: argparse.Namespace, m: int, recompute: str, sched: str = "1f1b"
) -> list[tuple]:
    from megaformer.runtime.spawn import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_stage, args=(r, world, port, args, m, recompute, sched, q))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    res = []
    deadline = time.monotonic() + 900
    while len(res) < world:
        try:
            res.append(q.get(timeout=5))
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"{sched} at PP={world}, m={m}: ranks (rank, exit code) {dead}")
    for p in procs:
        p.join()
    return sorted(res)


def estimated_activations(args: argparse.Namespace, p: int, m: int, sched: str) -> float:
    """The memory estimator's activation bytes on the busiest rank of this layout."""
    from megaformer.analysis.memory import Layout, activation_bytes

    lay = Layout(
        pp=p,
        micro_batch=args.batch,
        grad_accum=m,
        precision="fp32",
        device="cpu",
        schedule=sched,
        virtual_stages=args.virtual_stages,
    )
    return activation_bytes(model_config(args), args.seq, lay, 257)["total"]


def model_config(args: argparse.Namespace) -> Any:
    from megaformer.config import ModelConfig

    return ModelConfig(
        vocab_size=257,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=8,
        max_seq_len=args.seq,
        tie_embeddings=False,
    )


def _cannot_run(schedule: str, p: int, m: int, v: int, layers: int) -> str:
    """Why ``schedule`` cannot run p ranks with m micro-batches over ``layers`` blocks ('' if it
    can)."""
    from megaformer.analysis.schedules import stages_per_rank

    stages = p * stages_per_rank(schedule, v)
    if stages > layers:
        return f"{stages} stages from {layers} layers"
    if schedule == "dualpipev" and m < 2 * p:
        return f"DualPipeV needs 2 x PP = {2 * p} micro-batches"
    if schedule == "interleaved" and m % p:
        return f"interleaved needs a multiple of PP = {p} micro-batches"
    return ""


def main() -> None:
    from megaformer.analysis.schedules import SCHEDULES, formula_bubble, schedule_label

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        choices=SCHEDULES,
    )
    ap.add_argument(
        "--virtual-stages", type=int, default=2, help="stages per rank, interleaved (2)"
    )
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--recompute-table", action="store_true", help="also 1F1B per recompute mode")
    args = ap.parse_args()
    print(
        f"{args.layers} layers, d_model {args.d_model}, seq {args.seq}, micro-batch "
        f"{args.batch}, fp32, gloo on {os.cpu_count()} CPU cores"
    )
    print(
        f"{'PP':>2} {'schedule':>15} {'m':>3} {'idle per rank (measured)':<26} {'mean':>5} "
        f"{'formula':>7} {'step s':>7} {'/1f1b':>6} {'act MB busiest':>14} {'estimator':>9}"
    )
    v = args.virtual_stages
    for p in args.stages:
        for m in args.micro_batches:
            base = None
            for sched in args.schedules:
                name = schedule_label(sched, v)
                why = _cannot_run(sched, p, m, v, args.layers)
                if why:
                    print(f"{p:>2} {name:>15} {m:>3} skipped: {why}")
                    continue
                res = run(p, args, m, "none", sched)
                idle = [1 - busy / step for _, busy, step, _ in res]
                step = max(step for _, _, step, _ in res)
                base = step if sched == "1f1b" else base
                ratio = f"{step / base:6.2f}" if base else f"{'':>6}"
                per = " ".join(f"{b:.2f}" for b in idle)
                peak = max(x for *_, x in res)
                est = estimated_activations(args, p, m, sched)
                print(
                    f"{p:>2} {name:>15} {m:>3} {per:<26} {sum(idle) / p:5.2f} "
                    f"{formula_bubble(sched, p, m, v):7.2f} {step:7.2f} {ratio} "
                    f"{peak / 1e6:14.2f} {est / 1e6:9.2f}"
                )
    if not args.recompute_table:
        return
    p, m = args.stages[-1], args.micro_batches[0]
    print(f"\n1F1B peak activation memory per stage (MB held for backward), PP={p}, m={m}:")
    print(f"{'recompute':<10} " + " ".join(f"{'stage ' + str(s):>9}" for s in range(p)))
    for mode in ("none", "selective", "full"):
        res = run(p, args, m, mode)
        print(f"{mode:<10} " + " ".join(f"{peak / 1e6:9.2f}" for *_, peak in res))


if __name__ == "__main__":
    main()
