"""The analysis subcommands of ``megaformer``: flops, plan, report, bench.

Parsers are added by :func:`add_parsers`; :data:`HANDLERS` maps each name to its function. Heavy
imports (torch models, matplotlib, transformers) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Callable

from megaformer.errors import UserError


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="dotted config overrides, e.g. train.global_batch_size=512")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def add_parsers(sub: Any) -> None:
    fl = sub.add_parser(
        "flops", help="parameter counts, FLOPs per token/step and MFU of a step time",
        description="Exact matmul FLOPs of CONFIG's training step (model FLOPs for MFU, hardware "
                    "FLOPs with recomputation and the padded vocabulary for HFU) and what a measured "
                    "step time means in TFLOP/s per GPU and MFU.")
    _config_args(fl)
    fl.add_argument("--gpu", help="accelerator name from the peak table (e.g. H100-SXM, A100, MI300X)")
    fl.add_argument("--gpus", type=int, default=1, help="GPUs taking part in the step (1)")
    fl.add_argument("--step-time", type=float, help="measured seconds per optimizer step")
    fl.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU (any accelerator)")
    fl.add_argument("--dtype", choices=("fp32", "tf32", "bf16", "fp16", "fp8"),
                    help="peak column (default: from train.precision)")
    fl.add_argument("--non-causal", action="store_true",
                    help="count all s^2 attention pairs (Megatron SC21 / PaLM convention)")

    pl = sub.add_parser(
        "plan", help="feasible parallel layouts with estimated memory and MFU, best first",
        description="Enumerate (TP, PP, DP, ZeRO stage, micro-batch, recompute) layouts of CONFIG on "
                    "N GPUs, estimate memory per GPU and step time from a compute + communication "
                    "model, and list the feasible ones best first and the rejected ones with reasons. "
                    "Context parallelism (CP, ring or all-to-all) is considered for sequences of "
                    "8192 tokens and more, expert parallelism (EP) for MoE models.")
    _config_args(pl)
    pl.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    pl.add_argument("--gpu-mem", type=float, help="memory per GPU in GB (default: the table's, with --gpu)")
    pl.add_argument("--gpu", help="accelerator name (peak FLOP/s and default bandwidths)")
    pl.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU instead of the table's")
    pl.add_argument("--nodes-of", type=int, default=8, help="GPUs per node (8)")
    pl.add_argument("--intra-bw", type=float, help="GB/s per GPU within a node (unidirectional)")
    pl.add_argument("--inter-bw", type=float, help="GB/s per GPU between nodes (unidirectional)")
    pl.add_argument("--efficiency", type=float, default=0.6,
                    help="fraction of peak the matmuls reach (0.6)")
    pl.add_argument("--top", type=int, default=10, help="feasible layouts to print (10)")

    rp = sub.add_parser(
        "report", help="plots and a markdown summary of a run directory",
        description="Read RUN_DIR/metrics.jsonl (or its TensorBoard events) and write PNG plots of loss, "
                    "lr, tokens/s, TFLOP/s per GPU, MFU and memory over steps plus summary.md with "
                    "medians. Works on a run still in progress.")
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument("run_b", metavar="RUN_B", nargs="?",
                    help="a second run: overlay its loss and per-layer diagnostics on RUN_DIR's and "
                         "print where they first diverge (RUN_DIR/compare_<RUN_B>/comparison.md)")
    rp.add_argument("--out", help="output folder (default RUN_DIR/report)")
    rp.add_argument("--threshold", type=float, default=0.05,
                    help="with RUN_B: relative difference that counts as diverged (0.05)")

    bn = sub.add_parser(
        "bench", help="time training steps (optionally against Hugging Face transformers)",
        description="Warm-up, then timed training steps of CONFIG's model on random tokens in one "
                    "process: tokens/s, TFLOP/s per device, MFU (with --gpu/--peak-tflops), peak "
                    "memory. --compare-hf builds the same architecture as a transformers model "
                    "(LlamaForCausalLM or GPT2LMHeadModel), same batch and AdamW, and alternates steps. "
                    "On CPU train.cpu_malloc applies to the whole process (both models) and each "
                    "model's minor page faults per step are printed.")
    _config_args(bn)
    bn.add_argument("--steps", type=int, default=10, help="timed steps per model (10)")
    bn.add_argument("--warmup", type=int, default=2, help="untimed warm-up steps (2)")
    bn.add_argument("--compare-hf", action="store_true", help="also time the transformers model")
    bn.add_argument("--device", default=None, help="cpu or cuda (default: train.device)")
    bn.add_argument("--gpu", help="accelerator name for MFU (default: the CUDA device's name)")
    bn.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device for MFU")
    bn.add_argument("--sequential", action="store_true",
                    help="time one model after the other instead of alternating steps (only one "
                         "model in memory: large models on one GPU)")


def _load(args: argparse.Namespace) -> Any:
    from megaformer.config import load_config

    return load_config(args.config, args.overrides)


def cmd_flops(args: argparse.Namespace) -> int:
    from megaformer.analysis.summary import flops_summary, format_flops_summary

    d = flops_summary(_load(args), gpu=args.gpu, gpus=args.gpus, step_time_s=args.step_time,
                      peak=args.peak_tflops, dtype=args.dtype, causal=not args.non_causal)
    print(json.dumps(d, indent=2) if args.json else format_flops_summary(d))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from megaformer.analysis.planner import format_plan, plan_from_args

    result = plan_from_args(_load(args), args)
    print(json.dumps(result, indent=2) if args.json else format_plan(result, args.top))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from megaformer.analysis.report import write_comparison, write_report

    if args.run_b is not None:
        c = write_comparison(args.run_dir, args.run_b, args.out, args.threshold)
        print("\n".join(c["lines"]))
        print(f"comparison: {c['summary']} ({len(c['plots'])} plots)")
        return 0
    r = write_report(args.run_dir, args.out)
    print(f"report: {r['summary']} ({len(r['plots'])} plots, {r['records']} records)")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from megaformer.analysis.bench import format_bench, run_bench

    if args.steps < 1 or args.warmup < 0:
        raise UserError(f"--steps {args.steps} / --warmup {args.warmup}: need steps >= 1, warmup >= 0")
    r = run_bench(_load(args), steps=args.steps, warmup=args.warmup, compare_hf=args.compare_hf,
                  device=args.device, gpu=args.gpu, peak=args.peak_tflops, sequential=args.sequential)
    print(json.dumps(r, indent=2) if args.json else format_bench(r))
    return 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "flops": cmd_flops, "plan": cmd_plan, "report": cmd_report, "bench": cmd_bench,
}
