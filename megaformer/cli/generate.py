"""``megaformer generate``: continue a prompt with a trained model."""

from __future__ import annotations

import argparse
from typing import Any

from megaformer.errors import UserError

NAME = "generate"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate", help="generate text from a run directory or checkpoint",
        description="Continue a prompt with a trained model (its latest checkpoint when given a "
                    "run directory).")
    gen.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    gen.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (100)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=None, help="sample from the k likeliest tokens")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    gen.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return gen


def run(args: argparse.Namespace) -> int:
    from megaformer.generation import generate_text, load_checkpoint_model

    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k {args.top_k}: must be >= 1")
    model, tokenizer, _, _ = load_checkpoint_model(args.checkpoint, args.device)
    print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed))
    return 0
