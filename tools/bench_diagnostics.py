"""Training throughput with residual-stream diagnostics off and on, side by side in one run.

    python tools/bench_diagnostics.py [--interval 100] [--rounds 3] [--layers 8] [--d-model 256]
                                      [--seq 256] [--batch 16] [--device cpu|cuda] [--precision fp32|bf16]

A quickstart-shaped model (Llama-style: RoPE, RMSNorm, SwiGLU, GQA, tied embeddings) trains with
AdamW on random tokens. The two arms alternate, ``--rounds`` times each, so a slow spell of a
shared machine hits both:

* off: ``interval`` training steps;
* on:  ``interval`` training steps + one diagnostics pass (the trainer's ``DiagnosticsHook``, on a
  fixed micro-batch of the same shape), i.e. diagnostics at ``log.diagnostics_interval``.

Prints tokens/s of each arm and their ratio, and the amortised overhead t_pass / (interval x t_step)
from the timed pass and step alone (steadier than the ratio of two noisy throughputs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megaformer.config import ModelConfig  # noqa: E402
from megaformer.diagnostics.training import DiagnosticsHook  # noqa: E402
from megaformer.model.transformer import Transformer  # noqa: E402
from megaformer.parallel.topology import build_topology  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interval", type=int, default=100, help="log.diagnostics_interval (100)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default=None,
        help="default: bf16 on CUDA, fp32 on CPU",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    cfg = ModelConfig(
        vocab_size=257,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=max(1, args.d_model // 64),
        n_kv_heads=max(1, args.d_model // 128),
        max_seq_len=args.seq,
    )
    torch.manual_seed(0)
    model = Transformer(cfg, padded_vocab_size=384).to(device=device, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.randint(0, 257, (args.batch, args.seq + 1), generator=gen)
        return t[:, :-1].to(device), t[:, 1:].to(device)

    if not torch.distributed.is_initialized():  # a world of one: the topology's groups of one
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    hook = DiagnosticsHook(model, batch(), args.interval, build_topology(1, 0))
    data = [batch() for _ in range(8)]

    def step(i: int) -> None:
        x, y = data[i % len(data)]
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def arm(with_pass: bool) -> tuple[float, float]:
        """(tokens/s of the arm, seconds of its diagnostics pass)."""
        _sync(device)
        t0 = time.perf_counter()
        for i in range(args.interval):
            step(i)
        t_pass = 0.0
        if with_pass:
            _sync(device)
            tp = time.perf_counter()
            hook()
            _sync(device)
            t_pass = time.perf_counter() - tp
        _sync(device)
        return args.interval * args.batch * args.seq / (time.perf_counter() - t0), t_pass

    for i in range(3):  # warm-up: allocator, kernels, the pass itself
        step(i)
    hook()
    off, on, passes = [], [], []
    for r in range(args.rounds):
        for with_pass in (False, True) if r % 2 == 0 else (True, False):
            tps, t_pass = arm(with_pass)
            print(
                f"  round {r + 1}, diagnostics {'on ' if with_pass else 'off'}: {tps:,.0f} tokens/s"
                + (f" (pass {1000 * t_pass:.1f} ms)" if with_pass else ""),
                flush=True,
            )
            (on if with_pass else off).append(tps)
            if with_pass:
                passes.append(t_pass)
    t_step = args.batch * args.seq / statistics.median(off)
    t_pass = statistics.median(passes)
    print(
        f"model: {model.num_parameters():,} parameters, {cfg.n_layers} layers x d_model "
        f"{cfg.d_model}, {cfg.n_heads} heads | batch {args.batch} x {args.seq} tokens | "
        f"{device.type} {precision} | interval {args.interval} steps, {args.rounds} rounds per arm"
    )
    print(f"{'diagnostics':<14}{'tokens/s (median)':>20}   per round")
    for name, xs in (("off", off), ("on", on)):
        print(f"{name:<14}{statistics.median(xs):>20,.0f}   {'  '.join(f'{x:,.0f}' for x in xs)}")
    ratio = statistics.median(on) / statistics.median(off)
    print(f"ratio on/off: {ratio:.4f} (throughput change {100 * (ratio - 1):+.2f}%)")
    print(
        f"step {1000 * t_step:.1f} ms | diagnostics pass {1000 * t_pass:.1f} ms | amortised "
        f"overhead t_pass / (interval x t_step) = {100 * t_pass / (args.interval * t_step):.2f}%"
    )


if __name__ == "__main__":
    main()
