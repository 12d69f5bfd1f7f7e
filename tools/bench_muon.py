"""Muon beside AdamW: loss after N steps, optimizer step time, state bytes and communication.

    python tools/bench_muon.py [--steps 40] [--seeds 1,2,3] [--d-model 128] [--layers 4]
                               [--seq 128] [--lr 2e-3] [--muon-lr LR] [--skip-loss]

1. Loss: the quickstart's model shape (scaled by --d-model / --layers / --seq; the quickstart's own
   is 256 / 8 / 256), its data, schedule and learning rate, trained --steps steps in one process
   with train.optimizer=adamw and =muon (Muon at the same learning rate: its update is scaled to
   AdamW's RMS; --muon-lr to change it), the mean over --seeds of the final training loss and of
   the validation loss, side by side.
2. TP2 x DP2 with ZeRO-1 (4 gloo processes): the optimizer step's time (median of the steps after
   the first), the optimizer state each rank allocates (AdamW: the moments of its ZeRO partition
   plus DeepSpeed's fp32 partition copy; Muon: the momentum and AdamW moments of the parameters it
   owns; beside the memory estimator's figure), and the bytes Muon's step sends per rank
   (counted: the tensor-parallel all-to-alls of the owned matrices, the owners' broadcasts)
   beside their analytical volumes.

CPU figures: relative only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def shape_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.max_seq_len={args.seq}",
        f"data.seq_len={args.seq}",
        "data.max_bytes=2000000",
        "log.progress_bar=false",
        "log.tensorboard=false",
        "log.sample_tokens=0",
        "log.interval=1",
        "checkpoint.interval=0",
    ]


# ----------------------------------------------------------------------------- 1. loss


def final_losses(args: argparse.Namespace, optimizer: str, seed: int, run: Path) -> tuple:
    lr = args.muon_lr if optimizer == "muon" and args.muon_lr else args.lr
    cmd = [
        sys.executable,
        "-m",
        "megaformer",
        "train",
        str(ROOT / "configs" / "quickstart.yaml"),
        *shape_overrides(args),
        f"train.steps={args.steps}",
        f"train.warmup_steps={max(1, args.steps // 10)}",
        f"train.seed={seed}",
        f"train.optimizer={optimizer}",
        f"train.lr={lr}",
        f"train.min_lr={lr / 10}",
        f"eval.interval={args.steps}",
        "eval.at_end=false",
        "--run-dir",
        str(run),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("step") == args.steps]
    train = next(r["loss"] for r in last if "loss" in r)
    valid = next(r["val_loss"] for r in last if "val_loss" in r)
    return train, valid


def loss_table(args: argparse.Namespace, base: Path) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    print(
        f"1. loss after {args.steps} steps, quickstart shape d_model {args.d_model}, "
        f"{args.layers} layers, seq {args.seq}; mean of seeds {seeds}"
    )
    print(f"{'optimizer':>9s} {'lr':>8s} {'train loss':>10s} {'val loss':>9s} {'s/run':>6s}")
    for optimizer in ("adamw", "muon"):
        out, t0 = [], time.perf_counter()
        for seed in seeds:
            out.append(final_losses(args, optimizer, seed, base / f"{optimizer}-{seed}"))
        lr = args.muon_lr if optimizer == "muon" and args.muon_lr else args.lr
        print(
            f"{optimizer:>9s} {lr:>8.1e} {statistics.mean(t for t, _ in out):>10.4f} "
            f"{statistics.mean(v for _, v in out):>9.4f} "
            f"{(time.perf_counter() - t0) / len(seeds):>6.1f}"
        )


# ----------------------------------------------------------------------------- 2. TP2 x DP2


def state_bytes(engine: Any) -> tuple[int, int]:
    """(optimizer state, fp32 copy) bytes this rank allocated."""
    from megaformer.analysis.measure import optimizer_state_tensors, tensor_bytes

    opt = engine.optimizer
    inner = opt if isinstance(opt, torch.optim.Optimizer) else opt.optimizer
    copies = getattr(opt, "single_partition_of_fp32_groups", [])
    return tensor_bytes(optimizer_state_tensors(inner)), tensor_bytes(copies)


def rank_main(rank: int, world: int, args: argparse.Namespace, base: str) -> dict:
    """This rank's figures for each optimizer (a rank of :func:`megaformer.runtime.spawn.run_ranks`)."""
    warnings.filterwarnings("ignore", message="Seems like `optimizer.step")
    from megaformer.comm import CommCounter
    from megaformer.config import load_config
    from megaformer.training import distributed as dist
    from megaformer.training.trainer import Trainer

    rows = {}
    for optimizer in ("adamw", "muon"):
        cfg = load_config(
            ROOT / "configs" / "quickstart.yaml",
            [
                *shape_overrides(args),
                "train.steps=100",
                "train.global_batch_size=4",
                "eval.interval=0",
                "parallel.tensor=2",
                "parallel.zero_stage=1",
                f"train.optimizer={optimizer}",
            ],
        )
        trainer = Trainer(cfg, Path(base) / optimizer)
        trainer.setup()
        opt = trainer.engine.optimizer
        times: list[float] = []
        counter = CommCounter()
        step = opt.step

        def timed(*a: Any, _step: Any = step, **kw: Any) -> Any:
            t0 = time.perf_counter()
            with counter:
                out = _step(*a, **kw)
            times.append(time.perf_counter() - t0)
            return out

        opt.step = timed
        for _ in range(args.tp_steps):
            trainer.train_step()
        state, copy = state_bytes(trainer.engine)
        params = sum(p.numel() for p in trainer.engine.module.parameters())
        split = 0  # fp32 bytes of the owned, tensor-parallel Muon matrices' shards
        if optimizer == "muon":
            split = sum(
                4 * p.numel()
                for g in opt.param_groups
                if g["use_muon"]
                for p in g["params"]
                if opt.owns(p) and getattr(p, "tensor_model_parallel", False)
            )
        from megaformer.analysis.memory import Layout
        from megaformer.analysis.memory import state_bytes as estimated

        lay = Layout(tp=2, dp=2, zero=1, optimizer=optimizer)
        est = estimated(trainer.cfg.model, lay, trainer.plain_model.padded_vocab_size)
        rows[optimizer] = {
            "estimate": est["optimizer"],
            "split": split,
            "step_s": statistics.median(times[1:] or times),
            "state": state,
            "copy": copy,
            "params": params,
            "sent": {k: v // len(times) for k, v in counter.bytes.items()},
        }
        dist.barrier()
    return rows


def tp_table(args: argparse.Namespace, base: Path) -> None:
    from megaformer.runtime.spawn import run_ranks

    rows = run_ranks(4, rank_main, args, str(base / "tp"), timeout=3600)
    mb = 1e6
    print(
        f"\n2. TP2 x DP2, ZeRO-1, fp32, {args.tp_steps} steps (median optimizer step after the first)"
    )
    print(
        f"{'optimizer':>9s} {'step ms':>8s} {'state MB/rank':>13s} {'fp32 copy MB':>12s} "
        f"{'state+copy':>10s} {'estimate MB':>11s} {'params/rank M':>13s}"
    )
    for optimizer in ("adamw", "muon"):
        r = [x[optimizer] for x in rows]
        state = max(x["state"] for x in r)
        copy = max(x["copy"] for x in r)
        print(
            f"{optimizer:>9s} {1000 * max(x['step_s'] for x in r):>8.1f} {state / mb:>13.2f} "
            f"{copy / mb:>12.2f} {(state + copy) / mb:>10.2f} {r[0]['estimate'] / mb:>11.2f} "
            f"{r[0]['params'] / 1e6:>13.3f}"
        )
    m = [x["muon"] for x in rows]
    p = m[0]["params"]
    print("\nMuon's added communication per step and rank (counted; analytical in brackets):")
    for kind in sorted({k for x in m for k in x["sent"]}):
        sent = max(x["sent"].get(kind, 0) for x in m)
        print(f"  {kind:>10s}: {sent / mb:8.3f} MB sent by the busiest rank")
    print(
        f"  [ZeRO-1 owners' broadcasts: a rank sends the parameters it owns, ~1/DP = 1/2 of its "
        f"{p / 1e6:.3f} M fp32 parameters, {4 * p / 2 / mb:.3f} MB, and receives the rest. "
        "DeepSpeed's ZeRO-1 all-gathers as much after AdamW's step; what Muon adds over it is "
        f"the gradients' all-reduce in place of a reduce-scatter: (DP-1)/DP x 4 P = "
        f"{4 * p / 2 / mb:.3f} MB]"
    )
    split = max(x["split"] for x in m)
    print(
        f"  [TP all-to-alls: each rank sends (TP-1)/TP = 1/2 of its shards of the matrices "
        f"it owns to the rank orthogonalising them, and as much back: {split / mb:.3f} MB in all]"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--muon-lr", type=float, default=None)
    ap.add_argument("--tp-steps", type=int, default=6)
    ap.add_argument("--skip-loss", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_muon_") as tmp:
        if not args.skip_loss:
            loss_table(args, Path(tmp))
        tp_table(args, Path(tmp))


if __name__ == "__main__":
    main()
