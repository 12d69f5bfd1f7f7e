"""``megaformer env``: versions, GPUs and kernels of this machine, for an issue report."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "env"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    env = sub.add_parser(
        "env",
        help="versions, GPUs and kernels of this machine, for an issue report",
        description="Print what an issue report needs: megaformer, Python, torch (with its CUDA, "
        "cuDNN and NCCL), deepspeed, flash-attn, triton, apex, transformers, the GPUs "
        "with their peak-table entry, which implementation runs for each op, and the C "
        "compiler of the native CPU kernels.",
    )
    env.add_argument(
        "--config",
        metavar="CONFIG",
        help="YAML config whose model and train.precision the kernel rows describe "
        "(default: the default model section, bf16 on CUDA, fp32 on CPU)",
    )
    return env


def run(args: argparse.Namespace) -> int:
    from megaformer.analysis.env import collect, format_report

    model_cfg = dtype = None
    if args.config:
        from megaformer.config import load_config, precision_dtype

        cfg = load_config(args.config)
        model_cfg = cfg.model
        dtype = precision_dtype(cfg.train.precision)
    print(format_report(*collect(model_cfg, dtype=dtype)))
    return 0
