"""Elastic re-layout: the layout a run resumes at when it gets more or fewer ranks than it was
laid out for.

A run's first launch records its world size in ``RUN_DIR/layout.json``. A later launch with that
many ranks keeps the config's own layout; with another count (nodes lost, or not yet back) it takes
the layout :func:`megaformer.analysis.planner.plan` ranks best for the count -- the first feasible
one, by modelled step time, that the config's checks accept at that world size -- with the
global batch unchanged, and says why. Resuming at another layout is exact up to float rounding
(sharded checkpoints, :mod:`megaformer.checkpoint.sharded`), so the run goes on with the ranks it
has; when the nodes come back, the next launch returns to the config's layout.

The launch scripts call it through ``megaformer plan CONFIG --gpus N --relayout RUN_DIR``, which
prints the ``KEY=VALUE`` overrides to add (none: the config's own layout) and the reason.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

from megaformer.errors import ConfigError, UserError
from megaformer.safe_files import json_or_none, make_dir, read_text_bounded, write_atomic

LAYOUT_FILE = "layout.json"


def layout_words(layout: dict) -> list[str]:
    """The config overrides of a planner layout (``Layout`` as a dict)."""
    words = [
        f"parallel.tensor={layout['tp']}",
        f"parallel.pipeline={layout['pp']}",
        f"parallel.context={layout['cp']}",
        f"parallel.expert={layout['ep']}",
        f"parallel.zero_stage={layout['zero']}",
        f"parallel.sequence_parallel={str(bool(layout['sequence_parallel'])).lower()}",
        f"train.micro_batch_size={layout['micro_batch']}",
        f"train.recompute={layout['recompute']}",
    ]
    if layout["cp"] > 1:
        words.append(f"parallel.context_mode={layout['cp_mode']}")
    schedule = layout.get("schedule", "1f1b")  # the schedule the planner priced
    words.append(f"parallel.pipeline_schedule={schedule}")
    if schedule == "interleaved":
        words.append(f"parallel.pipeline_virtual_stages={layout['virtual_stages']}")
    return words


def describe(layout: dict) -> str:
    schedule = layout.get("schedule", "1f1b")
    if schedule == "interleaved":
        schedule += f" with {layout['virtual_stages']} stages per rank"
    return (
        f"TP={layout['tp']} PP={layout['pp']} DP={layout['dp']}"
        + (f" CP={layout['cp']} ({layout['cp_mode']})" if layout["cp"] > 1 else "")
        + (f" EP={layout['ep']}" if layout["ep"] > 1 else "")
        + f" ZeRO-{layout['zero']} micro-batch {layout['micro_batch']} x accumulation "
        f"{layout['grad_accum']}, recompute {layout['recompute']}"
        + (f", schedule {schedule}" if layout["pp"] > 1 else "")
    )


def recorded_world(run_dir: Path) -> Optional[int]:
    """The world size ``RUN_DIR/layout.json`` records (None: no record yet)."""
    path = run_dir / LAYOUT_FILE
    if not path.is_file() or path.is_symlink():
        return None
    data = json_or_none(read_text_bounded(path, 1 << 16))
    world = data.get("world") if isinstance(data, dict) else None
    return world if isinstance(world, int) and world > 0 else None


def relayout(
    load: Callable[[list[str]], Any],
    world: int,
    run_dir: Path,
    plan: Callable[[Any], dict],
    check: Callable[[Any, int], Any],
) -> tuple[list[str], str]:
    """(overrides, reason) for a launch of ``world`` ranks in ``run_dir``.

    ``load(words)``: the launch's config with ``words`` added; ``plan(cfg)``: the planner's result
    for it on ``world`` GPUs; ``check(cfg, world)``: raises ConfigError when the layout does not
    fit the world. The first launch records ``world``."""
    full = recorded_world(run_dir) or world
    words, reason = _choose(load, world, full, plan, check)
    make_dir(run_dir, error=UserError)
    record = {"world": full, "last": {"world": world, "overrides": words, "reason": reason}}
    write_atomic(run_dir / LAYOUT_FILE, json.dumps(record, indent=1) + "\n", error=UserError)
    return words, reason


def _choose(
    load: Callable[[list[str]], Any],
    world: int,
    full: int,
    plan: Callable[[Any], dict],
    check: Callable[[Any, int], Any],
) -> tuple[list[str], str]:
    cfg = load([])
    if world == full:
        check(cfg, world)
        return [], f"{world} ranks, as the run was laid out for: the config's own layout"
    result = plan(cfg)
    feasible = result["feasible"]
    for i, row in enumerate(feasible):
        words = layout_words(row["layout"])
        try:
            check(load(words), world)
        except ConfigError:
            continue
        reason = (
            f"{world} ranks instead of the {full} the run was laid out for: "
            f"{describe(row['layout'])}, the best of {len(feasible)} feasible layouts by "
            f"megaformer plan's modelled step time ({row['step_time_s']:.4g} s, MFU "
            f"{row['mfu']:.1%}; global batch {cfg.train.global_batch_size} kept)"
        )
        if i + 1 < len(feasible):
            runner_up = feasible[i + 1]
            reason += f"; next: {describe(runner_up['layout'])} ({runner_up['step_time_s']:.4g} s)"
        return words, reason
    raise UserError(
        f"{world} ranks: megaformer plan finds no layout of this config that fits "
        f"({len(result['rejected'])} rejected; see megaformer plan CONFIG --gpus {world})"
    )
