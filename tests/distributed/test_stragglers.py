"""Straggler detection on 2 gloo ranks: a rank made slow in every step (MEGAFORMER_FAULT's
``slow``) is named within two intervals with its host; a clean run names nobody, and the
detector's own cost at its default interval is a small fraction of the step time."""

from __future__ import annotations

import json

import pytest

from megaformer.runtime.spawn import run_module
from tests.helpers import ROOT, cluster_overrides, step_records, subprocess_env


def train_2_ranks(run_dir, fault: str = "", **extra):
    env = subprocess_env(MEGAFORMER_FAULT=fault) if fault else subprocess_env()
    argv = ["train", "configs/quickstart.yaml"]
    argv += cluster_overrides(**{"checkpoint.interval": 0, "log.all_ranks": "true", **extra})
    proc = run_module(2, "megaformer", [*argv, "--run-dir", str(run_dir)], env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_slow_in_every_step_is_named_within_two_intervals(tmp_path):
    run = tmp_path / "run"
    proc = train_2_ranks(run, "slow@step=1-6,rank=1,seconds=0.2", **{"log.straggler_interval": 3})
    out = proc.stdout + proc.stderr
    print("\n".join(line for line in out.splitlines() if "straggler" in line))
    assert "straggler: rank 1 (" in out and "host CPU" in out, out[-3000:]
    assert "straggler: rank 0" not in out
    r = step_records(run)
    named = [s for s in (3, 6) if r[s]["straggler/slowest_rank"] == 1]
    assert named and named[0] <= 6 and r[named[0]]["straggler/slowest_ratio"] > 1.1
    summary = json.loads((run / "stragglers.json").read_text())
    assert summary["flagged"][0]["ranks"][0]["rank"] == 1
    assert summary["flagged"][0]["ranks"][0]["host"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_clean_run_names_nobody_and_the_detector_costs_little(tmp_path):
    run = tmp_path / "run"
    proc = train_2_ranks(run, **{"train.steps": 50, "log.interval": 10})  # default interval: 50
    out = proc.stdout + proc.stderr
    summary = json.loads((run / "stragglers.json").read_text())
    print(f"own seconds per step, by rank: {summary['last']['own_s']}")
    assert "straggler:" not in out, [line for line in out.splitlines() if "straggler" in line]
    rec = step_records(run)[50]
    assert rec["straggler/count"] == 0
    assert summary["interval"] == 50 and summary["flagged"] == []
    overhead = summary["last"]["overhead"]
    print(
        f"straggler detector overhead at the default interval: {100 * overhead:.3f}% of step time"
    )
    assert 0 < overhead < 0.01
