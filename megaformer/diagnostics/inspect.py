"""``megaformer inspect RUN_DIR_OR_CHECKPOINT --prompt TEXT [--out DIR]``.

For one prompt, the logit lens (nostalgebraist 2020): the output layer applied to the residual
stream after the embedding and after every block,

    p_l(next token | position t) = softmax(W_out Norm_final(x_l[t])),

printed as the top-k tokens per position per layer (the last row of each position is the model's
own prediction), and, with ``--out``, one PNG per layer with a heatmap of every head's attention
pattern softmax(q k^T / sqrt(d_k) + M) (rows: query positions, columns: key positions), plus the
table as ``logit_lens.txt``. For a Mixture-of-Experts model, also the expert load of the prompt:
how many of its tokens each MoE block routes to each expert (top-k choices, load-balancing bias
included). Runs on the checkpoint's fp32 weights without DeepSpeed or a process group.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from megaformer.data.tokenizer import Tokenizer
from megaformer.diagnostics.metrics import head_name, layer_name
from megaformer.diagnostics.residual import LayerTrace, eval_mode, logit_lens_logits, trace_layers
from megaformer.errors import UserError

MAX_LABELLED_TOKENS = 48  # longer prompts get heatmaps without per-token tick labels


@dataclass
class Inspection:
    tokens: list[str]  # the prompt's tokens, shown
    rows: list[str]  # "embed", "layer_00", ...
    top: list[list[list[tuple[str, float]]]]  # [row][position] -> [(token, p)] * k
    heatmaps: list[Path]
    table: str
    expert_load: Optional[dict[int, list[int]]] = None  # MoE block -> tokens routed per expert


def show_token(tokenizer: Tokenizer, token_id: int) -> str:
    """A token as a short printable string: repr of its text, <eod>, or <0xNN> for a lone byte."""
    if token_id == getattr(tokenizer, "eod_id", None):
        return "<eod>"
    text = tokenizer.decode([token_id])
    if text in ("", "\ufffd") and token_id < 256:
        return f"<0x{token_id:02x}>"
    return repr(text)


def _prompt_ids(tokenizer: Tokenizer, prompt: str, max_len: int) -> list[int]:
    if not prompt:
        raise UserError("inspect: --prompt is empty; give the text to inspect")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UserError(f"inspect: --prompt {prompt!r} encodes to no tokens")
    if len(ids) > max_len:
        raise UserError(
            f"inspect: --prompt is {len(ids)} tokens, longer than the model's "
            f"max_seq_len={max_len}; shorten it"
        )
    return list(ids)


def _prepare_out(out: Optional[str | Path]) -> Optional[Path]:
    if out is None:
        return None
    path = Path(out)
    if os.path.islink(path):  # a dangling link would make mkdir fail, a live one redirect it
        raise UserError(f"inspect: --out {path} is a symbolic link; choose a new folder")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise UserError(
            f"inspect: --out {path} exists and is not an empty folder; "
            "choose a new one (nothing is overwritten)"
        )
    return path


def lens_top_k(
    model: Any, streams: list[torch.Tensor], k: int, tokenizer: Tokenizer
) -> list[list[list[tuple[str, float]]]]:
    """[stream][position] -> the k likeliest next tokens with their probabilities."""
    out = []
    for x in streams:
        probs = torch.softmax(model.output_logits(logit_lens_logits(model, x)).float()[0], dim=-1)
        p, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
        out.append(
            [
                [(show_token(tokenizer, int(i)), float(q)) for i, q in zip(row_i, row_p)]
                for row_i, row_p in zip(ids.tolist(), p.tolist())
            ]
        )
    return out


def format_table(tokens: list[str], rows: list[str], top: list) -> str:
    width = max(len(t) for t in tokens)
    lines = [f"{'pos':>4}  {'token':<{width}}  {'after':<9} top next tokens (probability)"]
    for pos, token in enumerate(tokens):
        for r, row in enumerate(rows):
            preds = "  ".join(f"{t} {p:.3f}" for t, p in top[r][pos])
            lines.append(
                f"{pos if r == 0 else '':>4}  {token if r == 0 else '':<{width}}  {row:<9} {preds}"
            )
    return "\n".join(lines)


def plot_attention(trace: LayerTrace, tokens: list[str], n_layers: int, out: Path) -> Path:
    """One PNG: a heatmap of each head's attention probabilities (batch row 0)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probs = trace.probs[0].cpu().numpy()  # [h, T, T]
    heads, T = probs.shape[0], probs.shape[1]
    cols = min(4, heads)
    rows = -(-heads // cols)
    size = 2.2 + 0.12 * min(T, MAX_LABELLED_TOKENS)
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), dpi=100, squeeze=False)
    labels = T <= MAX_LABELLED_TOKENS
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        im = ax.imshow(probs[h], vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(head_name(h, heads), fontsize=9)
        if labels:
            ax.set_xticks(range(T), tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(T), tokens, fontsize=6)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    name = layer_name(trace.index, n_layers)
    fig.suptitle(f"attention probabilities, {name}")
    fig.colorbar(im, ax=axes, shrink=0.6)
    path = out / f"attention_{name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def inspect(
    checkpoint: str | Path,
    prompt: str,
    out: Optional[str | Path] = None,
    top_k: int = 5,
    device: str = "cpu",
) -> Inspection:
    """Logit lens and attention heatmaps of ``prompt`` under a checkpoint's model."""
    from megaformer.generation import load_checkpoint_model

    if top_k < 1:
        raise UserError(f"inspect: --top-k {top_k}: must be >= 1")
    out_dir = _prepare_out(out)
    model, tokenizer, cfg, _ = load_checkpoint_model(checkpoint, device)
    ids = _prompt_ids(tokenizer, prompt, cfg.model.max_seq_len)
    x = torch.tensor([ids], dtype=torch.long, device=device)
    load: dict[int, list[int]] = {}
    with eval_mode(model), _expert_load(model, load):
        x0, rope = model.embed(x)
        traces = list(trace_layers(model, x0, rope))
        streams = [x0] + [t.resid for t in traces]
        top = lens_top_k(model, streams, top_k, tokenizer)
    n = cfg.model.n_layers
    tokens = [show_token(tokenizer, i) for i in ids]
    rows = ["embed"] + [layer_name(i, n) for i in range(n)]
    table = format_table(tokens, rows, top)
    if load:
        table += "\n\n" + format_expert_load(load, len(ids), cfg.model.moe.top_k)
    heatmaps: list[Path] = []
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        heatmaps = [plot_attention(t, tokens, n, out_dir) for t in traces]
        (out_dir / "logit_lens.txt").write_text(table + "\n")
    return Inspection(tokens, rows, top, heatmaps, table, load or None)


@contextlib.contextmanager
def _expert_load(model: Any, load: dict[int, list[int]]) -> Iterator[None]:
    """While active: each MoE block's routing of its input, as tokens per expert, into ``load``."""
    from megaformer.model.moe import moe_layers

    def hook(block: Any, args: tuple) -> None:
        x = args[0]
        idx = block.route(x.reshape(-1, x.shape[-1]))[1]
        load[block.layer] = torch.bincount(idx.reshape(-1), minlength=block.num_experts).tolist()

    handles = [m.register_forward_pre_hook(hook) for m in moe_layers(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def format_expert_load(load: dict[int, list[int]], tokens: int, k: int) -> str:
    """Per MoE block: tokens routed to each expert, and the coefficient of variation (std / mean;
    0 = balanced) of that load."""
    lines = [f"expert load: tokens routed to each expert ({tokens} tokens x top-{k})"]
    for layer, row in sorted(load.items()):
        t = torch.tensor(row, dtype=torch.float64)
        cv = float(t.std(unbiased=False) / t.mean()) if t.mean() > 0 else 0.0
        lines.append(
            f"  {layer_name(layer, max(load) + 1)}  "
            + " ".join(f"{c:>4}" for c in row)
            + f"   cv {cv:.2f}"
        )
    return "\n".join(lines)
