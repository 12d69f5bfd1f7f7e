"""Mixture-of-Experts: expert-parallel step time, all-to-all volume and load balance.

    python tools/bench_moe.py [--d-model 128] [--layers 2] [--experts 8] [--top-k 2] [--seq 128]
                              [--batch 4] [--steps 6] [--balance-steps 200] [--only dispatch]

1. Step time of an MoE model (every block MoE, E experts, top-k, expert width f_e) at EP = 1, 2, 4
   (gloo processes on this machine, EP = DP: each rank routes its own micro-batch) beside the
   dense model of the same active parameters (FFN width k·f_e, one process, the same micro-batch):
   ms per training step (forward, backward, AdamW) per rank and the ratio to the dense model.
2. The all-to-all bytes each rank sends per step, counted in the dispatch (rows that leave the
   rank, :class:`megaformer.comm.CommCounter`), beside the analytical volume for uniform routing

       4 · L_moe · b·s·k · (P-1)/P · d · 4 bytes      (dispatch + combine, forward + backward)

   and the volume the step's actual routing implies (4 crossings of every off-rank assignment,
   counted from the routing itself; mean over the ranks); the count must equal the latter exactly.
3. Expert dispatch under TP 2 x EP 2 (4 gloo processes, one micro-batch, the same on every
   rank): host reads per training step inside the MoE blocks' forward and backward passes
   (``Tensor.tolist`` / ``item`` / ``cpu`` / ``int`` / ``float`` / ``bool`` calls: each a stream
   synchronisation on CUDA) and all-to-all bytes per rank, for the uneven exchange
   (``parallel.expert_dispatch=splits``) and the fixed-size one (``padded``), at TP 1 and TP 2.
   Before the token split every TP rank dispatched the whole micro-batch: TP 1's bytes per rank.
   On CPU the experts' loop reads its row counts once more per block (on CUDA the grouped GEMM
   does not); the padded exchange runs the grouped GEMM everywhere.
4. Expert-load balance over ``--balance-steps`` steps on text (bytes of Python's standard library,
   one process): the coefficient of variation (std / mean) of the per-expert load, mean over the
   blocks, with the load-balancing loss, with the auxiliary-loss-free bias, and with neither.

CPU figures (one thread per process, communication through loopback, processes sharing the
cores): the point is the volume and the balance, not the speed of a GPU cluster.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _model_cfg(args: argparse.Namespace, moe: bool, **moe_kw):
    from megaformer.config import ModelConfig, MoEConfig

    base = dict(
        vocab_size=256, d_model=args.d_model, n_layers=args.layers, n_heads=4, max_seq_len=args.seq
    )
    if not moe:  # the dense model of the same active FFN width
        return ModelConfig(**base, d_ffn=args.top_k * args.d_expert)
    kw = dict(
        interval=1,
        num_experts=args.experts,
        top_k=args.top_k,
        d_expert=args.d_expert,
        aux_loss_coef=0.01,
    )
    kw.update(moe_kw)
    return ModelConfig(**base, moe=MoEConfig(**kw))


def _timed(
    rank: int, world: int, port: int, args: argparse.Namespace, moe: bool, out: "mp.Queue"
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # every rank, and the dense model, on one core: per-rank work compared
    import torch.distributed as dist

    from megaformer.comm import CommCounter
    from megaformer.config import Config, ParallelConfig, TrainConfig
    from megaformer.model.moe import end_of_step, moe_layers
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology

    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = Config(
        model=_model_cfg(args, moe),
        parallel=ParallelConfig(expert=world),
        train=TrainConfig(seed=0, recompute="none"),
    )
    topo = build_topology(world, rank, ep=world)
    model = build_model(cfg, topo).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
    times, sent, implied = [], [], []
    local = args.experts // world
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        with CommCounter() as counter:
            opt.zero_grad()
            model(x, x).backward()
            opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        # rows this step's routing sends off this rank: assignments to other ranks' experts
        off = sum(
            int(m.step_load.sum() - m.step_load[rank * local : (rank + 1) * local].sum())
            for m in moe_layers(model)
        )
        sent.append(counter.bytes.get("all_to_all", 0))
        implied.append(off)
        end_of_step(model)
    k = args.warmup
    out.put((rank, statistics.median(times[k:]), sent[k:], implied[k:]))
    dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace, moe: bool) -> tuple[float, list[int], list[int]]:
    from megaformer.runtime.spawn import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_timed, args=(r, world, port, args, moe, out)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    t = max(r[1] for r in results)  # the slowest rank sets the pace
    # per rank, mean over ranks: every off-rank row crosses 4 times (dispatch and combine, forward
    # and backward), once from its rank and once back to it, so the ranks' totals must agree
    sent = [sum(r[2][i] for r in results) / world for i in range(len(results[0][2]))]
    implied = [
        4 * sum(r[3][i] for r in results) * args.d_model * 4 / world
        for i in range(len(results[0][3]))
    ]
    return t, sent, implied


READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


def _count_moe_host_reads(model: torch.nn.Module) -> dict:
    """Count the host reads made inside every MoE block's forward and backward of ``model``
    (from the gradient reaching a block's output until the one leaving its input)."""
    from megaformer.model.moe import moe_layers

    seen = {"reads": 0, "depth": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *a, __original=original, **k):
            if seen["depth"] > 0:
                seen["reads"] += 1
            return __original(self, *a, **k)

        setattr(torch.Tensor, name, counted)

    def enter(_=None):
        seen["depth"] += 1

    def leave(_=None):
        seen["depth"] -= 1

    for moe in moe_layers(model):

        def pre(module, args):
            enter()
            if args[0].requires_grad:
                args[0].register_hook(leave)

        def post(module, args, out):
            leave()
            if out.requires_grad:
                out.register_hook(enter)

        moe.register_forward_pre_hook(pre)
        moe.register_forward_hook(post)
    return seen


def _dispatch_case(rank: int, world: int, args: argparse.Namespace, tp: int, mode: str) -> dict:
    torch.set_num_threads(1)
    from megaformer.comm import CommCounter
    from megaformer.config import Config, ParallelConfig, TrainConfig
    from megaformer.config.data import DataConfig
    from megaformer.parallel.build import build_model
    from megaformer.parallel.topology import build_topology

    cfg = Config(
        model=_model_cfg(args, True),
        parallel=ParallelConfig(tensor=tp, expert=2, expert_dispatch=mode),
        train=TrainConfig(seed=0, recompute="none"),
        data=DataConfig(seq_len=args.seq),
    )
    topo = build_topology(world, rank, tp=tp, ep=2)
    model = build_model(cfg, topo).model.train()
    seen = _count_moe_host_reads(model)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    with CommCounter() as c:
        model(x, x).backward()
    return {"reads": seen["reads"], "bytes": c.bytes.get("all_to_all", 0)}


def _dispatch_table(args: argparse.Namespace) -> None:
    from megaformer.runtime.spawn import run_ranks

    print(
        "\nExpert dispatch, 4 gloo processes (EP 2; TP 2 x EP 2 or DP 2 x EP 2 at TP 1), one "
        f"training forward + backward of {args.layers} MoE blocks per step"
    )
    print("\n| exchange | layout | host reads/step (MoE) | all-to-all MB/step/rank | vs before |")
    print("|---|---|---|---|---|")
    rows = {}
    for mode in ("splits", "padded"):
        for tp in (1, 2):
            res = run_ranks(4, _dispatch_case, args, tp, mode, timeout=1800)
            rows[mode, tp] = (
                statistics.mean(r["reads"] for r in res),
                statistics.mean(r["bytes"] for r in res),
            )
    before = rows["splits", 1][1]
    reads = rows["splits", 1][0]
    print(
        f"| before: uneven, every TP rank the whole micro-batch | TP 2 x EP 2 | {reads:.0f} | "
        f"{before / 1e6:.3f} | 1.00 |"
    )
    for (mode, tp), (r, b) in rows.items():
        print(f"| {mode} | TP {tp} x EP 2 | {r:.0f} | {b / 1e6:.3f} | {b / before:.2f} |")


def _text_batches(args: argparse.Namespace):
    """Byte tokens of Python's standard library sources: (inputs, next tokens), each (batch, seq)."""
    import random

    root = Path(os.__file__).parent
    data = b"".join(p.read_bytes() for p in sorted(root.glob("*.py"))[:120])
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    rng = random.Random(0)
    while True:
        starts = [rng.randrange(0, len(ids) - args.seq - 1) for _ in range(args.batch)]
        w = torch.stack([ids[s : s + args.seq + 1] for s in starts])
        yield w[:, :-1], w[:, 1:]


def _balance(args: argparse.Namespace, **moe_kw) -> tuple[float, float, float]:
    """(mean CV over the last 50 steps, over the first 10, final loss)."""
    from megaformer.model.moe import end_of_step
    from megaformer.model.transformer import Transformer

    torch.manual_seed(0)
    model = Transformer(_model_cfg(args, True, **moe_kw))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cvs, loss = [], float("nan")
    batches = _text_batches(args)
    for _ in range(args.balance_steps):
        x, y = next(batches)
        opt.zero_grad()
        out = model(x, y)
        out.backward()
        opt.step()
        loss = float(out.detach())
        stats = end_of_step(model)
        cvs.append(statistics.mean(v for k, v in stats.items() if k.startswith("moe/load_cv/")))
    return statistics.mean(cvs[-50:]), statistics.mean(cvs[:10]), loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-expert", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--balance-steps", type=int, default=200)
    ap.add_argument(
        "--only", choices=("dispatch",), help="run one table only (dispatch: the third)"
    )
    args = ap.parse_args()
    if args.only == "dispatch":
        _dispatch_table(args)
        return

    print(
        f"MoE: d_model {args.d_model}, {args.layers} blocks, {args.experts} experts of width "
        f"{args.d_expert}, top-{args.top_k}; dense: d_ffn {args.top_k * args.d_expert}; "
        f"micro-batch {args.batch} x {args.seq} per rank, fp32, gloo"
    )
    dense, _, _ = _run(1, args, moe=False)
    print(
        "\n| layout | ms/step/rank | vs dense | all-to-all MB/step/rank | uniform analytic | "
        "ratio | implied by routing | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(f"| dense (1 process) | {1000 * dense:.0f} | 1.00 | 0 | 0 | n/a | 0 | n/a |")
    N = args.batch * args.seq
    for P in (1, 2, 4):
        t, sent, implied = _run(P, args, moe=True)
        analytic = 4 * args.layers * N * args.top_k * (P - 1) / P * args.d_model * 4
        ms, mi = statistics.mean(sent), statistics.mean(implied)
        r1 = f"{ms / analytic:.2f}" if analytic else "n/a"
        r2 = f"{ms / mi:.3f}" if mi else "n/a"
        print(
            f"| MoE EP={P} ({P} process{'es' if P > 1 else ''}) | {1000 * t:.0f} | "
            f"{t / dense:.2f} | {ms / 1e6:.3f} | {analytic / 1e6:.3f} | {r1} | {mi / 1e6:.3f} | "
            f"{r2} |"
        )

    _dispatch_table(args)

    print(
        f"\nExpert-load balance over {args.balance_steps} steps (one process, text): CV = std/mean "
        "of the per-expert load per step, mean over blocks"
    )
    print("\n| balancing | CV, first 10 steps | CV, last 50 steps | final loss |")
    print("|---|---|---|---|")
    for name, kw in (
        ("load-balancing loss (aux 0.01)", dict(aux_loss_coef=0.01)),
        ("aux-loss-free bias (rate 0.001)", dict(aux_loss_coef=0.0, bias_update_rate=0.001)),
        ("neither", dict(aux_loss_coef=0.0)),
    ):
        late, early, loss = _balance(args, **kw)
        print(f"| {name} | {early:.3f} | {late:.3f} | {loss:.3f} |")


if __name__ == "__main__":
    main()
