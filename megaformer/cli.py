"""``megaformer <subcommand>``: the command line.

User errors (:class:`~megaformer.errors.UserError`) end as one line on stderr and exit code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from pathlib import Path
from typing import Optional, Sequence

from megaformer import __version__
from megaformer.errors import ConfigError, UserError

EXIT_USER_ERROR = 2


def _config_help() -> str:
    from megaformer.config import describe_keys

    lines = ["config keys (YAML sections; override any as SECTION.KEY=VALUE):", ""]
    for key, tp, default, doc in describe_keys():
        lines.append(f"  {key}  ({tp}, default {default})")
        lines.extend(textwrap.wrap(doc, 88, initial_indent="      ", subsequent_indent="      "))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megaformer", description="Distributed pretraining of decoder-only Transformers.")
    parser.add_argument("--version", action="version", version=f"megaformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tr = sub.add_parser(
        "train", help="pretrain a model from a YAML config",
        description="Pretrain a model described by CONFIG. Resumes from the run directory's latest "
                    "complete checkpoint when there is one; SIGTERM or SIGUSR1 saves a checkpoint "
                    "and exits 0. Launch several processes with torchrun, srun, mpirun or the "
                    "DeepSpeed launcher (scripts in launch/); "
                    "parallel.tensor / parallel.pipeline / parallel.zero_stage split them into "
                    "tensor, pipeline and data parallelism (DP = world / (TP*PP)).",
        epilog="example: megaformer train configs/quickstart.yaml train.steps=50 model.n_layers=2\n"
               "run `megaformer train --help-config` for every config key.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("config", nargs="?", help="YAML config file (see configs/)")
    tr.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="dotted overrides, e.g. train.steps=50 parallel.zero_stage=1")
    tr.add_argument("--run-dir", help="run directory (default: runs/<config name>)")
    tr.add_argument("--dry-run", action="store_true",
                    help="validate the config, print the resolved config and parameter counts, exit")
    tr.add_argument("--help-config", action="store_true", help="list every config key and exit")
    tr.add_argument("--world-size", type=int, default=None,
                    help="with --dry-run: also check the parallel layout for this many processes")

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

    prep = sub.add_parser(
        "prepare-data", help="tokenize a corpus into Megatron .bin/.idx files",
        description="Tokenize SRC (one EOD token appended per document) into PREFIX.bin + PREFIX.idx "
                    "(Megatron-LM's MMIDIDX format, readable by Megatron-LM and GPT-NeoX) and save "
                    "the tokenizer as PREFIX.tokenizer.json; or, with --merge, concatenate prepared "
                    "prefixes. Files are written under temporary names and renamed when complete.",
        epilog="examples:\n"
               "  megaformer prepare-data --input 'corpus/*.jsonl' --tokenizer bpe:32000 "
               "--output-prefix data/corpus\n"
               "  megaformer prepare-data --input wikitext:wikitext-103-raw-v1@train "
               "--tokenizer gpt2/tokenizer.json --output-prefix data/wiki\n"
               "  megaformer prepare-data --merge data/a data/b --output-prefix data/ab\n"
               "then train with: megaformer train CONFIG data.paths=[data/corpus]",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    prep.add_argument("--input", metavar="SRC",
                      help="local .json/.jsonl/.parquet/.txt/.arrow file, folder or glob, 'stdlib', "
                           "or a Hugging Face hub dataset NAME[:CONFIG][@SPLIT] ('hf:' forces the hub)")
    prep.add_argument("--tokenizer", metavar="SPEC",
                      help="byte, bpe:VOCAB_SIZE (byte-level BPE trained on SRC), or a tokenizer.json "
                           "file or folder")
    prep.add_argument("--output-prefix", required=True, metavar="PREFIX",
                      help="writes PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json")
    prep.add_argument("--text-field", default="text",
                      help="field holding the text in json/parquet/arrow/hub records (text)")
    prep.add_argument("--workers", type=int, default=None,
                      help="tokenizer processes (default: all cores; 1 for local inputs under 8 MB)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing PREFIX")
    prep.add_argument("--dtype", default="auto",
                      help="token dtype: auto (uint16 when the vocabulary is under 65,500, else "
                           "int32), uint16 or int32")
    prep.add_argument("--sample-by", default="document", choices=("document", "paragraph", "line"),
                      help="text files: one document per file (default), paragraph or line")
    prep.add_argument("--no-streaming", action="store_true",
                      help="hub datasets: download and cache instead of streaming")
    prep.add_argument("--merge", nargs="+", metavar="PREFIX",
                      help="concatenate these prepared prefixes into --output-prefix")
    from megaformer.analysis.commands import add_parsers

    add_parsers(sub)  # flops, plan, report, bench
    return parser


def _dry_run(cfg, run_dir: Path) -> int:
    from megaformer.analysis.params import count_parameters
    from megaformer.analysis.summary import resolve_vocab

    model = resolve_vocab(cfg).model
    counts = count_parameters(model)
    print(cfg.to_yaml().rstrip())
    print(f"# run dir: {run_dir}")
    print(f"# parameters: {counts['total']:,} total | {counts['non_embedding']:,} non-embedding | "
          f"{counts['embedding']:,} embedding")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(_config_help())
        return 0
    if not args.config:
        raise UserError("train: missing CONFIG (a YAML file, e.g. configs/quickstart.yaml)")
    from megaformer.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / cfg.name
    if args.world_size is not None:
        from megaformer.config import validate_for_world

        if args.world_size < 1:
            raise UserError(f"--world-size {args.world_size}: must be >= 1")
        accum = validate_for_world(cfg, args.world_size)
        print(f"# layout: world {args.world_size}, gradient accumulation {accum}")
    if args.dry_run:
        return _dry_run(cfg, run_dir)
    from megaformer.training.trainer import train

    result = train(cfg, run_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        _print_result(result)
    return 0


def _print_result(r) -> None:
    import math

    if r.stopped is not None:
        print(f"\nstopped at step {r.step} ({r.stopped}); checkpoint: {r.checkpoint}\n"
              "run the same command to resume from it")
        return
    print(f"\ndone: step {r.step} in {r.wall_s:.1f}s | {r.tokens_per_s:,.0f} tokens/s (training)")
    val = (f"val loss {r.val_loss:.4f} (ppl {math.exp(min(r.val_loss, 50)):.2f})"
           if r.val_loss is not None else "val loss not evaluated")
    print(f"final: train loss {r.train_loss:.4f} | {val} | unigram baseline {r.unigram_loss:.4f} "
          "nats/token")
    if r.checkpoint is not None:
        print(f"checkpoint: {r.checkpoint}")
    print(f"tensorboard: tensorboard --logdir {r.run_dir / 'tensorboard'}")
    if r.sample is not None:
        print("sample (temperature 0.8, top-k 40):")
        print("-" * 72)
        print(r.sample)
        print("-" * 72)


def cmd_generate(args: argparse.Namespace) -> int:
    from megaformer.generation import generate_text, load_checkpoint_model

    if args.top_k is not None and args.top_k < 1:
        raise UserError(f"--top-k {args.top_k}: must be >= 1")
    model, tokenizer, _, _ = load_checkpoint_model(args.checkpoint, args.device)
    print(generate_text(model, tokenizer, args.prompt, args.max_new_tokens,
                        temperature=args.temperature, top_k=args.top_k, seed=args.seed))
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    if args.merge:
        if args.input or args.tokenizer:
            raise UserError("prepare-data: --merge takes prepared prefixes; drop --input/--tokenizer")
        from megaformer.data.indexed import merge

        out = merge(args.merge, args.output_prefix, overwrite=args.overwrite)
        print(f"merged {len(args.merge)} datasets -> {args.output_prefix}.bin/.idx: "
              f"{len(out):,} documents, {out.n_tokens:,} tokens ({out.dtype})")
        return 0
    for flag, value in (("--input", args.input), ("--tokenizer", args.tokenizer)):
        if not value:
            raise UserError(f"prepare-data: missing {flag} (or use --merge PREFIX ...)")
    from megaformer.data.prepare import prepare

    r = prepare(args.input, args.tokenizer, args.output_prefix, text_field=args.text_field,
                workers=args.workers, overwrite=args.overwrite, dtype=args.dtype,
                sample_by=args.sample_by, streaming=not args.no_streaming)
    print(f"prepared {args.input} -> {r.prefix}.bin/.idx: {r.documents:,} documents, "
          f"{r.tokens:,} tokens ({r.dtype}, tokenizer {r.tokenizer}, vocab {r.vocab_size:,}) in "
          f"{r.seconds:.1f}s = {r.tokens_per_s:,.0f} tokens/s with {r.workers} worker(s)")
    return 0


def _report(error: UserError) -> None:
    """One line on stderr. Under a launcher, config errors (the same on every rank) are printed by
    rank 0 only; other errors may be rank-specific and name their rank."""
    rank = os.environ.get("RANK")
    if rank in (None, "", "0"):
        print(f"megaformer: error: {error}", file=sys.stderr)
    elif not isinstance(error, ConfigError):
        print(f"megaformer: error (rank {rank}): {error}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    handlers = {"train": cmd_train, "generate": cmd_generate, "prepare-data": cmd_prepare_data}
    from megaformer.analysis.commands import HANDLERS

    handlers.update(HANDLERS)
    try:
        return handlers[args.command](args)
    except UserError as e:
        _report(e)
        return EXIT_USER_ERROR
    except (PermissionError, IsADirectoryError, NotADirectoryError) as e:
        print(f"megaformer: error: {e.filename}: {e.strerror}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("megaformer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
