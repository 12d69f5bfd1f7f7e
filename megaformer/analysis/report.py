"""``megaformer report RUN_DIR``: PNG plots and a markdown summary of a run's metrics.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per logged step; a partly written last line of a
run in progress is skipped), or, without it, the scalars of ``RUN_DIR/tensorboard``. Writes
``loss.png``, ``lr.png``, ``tokens_per_s.png``, ``tflops_per_gpu.png``, ``mfu.png``,
``memory.png``, the per-layer diagnostics series (``diag_*.png``, see
:mod:`megaformer.diagnostics.plots`) (those with data) and ``summary.md``: the last step and loss, and the medians of
the throughput metrics over the logged intervals (the first interval, which holds the warm-up
steps, is left out of the medians when there are at least three).

``megaformer report RUN_A RUN_B`` compares two runs (e.g. FP8 against bf16): ``compare_loss.png``
(both losses and their relative difference), ``compare_diag_*.png`` (every per-layer family both
runs logged: each layer one colour, A solid, B dashed) and ``comparison.md``, which names for each
quantity the first step, and at that step the shallowest layer, where

    |b - a| > threshold * |a|          (over the steps both runs logged; NaN on one side counts)

so a numerical divergence shows where it starts. Written to RUN_A/compare_<RUN_B name>/ unless
``--out`` is given.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional, Union

from megaformer.errors import UserError
from megaformer.safe_files import make_dir, read_text_bounded, refuse_link, write_atomic

METRICS_FILE = "metrics.jsonl"
MAX_METRICS_BYTES = 1 << 33

# (file stem, title, [(key, label)], y label)
PLOTS = [
    ("loss", "Loss", [("loss", "train"), ("val_loss", "validation")], "nats/token"),
    ("lr", "Learning rate", [("lr", "lr")], "lr"),
    ("tokens_per_s", "Throughput", [("tokens_per_s", "tokens/s")], "tokens/s"),
    (
        "tflops_per_gpu",
        "TFLOP/s per GPU",
        [
            ("tflops_per_gpu", "model"),
            ("hw_tflops_per_gpu", "hardware"),
            ("fp8_tflops_per_gpu", "model, in FP8 GEMMs"),
        ],
        "TFLOP/s",
    ),
    (
        "mfu",
        "Utilisation",
        [("mfu", "MFU"), ("hfu", "HFU"), ("mfu_mixed", "MFU vs mixed FP8 peak")],
        "fraction of peak",
    ),
    ("memory", "Peak memory", [("peak_mem_gb", "peak")], "GB"),
]
MEDIANS = [
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("step_time_s", "step time (s)", "{:.4g}"),
    ("tflops_per_gpu", "TFLOP/s per GPU (model)", "{:.4g}"),
    ("hw_tflops_per_gpu", "TFLOP/s per GPU (hardware)", "{:.4g}"),
    ("fp8_tflops_per_gpu", "TFLOP/s per GPU in FP8 GEMMs (model)", "{:.4g}"),
    ("mfu", "MFU", "{:.2%}"),
    ("hfu", "HFU", "{:.2%}"),
    ("mfu_mixed", "MFU vs mixed FP8/bf16 peak", "{:.2%}"),
    ("peak_mem_gb", "peak memory (GB)", "{:.3g}"),
    ("grad_norm", "grad norm", "{:.3g}"),
]


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def clean_record(rec: object) -> Optional[dict]:
    """A step record with only numeric values, or None when it is not one: ``step`` must be a
    non-negative integer; other fields that are not numbers are dropped, so nothing but numbers
    reaches the plots and summary.md."""
    if not isinstance(rec, dict):
        return None
    step = rec.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return None
    return {k: v for k, v in rec.items() if isinstance(k, str) and _number(v)}


def read_jsonl(path: Path) -> list[dict]:
    """Records of a metrics.jsonl, skipping lines that do not parse (a write in progress) and
    records that are not step records (see :func:`clean_record`)."""
    out = []
    for line in read_text_bounded(path, MAX_METRICS_BYTES, UserError).splitlines():
        try:
            rec = clean_record(json.loads(line))
        except (ValueError, RecursionError):  # not JSON, nested too deeply, an over-long int
            continue
        if rec is not None:
            out.append(rec)
    return out


def read_tensorboard(folder: Path) -> list[dict]:
    """Scalars train/KEY and val/KEY of TensorBoard event files, merged into records by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    by_step: dict[int, dict] = {}
    for events in sorted({p.parent for p in folder.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            key = tag.split("/", 1)[-1] if tag.startswith(("train/", "val/")) else tag
            for ev in acc.Scalars(tag):
                by_step.setdefault(int(ev.step), {"step": int(ev.step)})[key] = float(ev.value)
    return [by_step[s] for s in sorted(by_step) if s >= 0]


def load_records(run_dir: Path) -> tuple[list[dict], str]:
    """(records sorted by step, the source read)."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a run directory (no such folder)")
    jsonl, tb = run_dir / METRICS_FILE, run_dir / "tensorboard"
    refuse_link(jsonl, UserError)
    if jsonl.is_file():
        records, source = read_jsonl(jsonl), str(jsonl)
    elif tb.is_dir():
        records, source = read_tensorboard(tb), str(tb)
    else:
        raise UserError(
            f"{run_dir}: no {METRICS_FILE} and no tensorboard/ events; is it a run directory?"
        )
    if not records:
        raise UserError(f"{source}: no metrics recorded yet")
    # a resumed run may have re-logged steps: keep the last record of each step
    latest = {}
    for r in records:
        latest.setdefault(r["step"], {}).update(r)
    return [latest[s] for s in sorted(latest)], source


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def plot(records: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for stem, title, keys, ylabel in PLOTS:
        series = [(label, *_series(records, key)) for key, label in keys]
        series = [s for s in series if s[1]]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for label, x, y in series:
            ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if stem == "lr":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        if stem == "memory":
            ax.set_ylim(bottom=0)  # from zero: a few percent of drift is not a leak
        baseline = _series(records, "unigram_baseline")[1] if stem == "loss" else []
        if baseline:  # what a model that learned only token frequencies would score
            ax.axhline(
                baseline[-1], color="grey", linestyle="--", linewidth=1, label="unigram baseline"
            )
        if len(series) > 1 or baseline:
            ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def medians(records: list[dict]) -> dict[str, float]:
    train = [r for r in records if "tokens_per_s" in r]
    if len(train) >= 3:
        train = train[1:]  # the first interval holds the warm-up
    out = {}
    for key, _, _ in MEDIANS:
        values = [float(r[key]) for r in train if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
    return out


def fp8_demotions(records: list[dict]) -> list[str]:
    """Summary lines for the blocks per-layer FP8 demotion switched to high precision, in the
    order it did (``fp8_demoted/layer_LL`` in a record: demoted at that step)."""
    found = [
        (r["step"], key.split("/", 1)[1])
        for r in records
        for key in sorted(r)
        if key.startswith("fp8_demoted/")
    ]
    if not found:
        return []
    return ["", "FP8 demotions (blocks switched to high precision):"] + [
        f"- {layer} at step {step}" for step, layer in found
    ]


def summary_markdown(run_dir: Path, records: list[dict], source: str, plots: list[Path]) -> str:
    last = records[-1]
    losses = _series(records, "loss")
    vals = _series(records, "val_loss")
    med = medians(records)
    lines = [
        f"# Run report: {run_dir.name}",
        "",
        f"Source: `{source}` ({len(records)} records, last step {last['step']}).",
        "",
    ]
    if losses[1]:
        lines.append(
            f"- train loss: {losses[1][0]:.4f} at step {losses[0][0]} -> "
            f"{losses[1][-1]:.4f} at step {losses[0][-1]}"
        )
    if vals[1]:
        lines.append(
            f"- validation loss: {vals[1][-1]:.4f} at step {vals[0][-1]} (best {min(vals[1]):.4f})"
        )
    if "consumed_tokens" in last and math.isfinite(last["consumed_tokens"]):
        lines.append(f"- tokens consumed: {int(last['consumed_tokens']):,}")
    lines += ["", "| metric | median |", "|---|---|"]
    lines += [f"| {label} | {fmt.format(med[key])} |" for key, label, fmt in MEDIANS if key in med]
    if "fp8_tflops_per_gpu" in med:
        lines += ["", "FP8 run: MFU and HFU are against the bf16 peak."]
    lines += fp8_demotions(records)
    if "mfu" not in med:
        lines += [
            "",
            "No MFU: the run had no known peak (a CPU, or a GPU without log.gpu / "
            "log.peak_tflops).",
        ]
    files = artifacts(run_dir)
    if files:
        lines += ["", "## Diagnostics files", ""] + [f"- `{rel}`: {what}" for rel, what in files]
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


#: (pattern under RUN_DIR, what it is): the diagnostics files a run leaves beside its metrics
ARTIFACTS = [
    (
        "profile/rank_*/*.pt.trace.json*",
        "profiler trace (TensorBoard profiler plugin, ui.perfetto.dev)",
    ),
    ("profile/memory_rank_*.pickle", "CUDA memory snapshot (pytorch.org/memory_viz)"),
    ("stragglers.json", "straggler detection: flagged ranks and hosts"),
    ("logs/hang.log", "hang attribution: the ranks that did not arrive"),
    ("logs/collectives_rank_*.json", "per-rank collective record dumped at a hang"),
    ("logs/nccl_trace_rank_*", "NCCL flight recorder dump"),
]


def artifacts(run_dir: Path) -> list[tuple[str, str]]:
    """(path relative to ``run_dir``, what it is) of every diagnostics file the run holds (links
    are not listed)."""
    found = []
    for pattern, what in ARTIFACTS:
        for path in sorted(run_dir.glob(pattern)):
            if path.is_file() and not any(p.is_symlink() for p in (path, *path.parents)):
                found.append((str(path.relative_to(run_dir)), what))
    return found


def write_report(run_dir: str | Path, out: Optional[str | Path] = None) -> dict:
    """Write the plots and summary.md; returns {'summary', 'plots', 'records', 'medians'}."""
    run_dir = Path(run_dir)
    records, source = load_records(run_dir)
    out_dir = Path(out) if out else run_dir / "report"
    make_dir(out_dir, error=UserError)  # refuses a link: nothing is written through one
    for entry in out_dir.iterdir():
        refuse_link(entry, UserError)
    from megaformer.diagnostics.plots import plot_diagnostics

    plots = plot(records, out_dir) + plot_diagnostics(records, out_dir)
    summary = out_dir / "summary.md"
    write_atomic(
        summary, summary_markdown(run_dir, records, source, plots), fsync=False, error=UserError
    )
    return {
        "summary": str(summary),
        "plots": [str(p) for p in plots],
        "records": len(records),
        "medians": medians(records),
        "artifacts": artifacts(run_dir),
    }


# ----------------------------------------------------------------------------- two runs

# (key or layer family, what it is): the quantities a comparison reports on
COMPARED = [
    ("loss", "train loss"),
    ("val_loss", "validation loss"),
    ("diag_resid_rms", "residual RMS"),
    ("diag_attn_max_logit", "max attention logit"),
    ("diag_attn_write_rms", "attention write RMS"),
    ("diag_mlp_write_rms", "MLP write RMS"),
    ("diag_logit_lens_loss", "logit-lens loss"),
    ("diag_router_max_logit", "max router logit (MoE)"),
    ("diag_router_load_cv", "expert load imbalance (MoE)"),
]
Series = dict[str, tuple[list[int], list[float]]]


def _compared_series(records: list[dict], key: str) -> Series:
    """{"": series} for a scalar key, {layer: series} for a per-layer family."""
    if key.startswith("diag_"):
        from megaformer.diagnostics.plots import layer_series

        return layer_series(records, key)
    steps, values = _series(records, key)
    return {"": (steps, values)} if steps else {}


def _relative(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else math.inf
    return abs(b - a) / max(abs(a), 1e-12)


def first_divergence(sa: Series, sb: Series, threshold: float) -> dict:
    """Over the layers (in depth order) and steps both series have: how many points were compared,
    the largest relative difference, and the first step (then the shallowest layer at that step)
    where it exceeds ``threshold`` (None when it never does)."""
    first, largest, points = None, 0.0, 0
    for depth, name in enumerate(n for n in sa if n in sb):
        va, vb = dict(zip(*sa[name])), dict(zip(*sb[name]))
        for step in sorted(va.keys() & vb.keys()):
            rel = _relative(va[step], vb[step])
            points += 1
            largest = max(largest, rel)
            if rel > threshold and (
                first is None or (step, depth) < (first["step"], first["_depth"])
            ):
                first = {
                    "step": step,
                    "layer": name or None,
                    "a": va[step],
                    "b": vb[step],
                    "rel": rel,
                    "_depth": depth,
                }
    if first is not None:
        first.pop("_depth")
    return {"points": points, "largest": largest, "first": first}


def compare_runs(a: list[dict], b: list[dict], threshold: float) -> dict[str, dict]:
    """{quantity: first_divergence(...)} for every :data:`COMPARED` quantity both runs logged."""
    out = {}
    for key, _ in COMPARED:
        sa, sb = _compared_series(a, key), _compared_series(b, key)
        if any(n in sb for n in sa):
            out[key] = first_divergence(sa, sb, threshold)
    return out


def _plot_losses(a: list[dict], b: list[dict], labels: tuple[str, str], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (xa, ya), (xb, yb) = _series(a, "loss"), _series(b, "loss")
    if not (xa and xb):
        return []
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(6.4, 5.4), dpi=100, sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    top.plot(xa, ya, label=labels[0])
    top.plot(xb, yb, label=labels[1], linestyle="--")
    top.set_title("Train loss")
    top.set_ylabel("nats/token")
    top.legend()
    vb = dict(zip(xb, yb))
    common = [(x, y) for x, y in zip(xa, ya) if x in vb]
    bottom.plot(
        [x for x, _ in common], [100 * (vb[x] - y) / abs(y) if y else 0.0 for x, y in common]
    )
    bottom.axhline(0, color="grey", linewidth=0.5)
    bottom.set_ylabel(f"{labels[1]} vs {labels[0]} (%)", fontsize=8)
    bottom.set_xlabel("step")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "compare_loss.png"
    fig.savefig(path)
    plt.close(fig)
    return [path]


def _fmt(v: float) -> str:
    return f"{v:.5g}"


def comparison_markdown(
    labels: tuple[str, str],
    sources: tuple[str, str],
    result: dict,
    threshold: float,
    plots: list[Path],
) -> str:
    names = dict(COMPARED)
    lines = [
        f"# Comparison: {labels[0]} (A) vs {labels[1]} (B)",
        "",
        f"A: `{sources[0]}`; B: `{sources[1]}`. Diverged: |B - A| > {threshold:g} |A| at a "
        "step both runs logged (per-layer quantities: the first such step, then the "
        "shallowest layer).",
        "",
        "| quantity | points compared | first divergence | A | B | difference | largest difference |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in result.items():
        f = r["first"]
        where = (
            "none" if f is None else f"step {f['step']}" + (f", {f['layer']}" if f["layer"] else "")
        )
        vals = ["", "", ""] if f is None else [_fmt(f["a"]), _fmt(f["b"]), f"{f['rel']:.2%}"]
        lines.append(
            f"| {names[key]} | {r['points']} | {where} | "
            + " | ".join(vals)
            + f" | {r['largest']:.2%} |"
        )
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def divergence_lines(result: dict, threshold: float) -> list[str]:
    """One printable line per quantity: where A and B first differ by more than ``threshold``."""
    names = dict(COMPARED)
    out = []
    for key, r in result.items():
        f = r["first"]
        if f is None:
            out.append(
                f"{names[key]}: within {threshold:.1%} at all {r['points']} points "
                f"(largest {r['largest']:.2%})"
            )
        else:
            out.append(
                f"{names[key]}: first diverges at step {f['step']}"
                + (f", {f['layer']}" if f["layer"] else "")
                + f" (A {_fmt(f['a'])}, B {_fmt(f['b'])}, {f['rel']:.2%} > {threshold:.1%})"
            )
    return out


def write_comparison(
    run_a: Union[str, Path],
    run_b: Union[str, Path],
    out: Optional[Union[str, Path]] = None,
    threshold: float = 0.05,
) -> dict:
    """Compare two run directories (see the module docstring); returns {'summary', 'plots',
    'divergence': compare_runs(...), 'lines': divergence_lines(...)}."""
    if not (threshold > 0 and math.isfinite(threshold)):
        raise UserError(f"--threshold {threshold}: must be a positive number")
    run_a, run_b = Path(run_a), Path(run_b)
    (a, source_a), (b, source_b) = load_records(run_a), load_records(run_b)
    labels = (run_a.resolve().name, run_b.resolve().name)
    out_dir = Path(out) if out else run_a / f"compare_{labels[1]}"
    make_dir(out_dir, error=UserError)
    for entry in out_dir.iterdir():
        refuse_link(entry, UserError)
    from megaformer.diagnostics.plots import plot_comparison

    result = compare_runs(a, b, threshold)
    if not result:
        raise UserError(f"{run_a} and {run_b}: no quantity logged by both runs at common steps")
    plots = _plot_losses(a, b, labels, out_dir) + plot_comparison(a, b, labels, out_dir)
    summary = out_dir / "comparison.md"
    write_atomic(
        summary,
        comparison_markdown(labels, (source_a, source_b), result, threshold, plots),
        fsync=False,
        error=UserError,
    )
    return {
        "summary": str(summary),
        "plots": [str(p) for p in plots],
        "divergence": result,
        "lines": divergence_lines(result, threshold),
    }
