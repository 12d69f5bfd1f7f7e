"""``megaformer report``: plots and a markdown summary of a run directory (or two, compared)."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "report"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    rp = sub.add_parser(
        "report",
        help="plots and a markdown summary of a run directory",
        description="Read RUN_DIR/metrics.jsonl (or its TensorBoard events) and write PNG plots of loss, "
        "lr, tokens/s, TFLOP/s per GPU, MFU and memory over steps plus summary.md with "
        "medians; list the run's profiler traces, memory snapshots, straggler and hang "
        "files. Works on a run still in progress.",
    )
    rp.add_argument("run_dir", metavar="RUN_DIR")
    rp.add_argument(
        "run_b",
        metavar="RUN_B",
        nargs="?",
        help="a second run: overlay its loss and per-layer diagnostics on RUN_DIR's and "
        "print where they first diverge (RUN_DIR/compare_<RUN_B>/comparison.md)",
    )
    rp.add_argument("--out", help="output folder (default RUN_DIR/report)")
    rp.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="with RUN_B: relative difference that counts as diverged (0.05)",
    )
    return rp


def run(args: argparse.Namespace) -> int:
    from megaformer.analysis.report import write_comparison, write_report

    if args.run_b is not None:
        c = write_comparison(args.run_dir, args.run_b, args.out, args.threshold)
        print("\n".join(c["lines"]))
        print(f"comparison: {c['summary']} ({len(c['plots'])} plots)")
        return 0
    r = write_report(args.run_dir, args.out)
    for rel, what in r["artifacts"]:
        print(f"{rel}: {what}")
    print(f"report: {r['summary']} ({len(r['plots'])} plots, {r['records']} records)")
    return 0
