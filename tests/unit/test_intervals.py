"""The loop's step-interval policies: when it logs, evaluates and saves."""

from __future__ import annotations

from megaformer.config import CheckpointConfig, Config, EvalConfig, LogConfig, TrainConfig
from megaformer.training.intervals import Every, LoopIntervals


def _due(every: Every, last: int) -> list[int]:
    return [s for s in range(1, last + 1) if every.due(s)]


def test_every_interval_and_at_end():
    assert _due(Every(3, 10), 10) == [3, 6, 9]
    assert _due(Every(3, 10, at_end=True), 10) == [3, 6, 9, 10]
    assert _due(Every(0, 10, at_end=True), 10) == [10]  # 0: never, except at the end
    assert _due(Every(0, 10), 10) == []


def test_loop_intervals_from_config():
    cfg = Config(
        train=TrainConfig(steps=7),
        log=LogConfig(interval=2),
        eval=EvalConfig(interval=3, at_end=False),
        checkpoint=CheckpointConfig(interval=0, save_at_end=True),
    )
    due = LoopIntervals.from_config(cfg)
    assert [s for s in range(1, 8) if due.log_due(s, bad=False)] == [2, 4, 6, 7]
    assert due.log_due(3, bad=True)  # a skipped step is always logged
    assert [s for s in range(1, 8) if due.eval_due(s, stopping=False)] == [3, 6]
    assert not due.eval_due(6, stopping=True)  # no evaluation on the step a run stops at
    assert [s for s in range(1, 8) if due.save_due(s, stopping=False)] == [7]
    assert due.save_due(2, stopping=True)  # a stop request always saves
