"""Steps whose loss or gradients are not finite: skipped, counted, and a limit on a run of them.

The update of such a step is never applied. Under ZeRO and bf16 DeepSpeed's optimizers already
refuse a step whose global gradient norm is inf/NaN (their ``overflow``); for fp32 without ZeRO,
where DeepSpeed steps the torch optimizer directly, :func:`guard_optimizer_step` does the same. In
both cases DeepSpeed then leaves the LR schedule where it was and counts the step in
``engine.skipped_steps``; the data of the step is consumed and the step counter advances, as in
Megatron's handling of fp16 overflows.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

from megaformer.errors import TrainingError


def guard_optimizer_step(optimizer: Any, grad_norm: Callable[[], float]) -> None:
    """Make ``optimizer.step()`` a no-op when ``grad_norm()`` is not finite, and say so through the
    ``overflow`` attribute DeepSpeed's engine reads after each step."""
    inner = optimizer.step

    @functools.wraps(inner)  # keeps the marks torch's LR scheduler leaves on optimizer.step
    def step(*args: Any, **kwargs: Any) -> Any:
        optimizer.overflow = not math.isfinite(grad_norm())
        return None if optimizer.overflow else inner(*args, **kwargs)

    optimizer.overflow = False
    optimizer.step = step


class BadStepCounter:
    """Counts skipped steps; raises once ``max_consecutive`` of them come in a row."""

    def __init__(self, max_consecutive: int, total: int = 0) -> None:
        self.max_consecutive = max_consecutive
        self.total, self.consecutive = total, 0
        self.first_of_run: Optional[int] = None

    def record(self, step: int, bad: bool, last_checkpoint: Optional[str]) -> None:
        if not bad:
            self.consecutive, self.first_of_run = 0, None
            return
        self.total += 1
        self.consecutive += 1
        if self.first_of_run is None:
            self.first_of_run = step
        if self.consecutive >= self.max_consecutive:
            steps = f"step {step}" if self.consecutive == 1 else f"steps {self.first_of_run}-{step}"
            kept = (
                f"the last good checkpoint is {last_checkpoint}"
                if last_checkpoint
                else "no checkpoint was saved"
            )
            raise TrainingError(
                f"non-finite loss or gradients in {self.consecutive} consecutive steps ({steps}; "
                f"train.max_bad_steps={self.max_consecutive}): stopping; {kept}. Lower train.lr, "
                "raise train.warmup_steps or check the data"
            )
