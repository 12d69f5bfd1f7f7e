"""``megaformer eval``: lm-evaluation-harness tasks on a checkpoint, at any layout."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from megaformer.cli.common import check_layout_args, launch_process, launched, layout_args
from megaformer.errors import UserError

NAME = "eval"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    ev = sub.add_parser(
        "eval",
        help="score a checkpoint on lm-evaluation-harness tasks",
        description="\n\n".join(
            textwrap.fill(p, 88)
            for p in (
                "Run EleutherAI's lm-evaluation-harness tasks on a megaformer checkpoint (the latest "
                "one of a run directory) with megaformer's own model and tokenizer: no conversion to "
                "Hugging Face. Log-likelihood tasks (multiple choice), rolling log-likelihood "
                "(perplexity, in windows of model.max_seq_len) and greedy generation (with the KV "
                "cache) are supported.",
                "Under torchrun/srun the model is laid out as in training: --tp/--pp split it, the "
                "remaining ranks are data-parallel and share the requests (--ep splits an MoE "
                "model's experts over them: each rank holds its own, the tokens travel to them); "
                "rank 0 gathers the scores, "
                "prints a table and writes them as JSON (default CKPT/eval/TASKS.json, replaced "
                "atomically).",
                "Tasks come from lm-eval's registry or from --include-path (a folder of task YAMLs). "
                "Needs pip install megaformer[eval]; set HF_DATASETS_OFFLINE=1 to keep dataset "
                "loading off the network.",
            )
        ),
        epilog="examples:\n"
        "  megaformer eval runs/quickstart --tasks hellaswag,arc_easy --limit 100\n"
        "  megaformer eval runs/quickstart --tasks my_task --include-path my_tasks/\n"
        "  torchrun --nproc_per_node 8 -m megaformer eval runs/big --tasks mmlu --tp 2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ev.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    ev.add_argument(
        "--tasks",
        required=True,
        metavar="T1,T2",
        help="comma-separated lm-eval task (or group) names",
    )
    ev.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="at most N documents per task (default: all)",
    )
    ev.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="sequences per forward pass (8)"
    )
    ev.add_argument("--include-path", metavar="DIR", help="folder of extra task YAMLs")
    ev.add_argument("--output", metavar="PATH", help="results JSON (default: CKPT/eval/TASKS.json)")
    layout_args(ev, experts=True)
    ev.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="weights and activations (fp32)",
    )
    ev.add_argument(
        "--bootstrap-iters",
        type=int,
        default=0,
        metavar="N",
        help="standard errors: 0 = none (default); N > 0 = the exact one for mean "
        "metrics (accuracy) and N bootstrap resamples for the others "
        "(perplexity)",
    )
    ev.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda (this rank's GPU) or cpu (default: cuda when available)",
    )
    return ev


def run(args: argparse.Namespace) -> int:
    from megaformer.checkpoint.layout import resolve_checkpoint
    from megaformer.evaluation import tasks as task_lib

    check_layout_args(args)
    tasks = task_lib.parse_tasks(args.tasks)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: must be >= 1")
    resolve_checkpoint(args.checkpoint)  # a missing checkpoint fails before anything starts
    proc = launch_process("eval", args.device, args.tp, args.pp, args.ep)
    manager = task_lib.task_manager(tasks, args.include_path)  # unknown task, or no lm-eval
    with launched(proc, args.tp, args.pp, args.ep) as topo:
        from megaformer.evaluation.checkpoint import evaluate_checkpoint

        out = evaluate_checkpoint(
            args.checkpoint,
            tasks,
            manager,
            topo=topo,
            device=proc.device,
            is_main=proc.is_main,
            limit=args.limit,
            batch_size=args.batch_size,
            include_path=args.include_path,
            output=args.output,
            dtype=args.dtype,
            bootstrap_iters=args.bootstrap_iters,
            schedule=args.schedule,
            virtual_stages=args.virtual_stages,
        )
    if proc.is_main:
        print(out.table)
        print(f"\nresults: {out.path} ({out.seconds:.1f}s)")
    return 0
