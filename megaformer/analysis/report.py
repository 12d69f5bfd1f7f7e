"""``megaformer report RUN_DIR``: PNG plots and a markdown summary of a run's metrics.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per logged step; a partly written last line of a
run in progress is skipped), or, without it, the scalars of ``RUN_DIR/tensorboard``. Writes
``loss.png``, ``lr.png``, ``tokens_per_s.png``, ``tflops_per_gpu.png``, ``mfu.png``,
``memory.png``, the per-layer diagnostics series (``diag_*.png``, see
:mod:`megaformer.diagnostics.plots`) (those with data) and ``summary.md``: the last step and loss, and the medians of
the throughput metrics over the logged intervals (the first interval, which holds the warm-up
steps, is left out of the medians when there are at least three).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Optional

from megaformer.errors import UserError
from megaformer.safe_files import make_dir, read_text_bounded, refuse_link, write_atomic

METRICS_FILE = "metrics.jsonl"
MAX_METRICS_BYTES = 1 << 33

# (file stem, title, [(key, label)], y label)
PLOTS = [
    ("loss", "Loss", [("loss", "train"), ("val_loss", "validation")], "nats/token"),
    ("lr", "Learning rate", [("lr", "lr")], "lr"),
    ("tokens_per_s", "Throughput", [("tokens_per_s", "tokens/s")], "tokens/s"),
    ("tflops_per_gpu", "TFLOP/s per GPU",
     [("tflops_per_gpu", "model"), ("hw_tflops_per_gpu", "hardware")], "TFLOP/s"),
    ("mfu", "Utilisation", [("mfu", "MFU"), ("hfu", "HFU")], "fraction of peak"),
    ("memory", "Peak memory", [("peak_mem_gb", "peak")], "GB"),
]
MEDIANS = [("tokens_per_s", "tokens/s", "{:,.0f}"), ("step_time_s", "step time (s)", "{:.4g}"),
           ("tflops_per_gpu", "TFLOP/s per GPU (model)", "{:.4g}"),
           ("hw_tflops_per_gpu", "TFLOP/s per GPU (hardware)", "{:.4g}"),
           ("mfu", "MFU", "{:.2%}"), ("hfu", "HFU", "{:.2%}"), ("peak_mem_gb", "peak memory (GB)", "{:.3g}"),
           ("grad_norm", "grad norm", "{:.3g}")]


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
        except json.JSONDecodeError:
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
        raise UserError(f"{run_dir}: no {METRICS_FILE} and no tensorboard/ events; is it a run directory?")
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
        if len(series) > 1:
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


def summary_markdown(run_dir: Path, records: list[dict], source: str, plots: list[Path]) -> str:
    last = records[-1]
    losses = _series(records, "loss")
    vals = _series(records, "val_loss")
    med = medians(records)
    lines = [f"# Run report: {run_dir.name}", "",
             f"Source: `{source}` ({len(records)} records, last step {last['step']}).", ""]
    if losses[1]:
        lines.append(f"- train loss: {losses[1][0]:.4f} at step {losses[0][0]} -> "
                     f"{losses[1][-1]:.4f} at step {losses[0][-1]}")
    if vals[1]:
        lines.append(f"- validation loss: {vals[1][-1]:.4f} at step {vals[0][-1]} "
                     f"(best {min(vals[1]):.4f})")
    if "consumed_tokens" in last and math.isfinite(last["consumed_tokens"]):
        lines.append(f"- tokens consumed: {int(last['consumed_tokens']):,}")
    lines += ["", "| metric | median |", "|---|---|"]
    lines += [f"| {label} | {fmt.format(med[key])} |" for key, label, fmt in MEDIANS if key in med]
    if "mfu" not in med:
        lines += ["", "No MFU: the run had no known peak (a CPU, or a GPU without log.gpu / "
                      "log.peak_tflops)."]
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


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
    write_atomic(summary, summary_markdown(run_dir, records, source, plots), fsync=False,
                 error=UserError)
    return {"summary": str(summary), "plots": [str(p) for p in plots], "records": len(records),
            "medians": medians(records)}
