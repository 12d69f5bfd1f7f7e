"""``megaformer inspect``: the logit lens and attention heatmaps of a prompt."""

from __future__ import annotations

import argparse
from typing import Any

NAME = "inspect"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    ins = sub.add_parser(
        "inspect",
        help="logit lens and attention heatmaps of a prompt",
        description="Run a prompt through a trained model (its latest checkpoint when given a run "
        "directory) and print, for every position, the top-k next tokens that the "
        "output layer reads from the residual stream after the embedding and after each "
        "layer (the logit lens; the last row is the model's prediction). With --out, "
        "also write one PNG per layer with a heatmap of each head's attention pattern, "
        "and the table as logit_lens.txt.",
        epilog="example: megaformer inspect runs/quickstart --prompt 'def main():' --out inspect/",
    )
    ins.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT")
    ins.add_argument("--prompt", required=True, help="text to inspect (at most max_seq_len tokens)")
    ins.add_argument("--out", metavar="DIR", help="new folder for the heatmaps (not overwritten)")
    ins.add_argument("--top-k", type=int, default=5, help="tokens shown per layer and position (5)")
    ins.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    return ins


def run(args: argparse.Namespace) -> int:
    from megaformer.diagnostics.inspect import inspect

    r = inspect(args.checkpoint, args.prompt, args.out, top_k=args.top_k, device=args.device)
    print(r.table)
    if r.heatmaps:
        print(f"attention heatmaps: {len(r.heatmaps)} PNGs in {r.heatmaps[0].parent}")
    else:
        print("(add --out DIR for the attention heatmaps)")
    return 0
