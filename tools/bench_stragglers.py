"""Step time with straggler detection off and on, side by side, on 2 gloo ranks.

    python tools/bench_stragglers.py [--interval 50] [--rounds 4] [--layers 4] [--d-model 128]
                                     [--seq 128] [--batch 8]

Each rank trains configs/quickstart.yaml's model at the given size with AdamW on random
tokens, data-parallel: after the backward pass every gradient is all-reduced (one call per
parameter, the worst case for the per-call record), and the step ends with the trainer's small
agreement all-reduce. The two arms alternate, ``--rounds`` times
each, ``interval`` steps per arm, so a slow spell of a shared machine hits both:

* off: no collective record, no detector;
* on:  megaformer's collective record installed and the trainer's ``StragglerDetector`` around
  every step, comparing the ranks once per arm (``log.straggler_interval`` = ``interval``).

Prints each arm's median step time, their ratio, and the detector's own accounting (seconds of its
bookkeeping and of the record's wrappers / seconds of the steps): steadier than a ratio of two
noisy timings.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rank(rank: int, world: int, args: argparse.Namespace, run_dir: str) -> dict:
    import torch
    import torch.distributed as dist

    from megaformer.comm.flight import FlightRecorder
    from megaformer.config import load_config
    from megaformer.model.transformer import Transformer
    from megaformer.training.loop import StepState
    from megaformer.training.stragglers import StragglerDetector

    words = [f"model.{k}={v}" for k, v in (("vocab_size", 257), ("n_layers", args.layers))]
    words += [f"model.d_model={args.d_model}", f"model.max_seq_len={args.seq}"]
    words += [f"model.n_heads={max(1, args.d_model // 64)}"]
    words += [f"model.n_kv_heads={max(1, args.d_model // 128)}"]
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", words).model
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=384)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    data = []
    for _ in range(4):
        t = torch.randint(0, 257, (args.batch, args.seq + 1), generator=gen)
        data.append((t[:, :-1], t[:, 1:]))

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        model(x, y).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)  # through the namespace: recorded when the record is on
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(torch.zeros(2))  # the step's end, agreed as the trainer's stop check does

    def arm(on: bool) -> tuple[float, float]:
        """(median step seconds, the detector's own seconds / the steps' seconds)."""
        rec = FlightRecorder().install() if on else None
        det = (
            StragglerDetector(
                args.interval, 0.10, rec, rank, torch.device("cpu"), Path(run_dir), None
            )
            if on
            else None
        )
        times = []
        try:
            for i in range(1, args.interval + 1):
                t0 = time.perf_counter()
                if det is not None:
                    det.before_step(i)
                step(i)
                if det is not None:
                    det.after_step(StepState(i, args.interval), {})
                times.append(time.perf_counter() - t0)
        finally:
            if rec is not None:
                rec.uninstall()
        share = (det.overhead_s + rec.own_s) / sum(times) if det is not None else 0.0
        return statistics.median(times), share

    for i in range(3):
        step(i)
    out: dict = {"off": [], "on": [], "share": []}
    for r in range(args.rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            t, share = arm(on)
            out["on" if on else "off"].append(t)
            if on:
                out["share"].append(share)
    out["params"] = model.num_parameters()
    out["calls"] = sum(1 for _ in model.parameters())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interval", type=int, default=50, help="log.straggler_interval (50)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    from megaformer.runtime.spawn import run_ranks

    with tempfile.TemporaryDirectory() as run_dir:
        r0 = run_ranks(2, _rank, args, run_dir, timeout=3600)[0]
    print(
        f"2 gloo ranks, model {r0['params']:,} parameters ({args.layers} layers x d_model "
        f"{args.d_model}), batch {args.batch} x {args.seq}, {r0['calls']} all-reduces per step | "
        f"arms of {args.interval} steps, {args.rounds} rounds each (rank 0's timings)"
    )
    print(f"{'detection':<12}{'step ms (median)':>18}   per round")
    for name in ("off", "on"):
        xs = r0[name]
        rounds = "  ".join(f"{1000 * x:.1f}" for x in xs)
        print(f"{name:<12}{1000 * statistics.median(xs):>18.1f}   {rounds}")
    ratio = statistics.median(r0["on"]) / statistics.median(r0["off"])
    print(f"ratio on/off: {ratio:.4f} ({100 * (ratio - 1):+.2f}%)")
    print(
        f"detector's own accounting: {100 * statistics.median(r0['share']):.3f}% of step time "
        f"(median of rounds: {'  '.join(f'{100 * s:.3f}%' for s in r0['share'])})"
    )


if __name__ == "__main__":
    main()
