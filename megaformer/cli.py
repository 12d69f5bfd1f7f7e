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
                           "or a Hugging Face hub dataset hf:NAME[:CONFIG][@SPLIT] (only hf: reaches the network)")
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
    _add_convert_parser(sub)
    ins = sub.add_parser(
        "inspect", help="logit lens and attention heatmaps of a prompt",
        description="Run a prompt through a trained model (its latest checkpoint when given a run "
                    "directory) and print, for every position, the top-k next tokens that the "
                    "output layer reads from the residual stream after the embedding and after each "
                    "layer (the logit lens; the last row is the model's prediction). With --out, "
                    "also write one PNG per layer with a heatmap of each head's attention pattern, "
                    "and the table as logit_lens.txt.",
        epilog="example: megaformer inspect runs/quickstart --prompt 'def main():' --out inspect/")
    ins.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    ins.add_argument("--prompt", required=True, help="text to inspect (at most max_seq_len tokens)")
    ins.add_argument("--out", metavar="DIR", help="new folder for the heatmaps (not overwritten)")
    ins.add_argument("--top-k", type=int, default=5, help="tokens shown per layer and position (5)")
    ins.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    from megaformer.analysis.commands import add_parsers

    add_parsers(sub)  # flops, plan, report, bench
    _add_check_parser(sub)
    _add_env_parser(sub)
    _add_eval_parser(sub)
    return parser


def _add_eval_parser(sub) -> None:
    ev = sub.add_parser(
        "eval", help="score a checkpoint on lm-evaluation-harness tasks",
        description="\n\n".join(textwrap.fill(p, 88) for p in (
            "Run EleutherAI's lm-evaluation-harness tasks on a megaformer checkpoint (the latest "
            "one of a run directory) with megaformer's own model and tokenizer: no conversion to "
            "Hugging Face. Log-likelihood tasks (multiple choice), rolling log-likelihood "
            "(perplexity, in windows of model.max_seq_len) and greedy generation (with the KV "
            "cache) are supported.",
            "Under torchrun/srun the model is laid out as in training: --tp/--pp split it, the "
            "remaining ranks are data-parallel and share the requests; rank 0 gathers the scores, "
            "prints a table and writes them as JSON (default CKPT/eval/TASKS.json, replaced "
            "atomically).",
            "Tasks come from lm-eval's registry or from --include-path (a folder of task YAMLs). "
            "Needs pip install megaformer[eval]; set HF_DATASETS_OFFLINE=1 to keep dataset "
            "loading off the network.")),
        epilog="examples:\n"
               "  megaformer eval runs/quickstart --tasks hellaswag,arc_easy --limit 100\n"
               "  megaformer eval runs/quickstart --tasks my_task --include-path my_tasks/\n"
               "  torchrun --nproc_per_node 8 -m megaformer eval runs/big --tasks mmlu --tp 2",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    ev.add_argument("--tasks", required=True, metavar="T1,T2",
                    help="comma-separated lm-eval task (or group) names")
    ev.add_argument("--limit", type=int, default=None, metavar="N",
                    help="at most N documents per task (default: all)")
    ev.add_argument("--batch-size", type=int, default=8, metavar="B",
                    help="sequences per forward pass (8)")
    ev.add_argument("--include-path", metavar="DIR", help="folder of extra task YAMLs")
    ev.add_argument("--output", metavar="PATH",
                    help="results JSON (default: CKPT/eval/TASKS.json)")
    ev.add_argument("--tp", type=int, default=1, help="tensor-parallel size under a launcher (1)")
    ev.add_argument("--pp", type=int, default=1, help="pipeline-parallel size under a launcher (1)")
    ev.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="weights and activations (fp32)")
    ev.add_argument("--bootstrap-iters", type=int, default=0, metavar="N",
                    help="standard errors: 0 = none (default); N > 0 = the exact one for mean "
                         "metrics (accuracy) and N bootstrap resamples for the others "
                         "(perplexity)")
    ev.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="cuda (this rank's GPU) or cpu (default: cuda when available)")


def _add_env_parser(sub) -> None:
    env = sub.add_parser(
        "env", help="versions, GPUs and kernels of this machine, for an issue report",
        description="Print what an issue report needs: megaformer, Python, torch (with its CUDA, "
                    "cuDNN and NCCL), deepspeed, flash-attn, triton, apex, transformers, the GPUs "
                    "with their peak-table entry, which implementation runs for each op, and the C "
                    "compiler of the native CPU kernels.")
    env.add_argument("--config", metavar="CONFIG",
                     help="YAML config whose model and train.precision the kernel rows describe "
                          "(default: the default model section, bf16 on CUDA, fp32 on CPU)")


def _add_check_parser(sub) -> None:
    chk = sub.add_parser(
        "check", help="preflight check of this node: kernels, matmul/attention TFLOP/s, all-reduce",
        description="\n\n".join(textwrap.fill(p, 88) for p in (
            "Check the node(s) before a long job. Each rank checks its own device: every kernel "
            "(attention, SwiGLU, bias-GELU, RMSNorm, LayerNorm, RoPE, cross-entropy, linear, "
            "dropout) against a float64 torch formula, forward and backward, in bf16/fp16/fp32 on "
            "a GPU (fp32 on CPU); bf16 matmul and attention TFLOP/s against the peak table; under "
            "torchrun/srun with several ranks, the all-reduce bus bandwidth (nccl-tests' busbw) "
            "per rank. A GPU, or a rank's all-reduce bandwidth, more than 10% below its peers "
            "fails. Rank 0 prints one table; the exit code is 1 when a check failed.",
            "On CPU the kernels are checked in fp32, the matmul throughput is measured (no peak) "
            "and the all-reduce runs over gloo; the rows that need a GPU say so.")),
        epilog="examples:\n"
               "  megaformer check\n"
               "  torchrun --nproc_per_node 8 -m megaformer check\n"
               "  srun -N 4 --ntasks-per-node 8 python -m megaformer check --sizes 64MiB,1GiB",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    chk.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                     help="cuda (this rank's GPU: cuda:LOCAL_RANK) or cpu (default: cuda when "
                          "available)")
    chk.add_argument("--sizes", metavar="SIZES",
                     help="all-reduce message sizes, comma-separated, e.g. 1MiB,64MiB,1GiB "
                          "(default 1MiB,16MiB,256MiB on GPUs, 256KiB,4MiB on CPU)")
    chk.add_argument("--peak-tflops", type=float,
                     help="peak TFLOP/s per GPU instead of the table's (a GPU not in the table)")
    chk.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def _add_convert_parser(sub) -> None:
    conv = sub.add_parser(
        "convert", help="convert checkpoints: megaformer <-> Hugging Face, or reshard",
        description="\n\n".join(textwrap.fill(p, 88) for p in (
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
            "conversion fails and leaves nothing behind.")),
        epilog="examples:\n"
               "  megaformer convert runs/quickstart hf/quickstart --to hf --arch llama --dtype bf16\n"
               "  megaformer convert hf/model runs/continued --to megaformer --tp 2 --pp 2\n"
               "  megaformer train runs/continued/config.yaml --run-dir runs/continued",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    conv.add_argument("src", metavar="SRC", help="megaformer run directory/checkpoint, or HF folder")
    conv.add_argument("dst", metavar="DST", help="output folder (must not exist or be empty)")
    conv.add_argument("--to", required=True, choices=("hf", "megaformer"), help="target format")
    conv.add_argument("--arch", choices=("llama", "gpt2", "gpt-neox", "mistral", "qwen2", "qwen3",
                                         "mixtral", "qwen3_moe", "qwen2_moe"),
                      help="--to hf: the Hugging Face class (default: the first of llama, gpt2, "
                           "gpt-neox, mistral, qwen2, qwen3, mixtral, qwen3_moe, qwen2_moe that can "
                           "express the model); "
                           "--to megaformer: checked against SRC's config.json")
    conv.add_argument("--tokenizer", metavar="PATH",
                      help="--to megaformer: tokenizer.json or SentencePiece tokenizer.model to "
                           "use (default: SRC's own)")
    conv.add_argument("--verify", action="store_true",
                      help="compare both models' fp32 logits on a fixed batch after converting")
    conv.add_argument("--verify-tolerance", type=float, default=1e-3, metavar="TOL",
                      help="largest accepted |logit difference| with --verify (1e-3)")
    conv.add_argument("--tp", type=int, default=1, help="--to megaformer: tensor-parallel size (1)")
    conv.add_argument("--pp", type=int, default=1, help="--to megaformer: pipeline-parallel size (1)")
    conv.add_argument("--dtype", choices=("fp32", "bf16", "fp16"),
                      help="dtype of the written weights (default: as stored in SRC)")
    conv.add_argument("--max-shard-size", default="5GB",
                      help="--to hf: largest safetensors shard, e.g. 5GB, 500MB, 2GiB (5GB)")


def _dry_run(cfg, run_dir: Path) -> int:
    from megaformer.analysis.params import count_parameters
    from megaformer.analysis.summary import resolve_vocab

    model = resolve_vocab(cfg).model
    counts = count_parameters(model)
    print(cfg.to_yaml().rstrip())
    print(f"# run dir: {run_dir}")
    print(f"# parameters: {counts['total']:,} total | {counts['non_embedding']:,} non-embedding | "
          f"{counts['embedding']:,} embedding"
          + (f" | {counts['active']:,} active per token (MoE)" if "active" in counts else ""))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(_config_help())
        return 0
    if not args.config:
        raise UserError("train: missing CONFIG (a YAML file, e.g. configs/quickstart.yaml)")
    from megaformer.config import load_config, validate_for_training

    cfg = load_config(args.config, args.overrides)
    validate_for_training(cfg)
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
    if math.isnan(r.train_loss) and r.val_loss is None:  # resumed at train.steps: no step ran
        print(f"\nnothing to train: {r.run_dir} is already at step {r.step} (train.steps); raise "
              "train.steps to continue, or give another --run-dir")
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


def cmd_inspect(args: argparse.Namespace) -> int:
    from megaformer.diagnostics.inspect import inspect

    r = inspect(args.checkpoint, args.prompt, args.out, top_k=args.top_k, device=args.device)
    print(r.table)
    if r.heatmaps:
        print(f"attention heatmaps: {len(r.heatmaps)} PNGs in {r.heatmaps[0].parent}")
    else:
        print("(add --out DIR for the attention heatmaps)")
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


def cmd_convert(args: argparse.Namespace) -> int:
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
            raise UserError("--tp/--pp choose the layout of a megaformer checkpoint; a Hugging Face "
                            "folder has none (drop them with --to hf)")
        if args.tokenizer is not None:
            raise UserError("--tokenizer: a megaformer checkpoint carries its tokenizer (drop it "
                            "with --to hf)")
        out = convert.export_to_hf(src, dst, arch=args.arch, dtype=args.dtype,
                                   max_shard_size=parse_size(args.max_shard_size),
                                   verify=args.verify, tolerance=args.verify_tolerance)
    elif convert.is_hf_folder(src):
        out = convert.import_from_hf(src, dst, tensor=args.tp, pipeline=args.pp, arch=args.arch,
                                     dtype=args.dtype, tokenizer=args.tokenizer and Path(args.tokenizer),
                                     verify=args.verify, tolerance=args.verify_tolerance)
    else:
        if args.verify or args.tokenizer is not None:
            raise UserError("--verify/--tokenizer apply to conversions between megaformer and "
                            "Hugging Face, not to resharding")
        if args.arch is not None:
            raise UserError(f"--arch {args.arch}: SRC {src} is a megaformer checkpoint; resharding "
                            "keeps its model (drop --arch)")
        from megaformer.checkpoint.io import resolve_checkpoint
        from megaformer.checkpoint.reshard import reshard_checkpoint

        out = reshard_checkpoint(resolve_checkpoint(src), dst, args.tp, args.pp)
    print(f"converted {src} -> {out}")
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from megaformer.analysis.env import collect, format_report

    model_cfg = dtype = None
    if args.config:
        import torch

        from megaformer.config import load_config

        cfg = load_config(args.config)
        model_cfg = cfg.model
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision, torch.float32)
    print(format_report(*collect(model_cfg, dtype=dtype)))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    import json

    import torch

    from megaformer.analysis.check import failed, format_table, parse_sizes, run_check, to_json
    from megaformer.training.distributed import detect_process, init_distributed

    sizes = parse_sizes(args.sizes) if args.sizes else None
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        raise UserError(f"--peak-tflops {args.peak_tflops}: must be > 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("check --device cuda: no CUDA device is visible to this process")
    proc = detect_process(args.device)
    if proc.device.type == "cuda":
        torch.cuda.set_device(proc.device)
    created = proc.world_size > 1 and not torch.distributed.is_initialized()
    if created:
        init_distributed(proc)
    try:
        rows = run_check(proc.device, sizes=sizes, peak=args.peak_tflops)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    if proc.is_main:
        print(json.dumps(to_json(rows), indent=2) if args.json else format_table(rows))
    return 1 if failed(rows) else 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from megaformer.checkpoint.io import resolve_checkpoint
    from megaformer.evaluation import tasks as task_lib
    from megaformer.training.distributed import detect_process, init_distributed

    tasks = task_lib.parse_tasks(args.tasks)
    for flag, value in (("--tp", args.tp), ("--pp", args.pp), ("--batch-size", args.batch_size)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be >= 1")
    resolve_checkpoint(args.checkpoint)  # a missing checkpoint fails before anything starts
    proc = detect_process(args.device)
    if proc.world_size % (args.tp * args.pp):
        raise UserError(f"--tp {args.tp} x --pp {args.pp} does not divide the world size "
                        f"{proc.world_size}")
    manager = task_lib.task_manager(tasks, args.include_path)  # unknown task, or no lm-eval
    topo = None
    created = False
    if proc.world_size > 1:
        from megaformer.parallel.topology import build_topology

        created = not torch.distributed.is_initialized()
        if created:
            init_distributed(proc)
        topo = build_topology(proc.world_size, proc.rank, tp=args.tp, pp=args.pp)
    elif args.tp * args.pp > 1:
        raise UserError(f"--tp {args.tp} --pp {args.pp}: launch {args.tp * args.pp} or more "
                        "processes (torchrun --nproc_per_node N -m megaformer eval ...)")
    from megaformer.evaluation.checkpoint import evaluate_checkpoint

    try:
        out = evaluate_checkpoint(args.checkpoint, tasks, manager, topo=topo, device=proc.device,
                                  is_main=proc.is_main, limit=args.limit,
                                  batch_size=args.batch_size, include_path=args.include_path,
                                  output=args.output, dtype=args.dtype,
                                  bootstrap_iters=args.bootstrap_iters)
    finally:
        if created:
            torch.distributed.destroy_process_group()
    if proc.is_main:
        print(out.table)
        print(f"\nresults: {out.path} ({out.seconds:.1f}s)")
    return 0


CONFIG_ERROR_GRACE_S = 15.0  # how long ranks > 0 wait for rank 0 to print a shared config error


def _report(error: UserError) -> None:
    """One line on stderr. Under a launcher, config errors (the same on every rank) are printed by
    rank 0 only; other errors may be rank-specific and name their rank."""
    rank = os.environ.get("RANK")
    if rank in (None, "", "0"):
        print(f"megaformer: error: {error}", file=sys.stderr)
    elif not isinstance(error, ConfigError):
        print(f"megaformer: error (rank {rank}): {error}", file=sys.stderr)
    else:
        # rank 0 meets the same error and prints it; the launcher stops the other ranks when the
        # first one exits, so give rank 0 the moment it needs (it ends this wait when it exits)
        import time

        time.sleep(CONFIG_ERROR_GRACE_S)


def _parse(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse ``argv`` with overrides and flags in any order: KEY=VALUE words after a flag (which
    argparse leaves over once the positionals are filled) join the subcommand's overrides."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        overrides = [e for e in extra if "=" in e and not e.startswith("-")]
        if hasattr(args, "overrides") and len(overrides) == len(extra):
            args.overrides = list(args.overrides or []) + overrides
        else:
            parser.error(f"unrecognized arguments: {' '.join(e for e in extra if e not in overrides)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = _parse(parser, argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    handlers = {"train": cmd_train, "generate": cmd_generate, "prepare-data": cmd_prepare_data,
                "convert": cmd_convert, "inspect": cmd_inspect, "check": cmd_check,
                "env": cmd_env, "eval": cmd_eval}
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
