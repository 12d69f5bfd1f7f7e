#!/usr/bin/env python
"""FP8 training against high precision: loss curves and step times, printed as tables.

CPU (default): the quickstart-sized model (d 256, 8 layers, GQA, SwiGLU, byte vocabulary) trains
``--steps`` steps from the same seed on the same batches of the standard library's source, once in
high precision and once per FP8 recipe (emulated: the same quantisation, GEMMs dequantised to
fp32, so *slower* than high precision; the time ratio is the cost of the emulated casts, not a
speed-up). The three runs take their steps in turn on the same batches. Prints the loss every
``--every`` steps, the final-loss ratio (mean of the last 5 steps) and the step-time ratio.

    python tools/bench_fp8.py [--steps 50] [--precision fp32|bf16]

Counts (``--counts``, CPU, emulated; no timing): what FP8 dispatches, before and after the casts
became one compiled function each and a block input one cast per projection group: aten ops per
linear layer's forward + backward, casts of the block inputs per block, and which GEMMs of
configs/moe-tiny.yaml run in FP8 (measured FP8 GEMM FLOPs of a training step over all its model
FLOPs) with and without the routed experts in FP8.

    python tools/bench_fp8.py --counts

GPU (``--gpu``, needs CUDA capability >= 8.9): times one 8B-shaped block's linear layers
(Llama 3 8B: d 4096, q 4096, k/v 1024 each, SwiGLU FFN 14336), forward + backward over
``--tokens`` tokens, in bf16 and in FP8 (tensorwise and rowwise, real torch._scaled_mm GEMMs, q/k/v
and gate/up each from one cast of their input), then a Mixtral-shaped routed experts layer (8
experts, top-2) in bf16 and FP8 grouped GEMMs, and prints ms per iteration, TFLOP/s and the
speed-up over bf16.

    python tools/bench_fp8.py --gpu [--tokens 8192] [--iters 20] [--compile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

RECIPES = ("tensorwise", "rowwise")


# ----------------------------------------------------------------------------- CPU: losses


def build(fp8: str, precision: str, seq: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The quickstart model (same seed, same weights for every ``fp8``) and its AdamW."""
    from megaformer.config import load_config
    from megaformer.parallel.build import build_model

    cfg = load_config(
        "configs/quickstart.yaml",
        [
            "model.vocab_size=257",
            f"model.max_seq_len={seq}",
            f"train.fp8={fp8}",
            "train.fp8_emulate=true",
        ],
    )
    model = build_model(cfg, device="cpu").model
    model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    return model, torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)


def train_side_by_side(
    steps: int, precision: str, seq: int = 128, batch: int = 8, seed: int = 0
) -> dict[str, tuple[list[float], float]]:
    """{fp8 mode: (loss per step, median step seconds after the first 3)}: the runs take their
    steps in turn on the same batches, so a machine's changing load reaches all alike."""
    runs = {mode: build(mode, precision, seq) for mode in ("off", *RECIPES)}
    text = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py"))[:40])
    data = torch.tensor(list(text), dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    losses: dict[str, list[float]] = {mode: [] for mode in runs}
    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        tokens = torch.stack([data[s : s + seq + 1] for s in starts])
        for mode, (model, opt) in runs.items():
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            times[mode].append(time.perf_counter() - t0)
            losses[mode].append(loss.item())
        if (step + 1) % 10 == 0:
            print(f"# step {step + 1}/{steps}", file=sys.stderr, flush=True)
    return {
        mode: (losses[mode], sorted(times[mode][3:])[(len(times[mode]) - 3) // 2]) for mode in runs
    }


def cpu_report(steps: int, every: int, precision: str) -> None:
    runs = train_side_by_side(steps, precision)
    names = [precision] + [f"fp8 {r}" for r in RECIPES]
    print(
        f"loss per step (quickstart model, batch 8 x 128 tokens, {precision} master weights; "
        "FP8 emulated on CPU; the three runs step in turn on the same batches)"
    )
    print("| step | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for i in list(range(0, steps, every)) + ([steps - 1] if (steps - 1) % every else []):
        print(f"| {i + 1} | " + " | ".join(f"{runs[k][0][i]:.4f}" for k in runs) + " |")
    base_final = sum(runs["off"][0][-5:]) / 5
    base_time = runs["off"][1]
    print()
    print(
        "| run | final loss (mean of last 5) | ratio to "
        + precision
        + " | median step (s) | step-time ratio (emulated: slower) |"
    )
    print("|---|---|---|---|---|")
    for key, name in zip(runs, names):
        final = sum(runs[key][0][-5:]) / 5
        print(
            f"| {name} | {final:.4f} | {final / base_final:.4f} | {runs[key][1]:.3f} | "
            f"{runs[key][1] / base_time:.2f} |"
        )


# ----------------------------------------------------------------------------- CPU: counts


def _config(path: str, *over: str):  # type: ignore[no-untyped-def]
    from megaformer.config import load_config

    return load_config(path, ["train.fp8_emulate=true", *over])


def linear_ops() -> dict[str, tuple[int, int, int]]:
    """{recipe: (aten ops eager, aten ops outside the casts, casts)} of one linear layer's
    forward + backward (bf16, 64 x 64 -> 48)."""
    from megaformer.kernels import fp8 as kernels
    from megaformer.parallel.fp8 import Fp8Matmul

    out = {}
    for recipe in RECIPES:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(64, 64, generator=gen).bfloat16().requires_grad_()
        w = torch.randn(48, 64, generator=gen).bfloat16().requires_grad_()
        dy = torch.randn(64, 48, generator=gen).bfloat16()
        with kernels.counting() as c:
            Fp8Matmul(recipe, emulate=True)(x, w).backward(dy)
        out[recipe] = (sum(c.every_op.values()), sum(c.ops.values()), len(c.casts))
    return out


def block_input_casts(recipe: str, shared: bool) -> tuple[int, int]:
    """(forward, backward) casts of the normed attention and FFN inputs of one quickstart block
    (d 256, batch 2 x 128); ``shared=False``: each projection casts its input itself."""
    from megaformer.kernels import fp8 as kernels
    from megaformer.model import linear
    from megaformer.parallel.build import build_model

    cfg = _config(
        "configs/quickstart.yaml", f"train.fp8={recipe}", "model.n_layers=1", "model.vocab_size=257"
    )
    model = build_model(cfg, device="cpu").model
    block = model.layers[0]
    held: list[torch.Tensor] = []
    hooks = [
        n.register_forward_hook(lambda m, i, o: held.append(o))
        for n in (block.attn_norm, block.mlp_norm)
    ]
    saved = linear.shared_fp8_projections
    if not shared:
        linear.shared_fp8_projections = lambda x, projections: None
    try:
        x = torch.randn(2, 128, cfg.model.d_model)
        with kernels.counting() as c:
            y = block(x)
            n = len(c.casts)
            y.square().mean().backward()
    finally:
        linear.shared_fp8_projections = saved
        for h in hooks:
            h.remove()
    ptrs = {t.data_ptr() for t in held}
    hits = [cast[2] in ptrs for cast in c.casts]
    return sum(hits[:n]), sum(hits[n:])


def moe_fp8_share(routed: bool) -> tuple[float, float, dict[str, int]]:
    """configs/moe-tiny.yaml, one training micro-batch (2 x 256 tokens) in FP8 (rowwise,
    emulated): (measured FP8 GEMM FLOPs / model FLOPs, the analytic share, FLOPs by kind)."""
    from megaformer.analysis.flops import forward_flops, fp8_share
    from megaformer.kernels import fp8 as kernels
    from megaformer.parallel.build import build_model

    cfg = _config("configs/moe-tiny.yaml", "train.fp8=rowwise", "model.vocab_size=257")
    torch.manual_seed(0)
    model = build_model(cfg, device="cpu").model.train()
    if not routed:
        for block in model.layers:
            if hasattr(block.mlp, "experts"):
                block.mlp.experts.fp8 = None
    seq, batch = cfg.seq_len, 2
    ids = torch.randint(0, 257, (batch, seq), generator=torch.Generator().manual_seed(1))
    with kernels.counting() as c:
        model(ids, ids).backward()
    total = 3 * forward_flops(cfg.model, seq).total * batch
    return c.gemm_flops / total, fp8_share(cfg.model, seq, routed=routed), dict(c.ops)


def counts_report() -> None:
    print("aten ops of one FP8 linear layer, forward + backward (emulated on CPU, bf16 64x64->48)")
    print("| recipe | eager casts: aten ops | compiled casts: aten ops + casts |")
    print("|---|---|---|")
    for recipe, (every, outside, casts) in linear_ops().items():
        print(f"| {recipe} | {every} | {outside} + {casts} |")
    print()
    print("casts of a block's normed inputs (attention, FFN) per block, quickstart block")
    print("| recipe | each projection casts (fwd / bwd) | one cast per group (fwd / bwd) |")
    print("|---|---|---|")
    for recipe in RECIPES:
        a, b = block_input_casts(recipe, False), block_input_casts(recipe, True)
        print(f"| {recipe} | {a[0]} / {a[1]} | {b[0]} / {b[1]} |")
    print()
    print("configs/moe-tiny.yaml: share of a training step's model FLOPs in FP8 GEMMs (rowwise)")
    print("| routed experts | measured | analytic (fp8_share) | FP8 GEMM calls |")
    print("|---|---|---|---|")
    for routed in (False, True):
        measured, analytic, ops = moe_fp8_share(routed)
        calls = f"{ops.get('scaled_mm', 0)} dense + {ops.get('scaled_grouped_mm', 0)} grouped"
        name = "in FP8" if routed else "high precision (before)"
        print(f"| {name} | {100 * measured:.1f}% | {100 * analytic:.1f}% | {calls} |")


# ----------------------------------------------------------------------------- GPU: GEMMs


def _timed(fn, iters: int, dry: bool) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of ``fn`` after warm-up (one call each without CUDA)."""
    for _ in range(1 if dry else 3):
        fn()
    sync = (lambda: None) if dry else torch.cuda.synchronize
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def _table(title: str, flops: int, results: dict[str, float]) -> None:
    print(title)
    print("| GEMMs | ms/iter | TFLOP/s | speed-up vs bf16 |")
    print("|---|---|---|---|")
    for name, t in results.items():
        print(f"| {name} | {1e3 * t:.2f} | {flops / t / 1e12:.0f} | {results['bf16'] / t:.2f} |")
    print()


def gpu_report(tokens: int, iters: int, compile_: bool) -> None:
    """bf16 vs FP8 forward + backward on CUDA: an 8B-shaped block's linear layers (q/k/v from
    one cast of their input, gate/up likewise; eager: each cast one compiled function;
    ``compile_``: the whole step compiled, the casts fused into it) and a Mixtral-shaped routed
    experts layer (8 experts, top-2, grouped GEMMs). Without CUDA, a dry run of the same code:
    tiny shapes, emulated FP8 GEMMs, aot_eager."""
    from megaformer.errors import ConfigError
    from megaformer.parallel.fp8 import Fp8Experts, Fp8Matmul, fp8_gemm_support

    dry = not torch.cuda.is_available()
    ok, why = fp8_gemm_support("cuda")
    if not (ok or dry):
        raise ConfigError(f"--gpu: {why}")
    d, q, kv, f = (64, 64, 16, 128) if dry else (4096, 4096, 1024, 14336)
    tokens, iters = (min(tokens, 64), 1) if dry else (tokens, iters)
    dev = torch.device("cpu" if dry else "cuda")
    if dry:
        print("no CUDA: a dry run (tiny shapes, emulated FP8 GEMMs, aot_eager); no timings to read")
    gen = torch.Generator(device=dev).manual_seed(0)

    def param(*shape: int) -> torch.Tensor:
        t = torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        return t.requires_grad_()

    # (input width, output widths of the projections sharing that input)
    groups = [(d, (q, kv, kv)), (q, (d,)), (d, (f, f)), (f, (d,))]
    layers = [(param(tokens, k), [param(n, k) for n in outs]) for k, outs in groups]
    flops = sum(6 * tokens * k * sum(outs) for k, outs in groups)  # forward + 2x backward

    def step(mm) -> None:  # type: ignore[no-untyped-def]
        for x, ws in layers:
            ys = mm.many(x, ws) if mm is not None else [F.linear(x, w) for w in ws]
            torch.autograd.backward(ys, [torch.ones_like(y) for y in ys])

    specs = [("bf16", None)] + [(f"fp8 {r}", Fp8Matmul(r, emulate=dry)) for r in RECIPES]
    results = {}
    for name, mm in specs:
        fn = torch.compile(step, backend="aot_eager" if dry else "inductor") if compile_ else step
        results[name] = _timed(lambda: fn(mm), iters, dry)
    where = "CPU (dry run)" if dry else torch.cuda.get_device_name(dev)
    how = " (compiled)" if compile_ else " (eager; casts compiled on their own)"
    _table(
        f"8B-shaped block linears, {tokens} tokens, forward + backward, {where}{how}",
        flops,
        results,
    )

    # Mixtral-shaped routed experts: E 8, top-2, d 4096, f 14336; rows balanced over the experts
    E, top_k = 8, 2
    rows = tokens * top_k
    counts = torch.full((E,), rows // E, device=dev)
    x = param(rows, d)
    w1, w3, w2 = param(E, f, d), param(E, f, d), param(E, d, f)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    fp8 = Fp8Experts(Fp8Matmul("rowwise", dry), Fp8Matmul("rowwise", dry))

    def experts(use_fp8: bool) -> None:
        if use_fp8:
            h1, h3 = fp8.grouped(x, [w1, w3], counts)
            y = fp8.grouped(F.silu(h1) * h3, [w2], counts, second=True)[0]
        else:
            h1 = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)
            h3 = torch._grouped_mm(x, w3.transpose(1, 2), offs=offs)
            y = torch._grouped_mm(F.silu(h1) * h3, w2.transpose(1, 2), offs=offs)
        y.backward(torch.ones_like(y))

    if dry:  # the CPU grouped GEMM takes no bf16 operands: the FP8 side only
        experts(True)
        print("routed experts (dry run): the FP8 grouped path ran")
        return
    results = {}
    for name, use in (("bf16", False), ("fp8 rowwise (grouped)", True)):
        fn = torch.compile(experts, backend="inductor") if compile_ else experts
        results[name] = _timed(lambda: fn(use), iters, dry)
    _table(
        f"Mixtral-shaped routed experts (E {E}, top-{top_k}, d {d}, f {f}), {tokens} tokens, "
        f"forward + backward, {where}{how}",
        6 * rows * 3 * d * f,
        results,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--every", type=int, default=10, help="print the loss every N steps")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--gpu", action="store_true", help="time 8B-shaped GEMMs on CUDA instead")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="with --gpu: torch.compile the step")
    ap.add_argument("--counts", action="store_true", help="count ops, casts and FP8 FLOPs (CPU)")
    args = ap.parse_args()
    if args.counts:
        counts_report()
    elif args.gpu:
        from megaformer.errors import UserError

        try:
            gpu_report(args.tokens, args.iters, args.compile)
        except UserError as e:
            sys.exit(f"bench_fp8: error: {e}")
    else:
        cpu_report(args.steps, args.every, args.precision)


if __name__ == "__main__":
    main()
