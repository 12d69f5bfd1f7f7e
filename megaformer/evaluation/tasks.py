"""Finding lm-evaluation-harness tasks and running them on an ``LM``; the scores as a table, as flat
``eval/TASK/METRIC`` scalars and as a JSON file.

Tasks are looked up in lm-eval's registry and in ``include_path`` (a folder of task YAMLs). When
every requested task is in ``include_path`` the built-in registry (thousands of YAMLs, seconds to
index) is not read at all. Nothing here reaches the network unless a task's dataset lives on the
Hugging Face hub and is not cached (set ``HF_DATASETS_OFFLINE=1`` to make that an error).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any, Optional

from megaformer.errors import UserError

FEWSHOT_SEED = 1234  # lm-eval's default for the few-shot sampler


def _import_lm_eval() -> Any:
    try:
        import lm_eval.evaluator
        import lm_eval.tasks
    except ImportError:
        raise UserError(
            "lm-evaluation-harness is not installed: pip install megaformer[eval]"
        ) from None
    return lm_eval


def parse_tasks(spec: str | list[str]) -> list[str]:
    """'a, b' or ['a', 'b'] -> ['a', 'b'] (non-empty, duplicates dropped, order kept)."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    out = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    if not out:
        raise UserError(f"--tasks {spec!r}: name at least one task")
    return out


OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def network_notice(tasks: list[str]) -> None:
    """Say, before anything runs, that lm-eval's registry tasks read their datasets from the
    Hugging Face hub when they are not cached (``datasets`` honours ``HF_HUB_OFFLINE`` /
    ``HF_DATASETS_OFFLINE``: then only the local cache is read)."""
    log = logging.getLogger("megaformer")
    offline = [
        v
        for v in OFFLINE_ENV
        if os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
    ]
    if offline:
        log.info(
            "tasks %s: offline (%s): datasets are read from the local cache only",
            ", ".join(tasks),
            offline[0],
        )
    else:
        log.warning(
            "tasks %s: datasets not in the local cache are downloaded from the Hugging "
            "Face hub (network); HF_HUB_OFFLINE=1 keeps it offline",
            ", ".join(tasks),
        )


def task_manager(tasks: list[str], include_path: Optional[str | Path] = None) -> Any:
    """An lm-eval ``TaskManager`` that knows every name in ``tasks``; UserError naming the unknown
    ones (with close matches) otherwise."""
    lm_eval = _import_lm_eval()
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    TaskManager = lm_eval.tasks.TaskManager
    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise UserError(f"--include-path {include_path}: no such folder")
        logging.getLogger("megaformer").warning(
            "task folder %s is code: lm-eval runs the Python files its YAMLs name (!function); "
            "use only folders you trust",
            folder,
        )
        local = TaskManager(include_path=str(folder), include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    network_notice(tasks)
    tm = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        hints = [m for t in unknown for m in difflib.get_close_matches(t, tm.all_tasks, 3, 0.75)]
        where = "lm-eval's registry" + (f" or {include_path}" if include_path else "")
        raise UserError(
            f"unknown task(s) {', '.join(unknown)}: not in {where}"
            + (f" (did you mean {', '.join(hints)}?)" if hints else "")
            + "; add a folder of task YAMLs with --include-path"
        )
    return tm


def run_tasks(
    lm: Any, tasks: list[str], manager: Any, limit: Optional[int] = None, bootstrap_iters: int = 0
) -> dict:
    """lm-eval's results dict (``results``, ``versions``, ``n-shot``, ``configs``, ...) of
    ``tasks`` on ``lm``; the same on every rank that calls it."""
    lm_eval = _import_lm_eval()
    try:
        loaded = manager.load(tasks)
    except UserError:
        raise
    except Exception as e:  # a task's dataset that cannot be read: the user's data or network
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise UserError(
            f"tasks {', '.join(tasks)}: could not be loaded ({type(e).__name__}: {first})"
        ) from None
    for task in _leaf_tasks(loaded):
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    results = lm_eval.evaluator.evaluate(
        lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False
    )
    if results is None:  # lm-eval returns results on its rank 0; every rank is its rank 0 here
        raise RuntimeError("lm-eval returned no results")
    return results


def _leaf_tasks(loaded: Any) -> list[Any]:
    tasks = loaded.get("tasks", {}) if isinstance(loaded, dict) else {}
    return [t for t in tasks.values() if hasattr(t, "set_fewshot_seed")]


def flat_scores(results: dict) -> dict[str, float]:
    """{'eval/TASK/METRIC': value} of every numeric score (lm-eval's 'acc,none' -> 'acc'; a filter
    other than 'none' is kept: 'exact_match_flexible-extract'); standard errors left out."""
    out: dict[str, float] = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if "_stderr" in key or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, _, filt = key.partition(",")
            if not filt:
                continue  # 'alias', 'samples' and other bookkeeping fields
            name = metric if filt in ("none", "") else f"{metric}_{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out


def format_table(results: dict) -> str:
    """One row per task and metric: task | metric | value | stderr | n."""
    rows = [("task", "metric", "value", "stderr", "n")]
    n_samples = results.get("n-samples", {})
    for task, metrics in sorted(results.get("results", {}).items()):
        n = n_samples.get(task, {}).get("effective", "")
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            name = metric if filt == "none" else f"{metric} ({filt})"
            rows.append(
                (
                    task,
                    name,
                    _number(value),
                    _number(stderr) if isinstance(stderr, (int, float)) else "",
                    str(n),
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _number(v: float) -> str:
    return f"{v:.4f}" if abs(v) < 1e5 else f"{v:.4g}"


def results_name(tasks: list[str]) -> str:
    """The results file name of ``tasks``: 'hellaswag+arc_easy.json' (other characters -> '_')."""
    name = "+".join(re.sub(r"[^A-Za-z0-9._-]", "_", t) for t in tasks)
    if len(name) > 200:
        import hashlib

        name = name[:180] + "-" + hashlib.sha256(name.encode()).hexdigest()[:12]
    return name + ".json"


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def write_results(path: Path, payload: dict) -> Path:
    """``payload`` as JSON at ``path``, written to a temporary file and renamed (never half
    written; a link at ``path`` is refused)."""
    from megaformer.safe_files import make_dir, refuse_link, write_atomic

    make_dir(path.parent, error=UserError)
    refuse_link(path, UserError)
    write_atomic(path, json.dumps(_jsonable(payload), indent=2) + "\n", fsync=True, error=UserError)
    return path
