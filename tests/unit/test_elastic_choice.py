"""Elastic re-layout without ranks: the first launch records its world, the same world keeps the
config's layout, another takes the planner's best layout the config's checks accept."""

from __future__ import annotations

import json

import pytest

from megaformer.analysis.elastic import describe, layout_words, relayout
from megaformer.errors import ConfigError, UserError


def row(tp: int, pp: int, dp: int, t: float) -> dict:
    lay = dict(tp=tp, pp=pp, dp=dp, cp=1, ep=1, zero=1, micro_batch=2, grad_accum=2)
    lay.update(recompute="none", sequence_parallel=tp > 1, cp_mode="ring")
    return {"layout": lay, "step_time_s": t, "mfu": 0.4}


class Config:
    class train:
        global_batch_size = 8


def test_the_planners_best_accepted_layout_for_another_world(tmp_path):
    feasible = [row(2, 1, 1, 1.0), row(1, 1, 2, 1.5), row(1, 2, 1, 2.0)]
    refused = "parallel.tensor=2"

    def check(cfg, world):
        if refused in cfg:
            raise ConfigError("refused")

    def load(words):
        return words

    plan = lambda cfg: {"feasible": feasible, "rejected": []}  # noqa: E731
    assert relayout(load, 4, tmp_path, plan, check)[0] == []  # first launch: recorded
    words, reason = relayout(lambda w: w or Config, 2, tmp_path, plan, check)
    assert words == layout_words(feasible[1]["layout"])  # the best one is refused by the checks
    assert "2 ranks instead of the 4" in reason and "TP=1 PP=1 DP=2 ZeRO-1" in reason
    assert "next: TP=1 PP=2 DP=1" in reason
    assert json.loads((tmp_path / "layout.json").read_text())["world"] == 4
    assert relayout(load, 4, tmp_path, plan, check)[0] == []  # back to full size: own layout
    with pytest.raises(UserError, match="finds no layout"):
        relayout(
            lambda w: w or Config, 2, tmp_path, lambda c: {"feasible": [], "rejected": []}, check
        )


def test_the_overrides_name_the_schedule_the_planner_priced():
    """A pipeline layout resumes under the schedule its step time was modelled with (and its v);
    a layout without a pipeline sets 1F1B back, whatever the config's schedule was."""
    lay = row(1, 4, 1, 1.0)["layout"]
    lay.update(schedule="interleaved", virtual_stages=3)
    words = layout_words(lay)
    assert words[-2:] == [
        "parallel.pipeline_schedule=interleaved",
        "parallel.pipeline_virtual_stages=3",
    ]
    assert describe(lay).endswith("recompute none, schedule interleaved with 3 stages per rank")
    lay.update(schedule="dualpipev")
    assert layout_words(lay)[-1] == "parallel.pipeline_schedule=dualpipev"
    assert layout_words(row(2, 1, 2, 1.0)["layout"])[-1] == "parallel.pipeline_schedule=1f1b"
