"""Where numbers go: ``metrics.jsonl``, TensorBoard and the console (rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger("megaformer")

METRICS_FILE = "metrics.jsonl"


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop records after ``last_step`` (a resumed run rewrites the steps it replays)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= last_step:
                kept.append(line)
        except json.JSONDecodeError:
            continue
    path.write_text("".join(k + "\n" for k in kept))


def tensorboard_tag(key: str) -> str:
    """val_* -> val/KEY, other plain keys -> train/KEY; keys that name their own group
    (diagnostics such as resid/layer_03/rms) are used as they are."""
    if "/" in key:
        return key
    return f"{'val' if key.startswith('val_') else 'train'}/{key}"


class MetricsWriter:
    """Appends one JSON object per logged step and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.path = run_dir / METRICS_FILE
        self.tb: Optional[Any] = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(tensorboard_tag(key), value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
