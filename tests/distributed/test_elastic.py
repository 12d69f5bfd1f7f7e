"""Elastic re-layout: a 4-rank TP2 x DP2 run that comes back with 2 ranks resumes at the layout
``megaformer plan`` ranks best for 2 (global batch kept), says why, and its losses equal the
one-process run's within 1e-5; back at 4 ranks the config's own layout returns."""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_relayout import losses, rewind
from tests.helpers import cli_main, run_cli, run_torchrun, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

RUN = {
    "train.steps": 6,
    "checkpoint.interval": 3,
    "eval.interval": 0,
    "eval.at_end": "false",
    "model.dropout": 0.0,
    "model.attention_dropout": 0.0,
}


def relayout(run, world: int, overrides: list[str]) -> tuple[list[str], str]:
    """What launch/torchrun.sh runs with LAYOUT=auto: the overrides, and the reason line."""
    args = ["plan", "configs/quickstart.yaml", *overrides, "--gpus", str(world)]
    proc = cli_main(*args, "--gpu", "H100-SXM", "--relayout", str(run))
    assert proc.returncode == 0, proc.stderr
    (reason,) = [line for line in proc.stderr.splitlines() if line.startswith("megaformer layout:")]
    return proc.stdout.split(), reason


def test_a_run_that_loses_half_its_ranks_resumes_at_the_planners_layout(tmp_path):
    reference = tmp_path / "one"
    ref = run_cli(
        "train", "configs/quickstart.yaml", *tiny_overrides(**RUN), "--run-dir", str(reference)
    )
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-2000:]

    run = tmp_path / "run"
    own = tiny_overrides(**RUN, **{"parallel.tensor": 2})
    words, reason = relayout(run, 4, own)  # the first launch records 4 ranks
    assert words == [] and "the config's own layout" in reason
    first = run_torchrun(4, "train", "configs/quickstart.yaml", *own, "--run-dir", str(run))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    rewind(run)  # nodes lost after the checkpoint of step 3

    words, reason = relayout(run, 2, own)
    print(reason)
    assert reason.startswith(
        "megaformer layout: 2 ranks instead of the 4 the run was laid out for: "
    )
    assert "the best of" in reason and "global batch 8 kept" in reason
    assert words and "parallel.tensor=2" not in words  # TP2 x DP1 is not the planner's best
    second = run_torchrun(
        2, "train", "configs/quickstart.yaml", *own, *words, "--run-dir", str(run)
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "resumed from" in second.stdout
    a, b = losses(reference), losses(run)
    for step in (4, 5, 6):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
    assert json.loads((run / "layout.json").read_text())["last"]["overrides"] == words

    words, reason = relayout(run, 4, own)  # the nodes are back
    assert words == [] and "as the run was laid out for" in reason
