"""``megaformer bench``: time training steps, optionally against Hugging Face transformers."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megaformer.cli.common import config_args, load
from megaformer.errors import UserError

NAME = "bench"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    bn = sub.add_parser(
        "bench",
        help="time training steps (optionally against Hugging Face transformers)",
        description="Warm-up, then timed training steps of CONFIG's model on random tokens in one "
        "process: tokens/s, TFLOP/s per device, MFU (with --gpu/--peak-tflops), peak "
        "memory. --compare-hf builds the same architecture as a transformers model "
        "(LlamaForCausalLM or GPT2LMHeadModel), same batch and AdamW, and alternates steps. "
        "On CPU train.cpu_malloc applies to the whole process (both models) and each "
        "model's minor page faults per step are printed.",
    )
    config_args(bn)
    bn.add_argument("--steps", type=int, default=10, help="timed steps per model (10)")
    bn.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (2)")
    bn.add_argument("--compare-hf", action="store_true", help="also time the transformers model")
    bn.add_argument("--device", default=None, help="cpu or cuda (default: train.device)")
    bn.add_argument("--gpu", help="accelerator name for MFU (default: the CUDA device's name)")
    bn.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU")
    bn.add_argument(
        "--sequential",
        action="store_true",
        help="time one model after the other instead of alternating steps (only one "
        "model in memory: large models on one GPU)",
    )
    return bn


def run(args: argparse.Namespace) -> int:
    from megaformer.analysis.bench import format_bench, run_bench

    if args.steps < 1 or args.warmup < 0:
        raise UserError(
            f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 1, warmup >= 0"
        )
    r = run_bench(
        load(args),
        steps=args.steps,
        warmup=args.warmup,
        compare_hf=args.compare_hf,
        device=args.device,
        gpu=args.gpu,
        peak=args.peak_tflops,
        sequential=args.sequential,
    )
    print(json.dumps(r, indent=2) if args.json else format_bench(r))
    return 0
