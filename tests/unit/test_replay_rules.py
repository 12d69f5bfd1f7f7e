"""The replay's pieces without training: the step range, which logged windows are compared (as
the run averaged them), the band rule, and the spike hook that names the replay command."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megaformer.training.hooks import LossSpikes
from megaformer.training.loop import StepState
from megaformer.training.replay import (
    ReplayError,
    compare_losses,
    earliest_micro_anomaly,
    first_anomaly,
    first_micro_anomaly,
    parse_steps,
)


def test_steps_are_a_range_or_one_step():
    assert parse_steps("1200..1210") == (1200, 1210) and parse_steps("7") == (7, 7)
    for bad in ("0..3", "5..4", "a..b", "3-4"):
        with pytest.raises(ReplayError):
            parse_steps(bad)


def test_logged_windows_inside_the_replay_are_compared_as_the_run_averaged_them():
    logged = [{"step": 2, "loss": 9.0}, {"step": 4, "loss": 2.5}, {"step": 6, "loss": 5.0}]
    replayed = {3: 2.0, 4: 3.0, 5: float("nan"), 6: 5.0}
    # from checkpoint 2: window 3..4 (mean 2.5) and 5..6 (the skipped NaN step left out)
    assert compare_losses(logged, replayed, start=2, last=6) == [(4, 2.5, 2.5), (6, 5.0, 5.0)]
    # from checkpoint 3: window 3..4 starts before the replay and is not compared
    assert compare_losses(logged, replayed, start=3, last=6) == [(6, 5.0, 5.0)]


def test_the_first_step_out_of_band_names_the_layer_furthest_out():
    steady = {"resid/layer_00/rms": 1.0, "resid/layer_01/rms": 1.0, "update_per_lr/layer_01": 50.0}
    records = {n: dict(steady) for n in (5, 6, 7, 8)}
    records[7]["resid/layer_01/rms"] = 5.0  # 5x
    records[7]["update_per_lr/layer_01"] = 5000.0  # 100x
    records[8]["resid/layer_00/rms"] = 9.0
    top = first_anomaly(records, n_layers=2)
    assert (top["step"], top["layer"], top["quantity"]) == (7, "layer_01", "update norm / lr")
    assert top["also"] == ["layer_01 residual RMS 5x"]
    assert first_anomaly({n: dict(steady) for n in (5, 6, 7)}, 2) is None


def micro_steps(steps, n_micro=3):
    steady = {"resid/layer_00/rms": 1.0, "attn/layer_01/max_logit": 2.0, "loss": 3.0}
    return {n: [dict(steady) for _ in range(n_micro)] for n in steps}


def test_the_first_micro_batch_out_of_band_is_named_with_how_many_were_out():
    figures = micro_steps((5, 6, 7, 8))
    figures[7][2]["resid/layer_00/rms"] = 10.0  # 10x, one micro-batch
    figures[7][0]["loss"] = 3.5  # within the band
    figures[8][1]["attn/layer_01/max_logit"] = 200.0  # later: not the first
    top = first_micro_anomaly(figures, n_layers=2)
    assert (top["step"], top["micro"], top["layer"], top["quantity"]) == (
        7,
        2,
        "layer_00",
        "residual RMS",
    )
    assert (top["ratio"], top["n_out"], top["n_micro"]) == (10.0, 1, 3)
    # a loss far out is judged too; two earlier steps are needed before any step is judged
    figures = micro_steps((5, 6, 7))
    figures[6][1]["loss"] = 300.0
    figures[7][0]["loss"] = 30.0
    top = first_micro_anomaly(figures, n_layers=2)
    assert (top["step"], top["micro"], top["layer"], top["quantity"]) == (7, 0, "", "loss")
    assert first_micro_anomaly(micro_steps((5, 6, 7, 8)), 2) is None


def test_the_data_parallel_ranks_earliest_micro_batch_anomaly_wins():
    late = {"step": 8, "micro": 0, "ratio": 100.0, "n_out": 1, "n_micro": 2}
    early = {"step": 7, "micro": 1, "ratio": 0.1, "n_out": 2, "n_micro": 2}
    early2 = {"step": 7, "micro": 0, "ratio": 5.0, "n_out": 1, "n_micro": 2}
    top = earliest_micro_anomaly([late, None, early, early2])
    assert (top["step"], top["micro"], top["dp_rank"]) == (7, 1, 2)
    assert (top["n_out"], top["n_micro"]) == (3, 8)
    assert earliest_micro_anomaly([None, None]) is None


class Lines:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, line: str) -> None:
        self.lines.append(line)


def test_a_loss_spike_names_the_replay_command():
    console = Lines()
    hook = LossSpikes(console, Path("runs/x"), window=4, factor=1.5)
    for n, loss in enumerate([3.0, 3.1, 2.9, 3.0, 3.2, 6.0, math.nan], start=1):
        hook.after_step(StepState(n, 10, {"loss": loss, "bad": math.isnan(loss)}), {})
    assert console.lines == [
        "step 6: loss 6 spiked to 1.97x the median 3.05 of the last 4 steps; see why: "
        "megaformer replay runs/x --steps 6..6"
    ]
