"""Plots of the per-layer diagnostics series in a run's metrics (for ``megaformer report``).

One PNG per family, one line per layer, coloured from shallow (dark) to deep (light):
``diag_resid_rms.png``, ``diag_attn_write_rms.png``, ``diag_mlp_write_rms.png``,
``diag_attn_max_logit.png``, ``diag_logit_lens_loss.png``; and per head, one panel per layer,
one line per head: ``diag_attn_entropy.png``, ``diag_head_write_norm.png``.

Two runs (``megaformer report RUN_A RUN_B``): :func:`plot_comparison` draws one PNG per layer
family, ``compare_diag_*.png``, each layer in one colour, run A solid and run B dashed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# (file stem, title, y label, key pattern with groups (layer) or (layer, head))
LAYER_FAMILIES = [
    ("diag_resid_rms", "Residual stream RMS", "RMS", r"resid/(layer_\d+|embed)/rms"),
    ("diag_attn_write_rms", "Attention write RMS", "RMS", r"attn_write/(layer_\d+)/rms"),
    ("diag_mlp_write_rms", "MLP write RMS", "RMS", r"mlp_write/(layer_\d+)/rms"),
    (
        "diag_attn_max_logit",
        "Largest attention logit",
        "q.k / sqrt(d_k)",
        r"attn/(layer_\d+)/max_logit",
    ),
    ("diag_logit_lens_loss", "Logit-lens loss", "nats/token", r"logit_lens/(layer_\d+)/loss"),
    ("diag_router_max_logit", "Largest router logit (MoE)", "|z|", r"router/(layer_\d+)/max_logit"),
    (
        "diag_router_load_cv",
        "Expert load imbalance (MoE)",
        "std / mean",
        r"router/(layer_\d+)/load_cv",
    ),
]
HEAD_FAMILIES = [
    (
        "diag_attn_entropy",
        "Attention entropy per head",
        "nats",
        r"attn/(layer_\d+)/entropy/(head_\d+)",
    ),
    ("diag_head_write_norm", "Head write norm", "norm", r"attn_write/(layer_\d+)/(head_\d+)/norm"),
]


MAX_DRAWN = 32  # layers (lines or panels) and heads drawn per figure; more are thinned evenly


def thinned(names: list, limit: int = MAX_DRAWN) -> list:
    """At most ``limit`` of ``names``, evenly spaced, first and last kept: a metrics file naming
    thousands of layers draws a bounded figure (the numbers stay in metrics.jsonl)."""
    if len(names) <= limit:
        return list(names)
    return [names[round(i * (len(names) - 1) / (limit - 1))] for i in range(limit)]


def _collect(records: list[dict], pattern: str) -> dict[tuple, tuple[list[int], list[float]]]:
    """{groups of the key: (steps, values)} for keys matching ``pattern``, sorted by key."""
    rx = re.compile(pattern + "$")
    series: dict[tuple, tuple[list[int], list[float]]] = {}
    for r in records:
        for key, value in r.items():
            m = rx.match(key)
            if m and isinstance(value, (int, float)):
                steps, values = series.setdefault(m.groups(), ([], []))
                steps.append(r["step"])
                values.append(float(value))
    return dict(sorted(series.items(), key=lambda kv: (kv[0][0] != "embed", kv[0])))


def _drawn(series: dict[tuple, Any]) -> dict[tuple, Any]:
    """``series`` with at most :data:`MAX_DRAWN` distinct values of each group (layer, head)."""
    for level in range(len(next(iter(series), ()))):
        kept = set(thinned(list(dict.fromkeys(g[level] for g in series))))
        series = {g: s for g, s in series.items() if g[level] in kept}
    return series


def _lines(ax: Any, series: dict, label_index: int) -> None:
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    n = len(series)
    for i, (groups, (x, y)) in enumerate(series.items()):
        ax.plot(
            x,
            y,
            color=cmap(i / max(1, n - 1) * 0.9),
            label=groups[label_index],
            marker="o" if len(x) < 30 else None,
            markersize=2,
            linewidth=1,
        )
    ax.grid(alpha=0.3)


def plot_diagnostics(records: list[dict], out: Path) -> list[Path]:
    """The PNGs above for the families present in ``records``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for stem, title, ylabel, pattern in LAYER_FAMILIES:
        series = _drawn(_collect(records, pattern))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7.2, 4.0), dpi=100)
        _lines(ax, series, 0)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=6, ncol=1 + len(series) // 12, loc="best")
        fig.tight_layout()
        written.append(out / f"{stem}.png")
        fig.savefig(written[-1])
        plt.close(fig)
    for stem, title, ylabel, pattern in HEAD_FAMILIES:
        series = _drawn(_collect(records, pattern))
        layers = sorted({g[0] for g in series})
        if not layers:
            continue
        cols = min(4, len(layers))
        rows = -(-len(layers) // cols)
        fig, axes = plt.subplots(
            rows, cols, figsize=(3.2 * cols, 2.6 * rows), dpi=100, squeeze=False, sharex=True
        )
        for i, layer in enumerate(layers):
            ax = axes[i // cols][i % cols]
            _lines(ax, {g: s for g, s in series.items() if g[0] == layer}, 1)
            ax.set_title(layer, fontsize=9)
            ax.tick_params(labelsize=7)
            if i == 0:
                ax.legend(fontsize=5, ncol=2)
        for j in range(len(layers), rows * cols):
            axes[j // cols][j % cols].axis("off")
        fig.suptitle(f"{title} ({ylabel}) vs step")
        fig.tight_layout()
        written.append(out / f"{stem}.png")
        fig.savefig(written[-1])
        plt.close(fig)
    return written


def layer_series(records: list[dict], stem: str) -> dict[str, tuple[list[int], list[float]]]:
    """{layer name: (steps, values)} of the layer family ``stem`` (e.g. ``diag_resid_rms``)."""
    pattern = {f[0]: f[3] for f in LAYER_FAMILIES}[stem]
    return {g[0]: xy for g, xy in _collect(records, pattern).items()}


def plot_comparison(a: list[dict], b: list[dict], labels: tuple[str, str], out: Path) -> list[Path]:
    """``compare_diag_*.png`` for the layer families both runs logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("viridis")
    written = []
    for stem, title, ylabel, _ in LAYER_FAMILIES:
        sa, sb = layer_series(a, stem), layer_series(b, stem)
        layers = thinned([name for name in sa if name in sb])
        if not layers:
            continue
        fig, ax = plt.subplots(figsize=(7.2, 4.0), dpi=100)
        for i, name in enumerate(layers):
            colour = cmap(i / max(1, len(layers) - 1) * 0.9)
            ax.plot(*sa[name], color=colour, linewidth=1, label=name)
            ax.plot(*sb[name], color=colour, linewidth=1, linestyle="--")
        ax.set_title(f"{title}: {labels[0]} (solid) vs {labels[1]} (dashed)", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=1 + len(layers) // 12, loc="best")
        fig.tight_layout()
        written.append(out / f"compare_{stem}.png")
        fig.savefig(written[-1])
        plt.close(fig)
    return written
