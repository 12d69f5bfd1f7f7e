"""Where numbers go: ``metrics.jsonl``, TensorBoard, Weights & Biases (``log.wandb``) and the
console (rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from megaformer.safe_files import (
    json_or_none,
    open_append,
    read_text_bounded,
    refuse_link,
    write_atomic,
)

log = logging.getLogger("megaformer")

METRICS_FILE = "metrics.jsonl"
MAX_METRICS_BYTES = 1 << 33  # 8 GiB: far more than any run logs, bounded all the same


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (a resumed run rewrites the steps it replays).

    The file is rewritten by temporary + rename, never in place; a link at ``path`` is refused and
    lines that are not step records (JSON objects with an integer ``step``) are dropped."""
    refuse_link(path)
    if not path.exists():
        return
    kept = []
    for line in read_text_bounded(path, MAX_METRICS_BYTES).splitlines():
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, nested too deeply, an over-long int
            continue
        step = rec.get("step", 0) if isinstance(rec, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step <= last_step:
            kept.append(line)
    write_atomic(path, "".join(k + "\n" for k in kept), fsync=False)


def tensorboard_tag(key: str) -> str:
    """val_* -> val/KEY, other plain keys -> train/KEY; keys that name their own group
    (diagnostics such as resid/layer_03/rms) are used as they are."""
    if "/" in key:
        return key
    return f"{'val' if key.startswith('val_') else 'train'}/{key}"


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard and to a W&B
    sink (:class:`megaformer.training.wandb_log.WandbSink`, when given)."""

    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: Optional[Any] = None
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tb: Optional[Any] = None
        self.wandb = wandb if enabled else None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open_append(self.path) as fh:  # O_NOFOLLOW: never through a link
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(tensorboard_tag(key), value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(record)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = read_text_bounded(path, MAX_METRICS_BYTES).splitlines()
    return [rec for rec in map(json_or_none, lines) if isinstance(rec, dict)]
