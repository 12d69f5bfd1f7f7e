"""``megaformer plan``: feasible parallel layouts with estimated memory and MFU, best first."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megaformer.cli.common import config_args, load

NAME = "plan"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    pl = sub.add_parser(
        "plan",
        help="feasible parallel layouts with estimated memory and MFU, best first",
        description="Enumerate (TP, PP and its schedule, DP, ZeRO stage, micro-batch, recompute) "
        "layouts of CONFIG on "
        "N GPUs, estimate memory per GPU and step time from a compute + communication "
        "model, and list the feasible ones best first and the rejected ones with reasons. "
        "Context parallelism (CP, ring or all-to-all) is considered for sequences of "
        "8192 tokens and more, expert parallelism (EP) for MoE models.",
    )
    config_args(pl)
    pl.add_argument("--gpus", type=int, required=True, help="number of GPUs")
    pl.add_argument(
        "--gpu-mem", type=float, help="memory per GPU in GB (default: the table's, with --gpu)"
    )
    pl.add_argument("--gpu", help="accelerator name (peak FLOP/s and default bandwidths)")
    pl.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU instead of the table's")
    pl.add_argument("--nodes-of", type=int, default=8, help="GPUs per node (8)")
    pl.add_argument("--intra-bw", type=float, help="GB/s per GPU within a node (unidirectional)")
    pl.add_argument("--inter-bw", type=float, help="GB/s per GPU between nodes (unidirectional)")
    pl.add_argument(
        "--efficiency", type=float, default=0.6, help="fraction of peak the matmuls reach (0.6)"
    )
    pl.add_argument("--top", type=int, default=10, help="feasible layouts to print (10)")
    pl.add_argument(
        "--relayout",
        metavar="RUN_DIR",
        help="for a launch of --gpus ranks of the run in RUN_DIR: print the KEY=VALUE overrides "
        "of its layout (none: the config's own, when the count is the one the run's first "
        "launch recorded in RUN_DIR/layout.json; else the best feasible layout here, global "
        "batch kept) and, on stderr, why. What launch/torchrun.sh and launch/slurm.sbatch "
        "run with LAYOUT=auto",
    )
    return pl


def run(args: argparse.Namespace) -> int:
    from megaformer.analysis.planner import format_plan, plan_from_args

    if args.relayout is not None:
        return _relayout(args)
    result = plan_from_args(load(args), args)
    print(json.dumps(result, indent=2) if args.json else format_plan(result, args.top))
    return 0


def _relayout(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from megaformer.analysis.elastic import relayout
    from megaformer.analysis.planner import plan_from_args
    from megaformer.config import load_config, validate_for_world

    def plan(cfg: Any) -> dict:
        if args.gpu is None and args.peak_tflops is None and cfg.log.gpu is not None:
            args.gpu = cfg.log.gpu  # the run's own accelerator name
        return plan_from_args(cfg, args)

    words, reason = relayout(
        lambda extra: load_config(args.config, [*args.overrides, *extra]),
        args.gpus,
        Path(args.relayout),
        plan,
        validate_for_world,
    )
    print(" ".join(words))
    print(f"megaformer layout: {reason}", file=sys.stderr)
    return 0
