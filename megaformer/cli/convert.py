"""``megaformer convert``: megaformer <-> Hugging Face checkpoints, or resharding."""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path
from typing import Any

from megaformer.errors import UserError

NAME = "convert"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    conv = sub.add_parser(
        "convert",
        help="convert checkpoints: megaformer <-> Hugging Face, or reshard",
        description="\n\n".join(
            textwrap.fill(p, 88)
            for p in (
                "Convert SRC into DST (a new or empty folder; written under a temporary name and "
                "renamed when complete). Tensors are streamed one at a time: peak memory is about the "
                "largest tensor (the embedding), not the model.",
                "--to hf: SRC is a megaformer run directory (its latest checkpoint) or checkpoint, "
                "trained with any TP/PP/DP/ZeRO layout; DST becomes a Hugging Face folder (safetensors, "
                "config.json, tokenizer.json, tokenizer_config.json) that "
                "transformers.AutoModelForCausalLM.from_pretrained(DST) loads as LlamaForCausalLM, "
                "GPT2LMHeadModel, GPTNeoXForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or "
                "Qwen3ForCausalLM. Model features the class cannot express are refused by name.",
                "--to megaformer: SRC is a Hugging Face folder (llama incl. Llama 3.1+ scaled RoPE, "
                "mistral, qwen2, qwen3, gpt2, gpt_neox; safetensors, config.json read through "
                "transformers' config classes, and tokenizer.json or a SentencePiece tokenizer.model, "
                "or --tokenizer; without any, the weights convert with a warning) -> DST is a run "
                "directory with a weights-only checkpoint and DST/config.yaml for TP=--tp, PP=--pp; "
                "or SRC is a megaformer checkpoint -> DST is the same checkpoint resharded for --tp/--pp.",
                "--verify (megaformer <-> HF): both models run a fixed batch in fp32 (both in memory "
                "at once) and the largest logit difference is printed; above --verify-tolerance the "
                "conversion fails and leaves nothing behind.",
            )
        ),
        epilog="examples:\n"
        "  megaformer convert runs/quickstart hf/quickstart --to hf --arch llama --dtype bf16\n"
        "  megaformer convert hf/model runs/continued --to megaformer --tp 2 --pp 2\n"
        "  megaformer train runs/continued/config.yaml --run-dir runs/continued",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conv.add_argument(
        "src", metavar="SRC", help="megaformer run directory/checkpoint, or HF folder"
    )
    conv.add_argument("dst", metavar="DST", help="output folder (must not exist or be empty)")
    conv.add_argument("--to", required=True, choices=("hf", "megaformer"), help="target format")
    conv.add_argument(
        "--arch",
        choices=(
            "llama",
            "gpt2",
            "gpt-neox",
            "mistral",
            "qwen2",
            "qwen3",
            "mixtral",
            "qwen3_moe",
            "qwen2_moe",
            "deepseek_v3",
        ),
        help="--to hf: the Hugging Face class (default: the first of llama, gpt2, "
        "gpt-neox, mistral, qwen2, qwen3, mixtral, qwen3_moe, qwen2_moe, deepseek_v3 that "
        "can express the model); "
        "--to megaformer: checked against SRC's config.json",
    )
    conv.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="--to megaformer: tokenizer.json or SentencePiece tokenizer.model to "
        "use (default: SRC's own)",
    )
    conv.add_argument(
        "--verify",
        action="store_true",
        help="compare both models' fp32 logits on a fixed batch after converting",
    )
    conv.add_argument(
        "--verify-tolerance",
        type=float,
        default=1e-3,
        metavar="TOL",
        help="largest accepted |logit difference| with --verify (1e-3)",
    )
    conv.add_argument("--tp", type=int, default=1, help="--to megaformer: tensor-parallel size (1)")
    conv.add_argument(
        "--pp", type=int, default=1, help="--to megaformer: pipeline-parallel size (1)"
    )
    conv.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="dtype of the written weights (default: as stored in SRC)",
    )
    conv.add_argument(
        "--max-shard-size",
        default="5GB",
        help="--to hf: largest safetensors shard, e.g. 5GB, 500MB, 2GiB (5GB)",
    )
    return conv


def run(args: argparse.Namespace) -> int:
    from megaformer.checkpoint.hf import convert
    from megaformer.checkpoint.hf.stream import parse_size

    src, dst = Path(args.src), Path(args.dst)
    if not src.exists():
        raise UserError(f"{src}: no such file or directory")
    for flag, value in (("--tp", args.tp), ("--pp", args.pp)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    if args.to == "hf":
        if (args.tp, args.pp) != (1, 1):
            raise UserError(
                "--tp/--pp choose the layout of a megaformer checkpoint; a Hugging Face "
                "folder has none (drop them with --to hf)"
            )
        if args.tokenizer is not None:
            raise UserError(
                "--tokenizer: a megaformer checkpoint carries its tokenizer (drop it with --to hf)"
            )
        out = convert.export_to_hf(
            src,
            dst,
            arch=args.arch,
            dtype=args.dtype,
            max_shard_size=parse_size(args.max_shard_size),
            verify=args.verify,
            tolerance=args.verify_tolerance,
        )
    elif convert.is_hf_folder(src):
        out = convert.import_from_hf(
            src,
            dst,
            tensor=args.tp,
            pipeline=args.pp,
            arch=args.arch,
            dtype=args.dtype,
            tokenizer=args.tokenizer and Path(args.tokenizer),
            verify=args.verify,
            tolerance=args.verify_tolerance,
        )
    else:
        if args.verify or args.tokenizer is not None:
            raise UserError(
                "--verify/--tokenizer apply to conversions between megaformer and "
                "Hugging Face, not to resharding"
            )
        if args.arch is not None:
            raise UserError(
                f"--arch {args.arch}: SRC {src} is a megaformer checkpoint; resharding "
                "keeps its model (drop --arch)"
            )
        from megaformer.checkpoint.layout import resolve_checkpoint
        from megaformer.checkpoint.reshard import reshard_checkpoint

        out = reshard_checkpoint(resolve_checkpoint(src), dst, args.tp, args.pp)
    print(f"converted {src} -> {out}")
    return 0
