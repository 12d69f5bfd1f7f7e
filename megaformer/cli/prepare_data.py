"""``megaformer prepare-data``: tokenize a corpus into Megatron .bin/.idx files (or merge prepared ones)."""

from __future__ import annotations

import argparse
from typing import Any

from megaformer.errors import UserError

NAME = "prepare-data"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    prep = sub.add_parser(
        "prepare-data",
        help="tokenize a corpus into Megatron .bin/.idx files",
        description="Tokenize SRC (one EOD token appended per document) into PREFIX.bin + PREFIX.idx "
        "(Megatron-LM's MMIDIDX format, readable by Megatron-LM and GPT-NeoX) and save "
        "the tokenizer as PREFIX.tokenizer.json; or, with --merge, concatenate prepared "
        "prefixes. Files are written under temporary names and renamed when complete.",
        epilog="examples:\n"
        "  megaformer prepare-data --input 'corpus/*.jsonl' --tokenizer bpe:32000 "
        "--output-prefix data/corpus\n"
        "  megaformer prepare-data --input hf:wikitext:wikitext-103-raw-v1@train "
        "--tokenizer gpt2/tokenizer.json --output-prefix data/wiki\n"
        "  megaformer prepare-data --merge data/a data/b --output-prefix data/ab\n"
        "then train with: megaformer train CONFIG data.paths=[data/corpus]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prep.add_argument(
        "--input",
        metavar="SRC",
        help="local .json/.jsonl/.parquet/.txt/.arrow file, folder or glob, 'stdlib', "
        "or a Hugging Face hub dataset hf:NAME[:CONFIG][@SPLIT] (only hf: reaches the network)",
    )
    prep.add_argument(
        "--tokenizer",
        metavar="SPEC",
        help="byte, bpe:VOCAB_SIZE (byte-level BPE trained on SRC), or a tokenizer.json "
        "file or folder",
    )
    prep.add_argument(
        "--output-prefix",
        required=True,
        metavar="PREFIX",
        help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json",
    )
    prep.add_argument(
        "--text-field",
        default="text",
        help="field holding the text in json/parquet/arrow/hub records (text)",
    )
    prep.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes (default: all cores; 1 for local inputs under 8 MB)",
    )
    prep.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX")
    prep.add_argument(
        "--dtype",
        default="auto",
        help="token dtype: auto (uint16 when the vocabulary is under 65,500, else "
        "int32), uint16 or int32",
    )
    prep.add_argument(
        "--sample-by",
        default="document",
        choices=("document", "paragraph", "line"),
        help="text files: one document per file (default), paragraph or line",
    )
    prep.add_argument(
        "--no-streaming",
        action="store_true",
        help="hub datasets: download and cache instead of streaming",
    )
    prep.add_argument(
        "--merge",
        nargs="+",
        metavar="PREFIX",
        help="concatenate these prepared prefixes into --output-prefix",
    )
    return prep


def run(args: argparse.Namespace) -> int:
    if args.merge:
        if args.input or args.tokenizer:
            raise UserError(
                "prepare-data: --merge takes prepared prefixes; drop --input/--tokenizer"
            )
        from megaformer.data.indexed import merge

        out = merge(args.merge, args.output_prefix, overwrite=args.overwrite)
        print(
            f"merged {len(args.merge)} datasets -> {args.output_prefix}.bin/.idx: "
            f"{len(out):,} documents, {out.n_tokens:,} tokens ({out.dtype})"
        )
        return 0
    for flag, value in (("--input", args.input), ("--tokenizer", args.tokenizer)):
        if not value:
            raise UserError(f"prepare-data: missing {flag} (or use --merge PREFIX ...)")
    from megaformer.data.prepare import prepare

    r = prepare(
        args.input,
        args.tokenizer,
        args.output_prefix,
        text_field=args.text_field,
        workers=args.workers,
        overwrite=args.overwrite,
        dtype=args.dtype,
        sample_by=args.sample_by,
        streaming=not args.no_streaming,
    )
    print(
        f"prepared {args.input} -> {r.prefix}.bin/.idx: {r.documents:,} documents, "
        f"{r.tokens:,} tokens ({r.dtype}, tokenizer {r.tokenizer}, vocab {r.vocab_size:,}) in "
        f"{r.seconds:.1f}s = {r.tokens_per_s:,.0f} tokens/s with {r.workers} worker(s)"
    )
    return 0
