"""``megaformer replay RUN --steps A..B``: re-run steps of a run bit for bit from its checkpoint
before A and say whether the losses reproduce and where (step, layer, micro-batch) a figure left its
band."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

NAME = "replay"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    rp = sub.add_parser(
        "replay",
        help="re-run steps A..B of a run with per-layer diagnostics (why did the loss spike?)",
        description="From RUN's last complete checkpoint before step A, train steps A..B again "
        "with RUN's own config at its layout (launch with as many ranks as the run had), "
        "logging every step with the residual-stream diagnostics and per-layer gradient and "
        "update norms. Prints whether the logged losses were reproduced bit for bit (if not: "
        "suspect the hardware of the original run), the first step and layer where the "
        "residual RMS, the max attention logit or the update norm / lr moved more than 4x from "
        "its median over the earlier replayed steps, and the first step, micro-batch and layer "
        "where a training micro-batch's loss, residual RMS or max attention logit did (each "
        "micro-batch of each step gets the diagnostics pass). Writes RUN/replay_A-B/ "
        "(metrics.jsonl, replay.md, replay.json); saves no checkpoint.",
    )
    rp.add_argument("run_dir", metavar="RUN")
    rp.add_argument(
        "--steps", required=True, metavar="A..B", help="steps to replay, e.g. 1200..1210"
    )
    rp.add_argument("--out", help="the replay's folder (default RUN/replay_A-B; must not exist)")
    return rp


def run(args: argparse.Namespace) -> int:
    from megaformer.training.replay import parse_steps, replay

    first, last = parse_steps(args.steps)
    report = replay(Path(args.run_dir), first, last, Path(args.out) if args.out else None)
    if int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(report.lines()))
    return 0
