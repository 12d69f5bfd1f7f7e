"""``megaformer flops``: parameter counts, FLOPs per token and step, MFU of a step time."""

from __future__ import annotations

import argparse
import json
from typing import Any

from megaformer.cli.common import config_args, load

NAME = "flops"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    fl = sub.add_parser(
        "flops",
        help="parameter counts, FLOPs per token/step and MFU of a step time",
        description="Exact matmul FLOPs of CONFIG's training step (model FLOPs for MFU, hardware "
        "FLOPs with recomputation and the padded vocabulary for HFU) and what a measured "
        "step time means in TFLOP/s per GPU and MFU.",
    )
    config_args(fl)
    fl.add_argument(
        "--gpu", help="accelerator name from the peak table (e.g. H100-SXM, A100, MI300X)"
    )
    fl.add_argument("--gpus", type=int, default=1, help="GPUs taking part in the step (1)")
    fl.add_argument("--step-time", type=float, help="measured seconds per optimizer step")
    fl.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU (any accelerator)")
    fl.add_argument(
        "--dtype",
        choices=("fp32", "tf32", "bf16", "fp16", "fp8"),
        help="peak column (default: from train.precision)",
    )
    fl.add_argument(
        "--non-causal",
        action="store_true",
        help="count all s^2 attention pairs (Megatron SC21 / PaLM convention)",
    )
    return fl


def run(args: argparse.Namespace) -> int:
    from megaformer.analysis.summary import flops_summary, format_flops_summary

    d = flops_summary(
        load(args),
        gpu=args.gpu,
        gpus=args.gpus,
        step_time_s=args.step_time,
        peak=args.peak_tflops,
        dtype=args.dtype,
        causal=not args.non_causal,
    )
    print(json.dumps(d, indent=2) if args.json else format_flops_summary(d))
    return 0
