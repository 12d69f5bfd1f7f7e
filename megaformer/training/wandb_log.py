"""Weights & Biases as one more sink of the metrics (``log.wandb``), on rank 0 only.

What goes there: every numeric field of every ``metrics.jsonl`` record under the same key
(``loss``, ``val_loss``, ``eval/hellaswag/acc``, ...) at its step; the resolved config as the
run's config; at the end, the run report's plots (``megaformer report`` is run into
``RUN_DIR/report`` and its PNG files are uploaded as images). The W&B run id is kept in
``RUN_DIR/wandb_run_id`` so a resumed training run continues the same W&B run. ``wandb`` is
imported only when the option is on.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from pathlib import Path
from typing import Any, Optional

from megaformer.config import Config
from megaformer.errors import ConfigError
from megaformer.safe_files import make_dir, read_text_bounded, refuse_link, write_atomic

log = logging.getLogger("megaformer")

RUN_ID_FILE = "wandb_run_id"
REPORT_DIR = "report"


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "log.wandb=true: Weights & Biases is not installed: pip install megaformer[wandb]"
        ) from None
    return wandb


def _run_id(run_dir: Path) -> str:
    path = run_dir / RUN_ID_FILE
    if path.is_file():
        rid = read_text_bounded(path, 1024).strip()
        if rid.isalnum():
            return rid
    rid = secrets.token_hex(4)
    write_atomic(path, rid + "\n", fsync=False)
    return rid


class WandbSink:
    """An open W&B run; :meth:`log` takes metrics.jsonl records, :meth:`close` finishes it."""

    def __init__(self, run: Any, wandb: Any, run_dir: Path) -> None:
        self.run, self.wandb, self.run_dir = run, wandb, run_dir

    def log(self, record: dict[str, Any]) -> None:
        values = {
            k: float(v)
            for k, v in record.items()
            if k != "step"
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and math.isfinite(v)
        }
        if values:
            self.run.log(values, step=int(record["step"]))

    def log_report(self) -> int:
        """Write the run report (``megaformer report``: RUN_DIR/report) and upload its PNGs as
        images; returns how many. A report that cannot be made is logged and skipped."""
        from megaformer.analysis.report import write_report
        from megaformer.errors import UserError

        try:
            write_report(self.run_dir)
        except (UserError, ImportError, OSError) as e:
            log.warning("W&B: no run report to upload (%s)", e)
            return 0
        plots = sorted((self.run_dir / REPORT_DIR).glob("*.png"))
        plots = [p for p in plots if p.is_file() and not p.is_symlink()]
        if plots:
            self.run.log({f"report/{p.stem}": self.wandb.Image(str(p)) for p in plots})
        return len(plots)

    def close(self) -> None:
        try:
            self.log_report()
        finally:
            self.run.finish()


def open_run(cfg: Config, run_dir: Path) -> Optional[WandbSink]:
    """The W&B run of ``run_dir`` when ``log.wandb`` is on (call on rank 0 only), else None."""
    if not cfg.log.wandb:
        return None
    wandb = _import_wandb()
    folder = Path(cfg.log.wandb_dir) if cfg.log.wandb_dir else run_dir
    make_dir(folder, error=ConfigError)  # W&B writes FOLDER/wandb: never through a link
    refuse_link(folder / "wandb", ConfigError)
    mode = os.environ.get("WANDB_MODE") or cfg.log.wandb_mode  # the environment has the last word
    if mode == "online":
        log.warning(
            "W&B: online: this run's config and metrics are sent to the W&B server as it "
            "runs (log.wandb_mode=offline or WANDB_MODE=offline keeps them local)"
        )
    run = wandb.init(
        project=cfg.log.wandb_project,
        name=run_dir.name,
        id=_run_id(run_dir),
        resume="allow",
        dir=str(folder),
        mode=mode,
        config=cfg.to_dict(),
    )
    log.info("W&B: run %s (%s) in %s", run.id, mode, folder / "wandb")
    return WandbSink(run, wandb, run_dir)
