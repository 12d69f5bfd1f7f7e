"""``megaformer check``: preflight check of this node (kernels, matmul/attention TFLOP/s, all-reduce)."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from megaformer.errors import UserError

NAME = "check"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    chk = sub.add_parser(
        "check",
        help="preflight check of this node: kernels, matmul/attention TFLOP/s, all-reduce",
        description="\n\n".join(
            textwrap.fill(p, 88)
            for p in (
                "Check the node(s) before a long job. Each rank checks its own device: every kernel "
                "(attention, SwiGLU, bias-GELU, RMSNorm, LayerNorm, RoPE, cross-entropy, linear, "
                "dropout) against a float64 torch formula, forward and backward, in bf16/fp16/fp32 on "
                "a GPU (fp32 on CPU); bf16 matmul and attention TFLOP/s against the peak table; under "
                "torchrun/srun with several ranks, the all-reduce bus bandwidth (nccl-tests' busbw) "
                "per rank. A GPU, or a rank's all-reduce bandwidth, more than 10% below its peers "
                "fails. Rank 0 prints one table; the exit code is 1 when a check failed.",
                "On CPU the kernels are checked in fp32, the matmul throughput is measured (no peak) "
                "and the all-reduce runs over gloo; the rows that need a GPU say so.",
            )
        ),
        epilog="examples:\n"
        "  megaformer check\n"
        "  torchrun --nproc_per_node 8 -m megaformer check\n"
        "  srun -N 4 --ntasks-per-node 8 python -m megaformer check --sizes 64MiB,1GiB",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chk.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda (this rank's GPU: cuda:LOCAL_RANK) or cpu (default: cuda when available)",
    )
    chk.add_argument(
        "--sizes",
        metavar="SIZES",
        help="all-reduce message sizes, comma-separated, e.g. 1MiB,64MiB,1GiB "
        "(default 1MiB,16MiB,256MiB on GPUs, 256KiB,4MiB on CPU)",
    )
    chk.add_argument(
        "--peak-tflops",
        type=float,
        help="peak TFLOP/s per GPU instead of the table's (a GPU not in the table)",
    )
    chk.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the table"
    )
    return chk


def run(args: argparse.Namespace) -> int:
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
