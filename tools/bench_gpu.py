"""GPU training benchmark: Llama-style 125M / 350M / 1.3B at seq 2048 and 4096 in bf16, megaformer
beside Hugging Face transformers' LlamaForCausalLM of the same size and batch, then the kernel
micro-benchmarks.

    python tools/bench_gpu.py [--sizes 125M,350M,1.3B] [--seqs 2048,4096] [--tokens-per-step 32768]
                              [--steps 10] [--warmup 3] [--compile] [--no-hf] [--no-kernels]
                              [--gpu NAME | --peak-tflops X] [--json OUT.json]
    python tools/bench_gpu.py --device cpu --tiny        # a CPU smoke run of the same code path

For every (size, sequence length): one process, random tokens, micro-batch = tokens-per-step / seq,
bf16 autocast with fp32 master weights and AdamW for both models (``megaformer bench``'s runner,
megaformer.analysis.bench, models built and timed one after the other so that only one model's
states are in memory). megaformer runs its fast paths: FlashAttention (or SDPA with cuDNN/flash
priority), the Triton SwiGLU and norm kernels, and the chunked cross-entropy fused with the output
projection (``model.loss_chunk_tokens``, default 4096 here); transformers runs its default
attention (SDPA). Printed per row: tokens/s, TFLOP/s per GPU (megaformer's model FLOPs of the
batch, Narayanan et al. 2021, GQA/SwiGLU aware), MFU against the dense bf16 peak of the peak table
(989.5 TFLOP/s for H100/H200 SXM), peak memory, and the tokens/s ratio. A model that does not fit
is reported as out of memory.

Targets: the 1.3B model at seq 4096 reaches >= 50% MFU and >= 1.5x transformers' tokens/s on one
H100/H200 (not yet measured: docs/benchmarks.md). Without a CUDA device the script refuses (unless --device cpu --tiny).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Llama-style shapes (RoPE, RMSNorm, SwiGLU, untied embeddings, vocabulary 32000).
SIZES = {
    "125M": dict(d_model=768, n_layers=12, n_heads=12, d_ffn=2048),
    "350M": dict(d_model=1024, n_layers=24, n_heads=16, d_ffn=2816),
    "1.3B": dict(d_model=2048, n_layers=24, n_heads=16, d_ffn=5504),
    # --tiny (CPU smoke run)
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, d_ffn=192),
}
TINY_SEQS = (64, 128)


def size_config(size: str, seq: int, batch: int, args: argparse.Namespace):
    from megaformer.config import config_from_dict

    model = dict(
        SIZES[size],
        vocab_size=32000 if size != "tiny" else 512,
        max_seq_len=seq,
        position="rope",
        norm="rmsnorm",
        activation="swiglu",
        tie_embeddings=False,
        loss_chunk_tokens=args.loss_chunk_tokens,
        kernels=args.model_kernels,
        attention_backend=args.attention_backend,
    )
    train = dict(
        micro_batch_size=batch,
        global_batch_size=batch,
        precision=args.precision,
        compile=args.compile,
        grad_clip=1.0,
    )
    return config_from_dict({"model": model, "train": train}, name=f"llama-{size}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="125M,350M,1.3B")
    p.add_argument("--seqs", default="2048,4096")
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=32768,
        help="tokens per micro-batch; batch = this / seq (at least 1)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--loss-chunk-tokens", type=int, default=4096)
    p.add_argument(
        "--model-kernels",
        default="auto",
        choices=("auto", "torch"),
        help="model.kernels: auto (fast paths) or torch (plain torch ops)",
    )
    p.add_argument(
        "--attention-backend", default="auto", choices=("auto", "flash", "sdpa", "reference")
    )
    p.add_argument("--compile", action="store_true", help="train.compile=true for megaformer")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers model")
    p.add_argument("--no-kernels", action="store_true", help="skip tools/bench_kernels.py")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny model, seq 64/128 (CPU smoke run)")
    p.add_argument("--gpu", help="accelerator name for MFU (default: the CUDA device's name)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU for MFU")
    p.add_argument("--json", help="also write the results to this JSON file (must not exist)")
    args = p.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device here; the 125M-1.3B benchmark needs a GPU "
            "(use --device cpu --tiny for a smoke run of the same code path)",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu" and not args.tiny:
        print(
            "bench_gpu: --device cpu runs only with --tiny (the real sizes need a GPU)",
            file=sys.stderr,
        )
        return 2
    if args.json and Path(args.json).exists():
        print(f"bench_gpu: {args.json} exists; not overwriting it", file=sys.stderr)
        return 2
    if args.tiny:
        sizes, seqs = ["tiny"], list(TINY_SEQS)
        args.tokens_per_step = min(args.tokens_per_step, 256)
        args.loss_chunk_tokens = min(args.loss_chunk_tokens, 64)
        if args.device == "cpu" and args.precision == "fp16":
            args.precision = "fp32"
    else:
        sizes = [s.strip() for s in args.sizes.split(",")]
        seqs = [int(s) for s in args.seqs.split(",")]
        unknown = [s for s in sizes if s not in SIZES]
        if unknown:
            print(
                f"bench_gpu: unknown size {unknown[0]!r} (known: 125M, 350M, 1.3B)", file=sys.stderr
            )
            return 2

    from megaformer.analysis.bench import format_bench, run_bench

    summary, everything = [], []
    for size in sizes:
        for seq in seqs:
            batch = max(1, args.tokens_per_step // seq)
            cfg = size_config(size, seq, batch, args)
            r = run_bench(
                cfg,
                steps=args.steps,
                warmup=args.warmup,
                compare_hf=not args.no_hf,
                device=args.device,
                gpu=args.gpu,
                peak=args.peak_tflops,
                sequential=True,
            )
            print(format_bench(r), flush=True)
            print()
            everything.append(r)
            for row in r["results"]:
                summary.append((size, seq, batch, row, r.get("ratio")))
    print(
        f"{'size':>5s} {'seq':>5s} {'batch':>5s} {'model':34s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
        f"{'MFU':>6s} {'peak mem':>9s} {'mf/hf':>6s}"
    )
    for size, seq, batch, row, ratio in summary:
        if "error" in row:
            print(f"{size:>5s} {seq:>5d} {batch:>5d} {row['name']:34s} {row['error']}")
            continue
        mfu = f"{100 * row['mfu']:.1f}%" if "mfu" in row else "-"
        rat = f"{ratio:.2f}x" if ratio and row["name"] == "megaformer" else ""
        print(
            f"{size:>5s} {seq:>5d} {batch:>5d} {row['name']:34s} {row['tokens_per_s']:>10,.0f} "
            f"{row['tflops_per_device']:>8.2f} {mfu:>6s} {row['peak_mem_gb']:>7.2f}GB {rat:>6s}"
        )
    if args.json:
        with open(args.json, "x") as f:
            json.dump(everything, f, indent=2)
    if not args.no_kernels:
        print(flush=True)
        cmd = [sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--device", args.device]
        if args.tiny:
            cmd += [
                "--tokens",
                "256",
                "--d-model",
                "64",
                "--d-ffn",
                "192",
                "--heads",
                "4",
                "--seq",
                "64",
                "--vocab",
                "512",
                "--ce-chunk",
                "64",
                "--repeat",
                "3",
            ]
        return subprocess.call(cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
