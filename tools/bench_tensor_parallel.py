"""Tensor-parallel communication volume and throughput, measured beside the analytical numbers.

    python tools/bench_tensor_parallel.py [--d-model 256] [--layers 4] [--seq 256] [--batch 4]

For TP = 1, 2, 4 (gloo processes on this machine), without and with sequence parallelism, it runs
training steps of a Llama-style model and prints

* the bytes each rank sends per step in the Transformer layers, counted by wrapping the collectives
  (ring-algorithm volumes, see megaformer/comm/tensor_parallel.py), beside Megatron's analytical volume
  of 4 all-reduces of b·s·h per layer per step (= 4 · 2(p-1)/p · b·s·h · 4 bytes in fp32; sequence
  parallelism: 4 all-gathers + 4 reduce-scatters of b·s·h, the same volume), and their ratio;
* the whole step's bytes beside the analytical total (layers + embedding + output head + loss);
* tokens/s per step on this machine (CPU: communication-bound, not a GPU figure).

The per-layer figure is measured as (bytes with L layers - bytes with L/2 layers) / (L/2).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _one(
    rank: int,
    world: int,
    port: int,
    args: argparse.Namespace,
    sp: bool,
    layers: int,
    out: "mp.Queue",
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist

    from megaformer.comm import CommCounter
    from megaformer.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = ModelConfig(
        vocab_size=257, d_model=args.d_model, n_layers=layers, n_heads=8, max_seq_len=args.seq
    )
    topo = build_topology(world, rank, tp=world)
    run = Config(
        model=cfg,
        parallel=ParallelConfig(tensor=world, sequence_parallel=sp),
        train=TrainConfig(seed=0, recompute="none"),
    )
    model = build_model(run, topo).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 257, (args.batch, args.seq), generator=gen)
    times, counted = [], None
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        with CommCounter() as counter:
            opt.zero_grad()
            model(x, x).backward()
            opt.step()
        times.append(time.perf_counter() - t0)
        counted = counter
    out.put(
        (rank, counted.total_bytes, dict(counted.calls), sum(times[args.warmup :]) / args.steps)
    )
    dist.destroy_process_group()


def measure(world: int, args: argparse.Namespace, sp: bool, layers: int) -> tuple[int, float]:
    from megaformer.runtime.spawn import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_one, args=(r, world, port, args, sp, layers, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = [q.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    rank0 = next(r for r in results if r[0] == 0)
    return rank0[1], max(r[3] for r in results)


def analytic(world: int, args: argparse.Namespace, sp: bool, layers: int) -> tuple[float, float]:
    """(per-layer bytes, whole-step bytes) each rank sends, fp32, ring algorithms."""
    if world == 1:
        return 0.0, 0.0
    p = world
    bsh = args.batch * args.seq * args.d_model * 4
    ar, ag_rs = 2 * (p - 1) / p, (p - 1) / p
    per_layer = 4 * ar * bsh  # == 4 * (ag_rs + ag_rs) * bsh with SP
    head = 2 * ar * bsh  # embedding all-reduce (fwd) + output-head input all-reduce (bwd)
    if sp:
        head += 2 * ag_rs * bsh  # entering SP: all-gather in bwd; leaving SP: all-gather in fwd
    loss = 3 * ar * args.batch * args.seq * 4  # max, target logit, sum of exponentials
    return per_layer, layers * per_layer + head + loss


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    tokens = args.batch * args.seq
    header = (
        f"{'layout':<10} {'layer MB/step':>14} {'analytic':>10} {'ratio':>6} "
        f"{'step MB':>9} {'analytic':>9} {'ratio':>6} {'tokens/s':>9}"
    )
    print(
        f"model: d_model {args.d_model}, {args.layers} layers, seq {args.seq}, micro-batch "
        f"{args.batch}, fp32; bytes sent per rank per training step"
    )
    print(header)
    print("-" * len(header))
    for tp in args.tp:
        for sp in [False] if tp == 1 else [False, True]:
            full, t = measure(tp, args, sp, args.layers)
            half, _ = measure(tp, args, sp, args.layers // 2)
            per_layer = (full - half) / (args.layers - args.layers // 2)
            a_layer, a_total = analytic(tp, args, sp, args.layers)
            ratio = lambda m, a: f"{m / a:6.2f}" if a else "   n/a"  # noqa: E731
            name = f"TP={tp}{' +SP' if sp else ''}"
            print(
                f"{name:<10} {per_layer / 1e6:14.3f} {a_layer / 1e6:10.3f} {ratio(per_layer, a_layer)} "
                f"{full / 1e6:9.3f} {a_total / 1e6:9.3f} {ratio(full, a_total)} {tokens / t:9,.0f}"
            )


if __name__ == "__main__":
    main()
