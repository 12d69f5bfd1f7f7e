"""``megaformer generate``: continue a prompt with a trained model, at any TP x PP layout."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from megaformer.cli.common import check_layout_args, launch_process, launched, layout_args
from megaformer.errors import UserError

NAME = "generate"
# sampling by default, as the end-of-training sample: temperature 0.8 and top-k 40 (Hugging Face's
# sampling defaults are temperature 1.0 and top-k 50, which a small model answers with noise)
SAMPLE_TEMPERATURE, SAMPLE_TOP_K = 0.8, 40


def add_parser(sub: Any) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help="generate text from a run directory or checkpoint",
        description="\n\n".join(
            textwrap.fill(p, 88)
            for p in (
                "Continue a prompt with a trained model (its latest checkpoint when given a run "
                "directory), in the precision it trained in unless --dtype says otherwise. Samples "
                "(temperature 0.8, top-k 40) unless --greedy; on CPU it uses OMP_NUM_THREADS threads "
                "when set, else the idle physical cores.",
                "Under torchrun/srun the model is laid out as in training and as megaformer eval lays "
                "it out: --tp/--pp split it and each rank reads only its shards of the checkpoint; "
                "rank 0 prints the text. A pipeline (--pp > 1) decodes greedily only.",
            )
        ),
        epilog="examples:\n"
        "  megaformer generate runs/quickstart --prompt 'Once upon a time'\n"
        "  torchrun --nproc_per_node 4 -m megaformer generate runs/big --tp 2 --pp 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    gen.add_argument("--prompt", default="", help="text to continue (default: a new document)")
    gen.add_argument("--max-new-tokens", type=int, default=100, help="tokens to generate (100)")
    gen.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"sampling temperature ({SAMPLE_TEMPERATURE}; greedy with --pp > 1); 0 = greedy",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=SAMPLE_TOP_K,
        help=f"sample from the k likeliest tokens ({SAMPLE_TOP_K})",
    )
    gen.add_argument(
        "--greedy",
        action="store_true",
        help="greedy decoding (the likeliest token each step), as --temperature 0",
    )
    gen.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    layout_args(gen)
    gen.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="weights and activations (default: the checkpoint's train.precision)",
    )
    gen.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="cpu",
        help="cpu (default), cuda (this rank's GPU) or auto (cuda when available)",
    )
    return gen


def sampling_temperature(args: argparse.Namespace) -> float:
    """--temperature as given; else sampling at :data:`SAMPLE_TEMPERATURE`, greedy (0) with
    --greedy or under a pipeline (--pp > 1 decodes greedily only)."""
    if args.greedy:
        return 0.0
    if args.temperature is not None:
        return args.temperature
    return 0.0 if args.pp > 1 else SAMPLE_TEMPERATURE


def run(args: argparse.Namespace) -> int:
    from megaformer.checkpoint.layout import resolve_checkpoint

    check_layout_args(args)
    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k {args.top_k}: must be >= 1")
    resolve_checkpoint(args.checkpoint)  # a missing checkpoint fails before anything starts
    proc = launch_process("generate", args.device, args.tp, args.pp)
    temperature = sampling_temperature(args)
    with launched(proc, args.tp, args.pp) as topo:
        from megaformer.evaluation.checkpoint import generate_from_checkpoint

        text = generate_from_checkpoint(
            args.checkpoint,
            args.prompt,
            args.max_new_tokens,
            topo=topo,
            device=proc.device,
            dtype=args.dtype,
            temperature=temperature,
            top_k=args.top_k,
            seed=args.seed,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
        )
    if proc.is_main:
        print(text)
    return 0
