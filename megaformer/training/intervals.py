"""When the loop logs, evaluates and saves: small named policies instead of inline conditions.

    due(step) = (interval > 0 and step % interval == 0) or (at_end and step == last)

* log:        every ``log.interval`` steps and at the last step (and at any skipped step);
* evaluate:   every ``eval.interval`` steps (0: never) and at the last step if ``eval.at_end``,
              not on a step the run stops at (preemption, time limit);
* checkpoint: every ``checkpoint.interval`` steps (0: never), at the last step if
              ``checkpoint.save_at_end``, and on every stop request.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaformer.config import Config


@dataclass(frozen=True)
class Every:
    """Every ``interval`` steps (0: never) and, with ``at_end``, at step ``last``."""

    interval: int
    last: int
    at_end: bool = False

    def due(self, step: int) -> bool:
        return bool(
            (self.interval and step % self.interval == 0) or (self.at_end and step == self.last)
        )


@dataclass(frozen=True)
class LoopIntervals:
    log: Every
    evaluate: Every
    checkpoint: Every

    @classmethod
    def from_config(cls, cfg: Config) -> "LoopIntervals":
        last = cfg.train.steps
        return cls(
            log=Every(cfg.log.interval, last, at_end=True),
            evaluate=Every(cfg.eval.interval, last, at_end=cfg.eval.at_end),
            checkpoint=Every(cfg.checkpoint.interval, last, at_end=cfg.checkpoint.save_at_end),
        )

    def log_due(self, step: int, bad: bool) -> bool:
        return bad or self.log.due(step)

    def eval_due(self, step: int, stopping: bool) -> bool:
        return not stopping and self.evaluate.due(step)

    def save_due(self, step: int, stopping: bool) -> bool:
        return stopping or self.checkpoint.due(step)
