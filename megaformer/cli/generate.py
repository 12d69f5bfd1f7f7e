"""``megaformer generate``: continue a prompt with a trained model."""

from __future__ import annotations

import argparse
from typing import Any

from megaformer.errors import UserError

NAME = "generate"
# sampling by default, as the end-of-training sample: temperature 0.8 and top-k 40 (Hugging Face's
# sampling defaults are temperature 1.0 and top-k 50, which a small model answers with noise)
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40


def add_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate", help="generate text from a run directory or checkpoint",
        description="Continue a prompt with a trained model (its latest checkpoint when given a "
                    "run directory). Samples (temperature 0.8, top-k 40) unless --greedy; on CPU "
                    "it uses OMP_NUM_THREADS threads when set, else the idle physical cores.")
    gen.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    gen.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (100)")
    gen.add_argument("--temperature", type=float, default=SAMPLE_TEMPERATURE,
                     help=f"sampling temperature ({SAMPLE_TEMPERATURE}); 0 = greedy")
    gen.add_argument("--top-k", type=int, default=SAMPLE_TOP_K,
                     help=f"sample from the k likeliest tokens ({SAMPLE_TOP_K})")
    gen.add_argument("--greedy", action="store_true",
                     help="greedy decoding (the likeliest token each step), as --temperature 0")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    gen.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return gen


def run(args: argparse.Namespace) -> int:
    from megaformer.generation import generate_text, load_checkpoint_model

    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k {args.top_k}: must be >= 1")
    model, tokenizer, _, _ = load_checkpoint_model(args.checkpoint, args.device)
    print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                        temperature=0.0 if args.greedy else args.temperature, top_k=args.top_k,
                        seed=args.seed))
    return 0
