"""The ``eval`` section: validation loss and downstream tasks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaformer.config.fields import option


@dataclass
class EvalConfig:
    """Validation loss and perplexity; downstream tasks through lm-evaluation-harness."""

    interval: int = option(50, "Evaluate every N steps (0 = only at the end).")
    iters: int = option(
        10,
        "Global batches (train.global_batch_size sequences each) of validation "
        "data per evaluation.",
    )
    at_end: bool = option(True, "Evaluate after the last step.")
    tasks: Optional[list[str]] = option(
        None,
        "lm-evaluation-harness tasks to score the live model on during training, e.g. "
        "[hellaswag, arc_easy] (null = off; needs pip install megaformer[eval]); requests "
        "are split over the data-parallel ranks, scores logged as eval/TASK/METRIC. See "
        "docs/evaluation.md.",
    )
    tasks_interval: int = option(
        0, "Run eval.tasks every N steps (0 = only after the last step, when eval.at_end)."
    )
    tasks_limit: Optional[int] = option(
        None, "At most this many documents per task in eval.tasks (null = all)."
    )
    tasks_include_path: Optional[str] = option(
        None,
        "Folder of extra lm-evaluation-harness task YAMLs for eval.tasks (local tasks). It is "
        "code (lm-eval runs the Python files its YAMLs name): accepted on the command line, "
        "or in a config file only when MEGAFORMER_TRUST_TASKS_DIR names the same folder.",
    )
