"""Learning-rate schedules as multipliers of the peak lr.

With warmup W, total steps N, peak lr, final min_lr and progress p = (s - W) / (N - W) after warmup:

* warmup:   lr(s) = lr * (s + 1) / W for s < W
* cosine:   lr(s) = min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2
* linear:   lr(s) = min_lr + (lr - min_lr) * (1 - p)
* wsd:      warmup, then lr held constant, then a linear decay to min_lr over the last
            ``decay_fraction * N`` steps (warmup-stable-decay, Hu et al. 2024)
* constant: lr after warmup
"""

from __future__ import annotations

import math
from typing import Callable

from megaformer.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """The learning rate used by optimizer step ``step`` (0-based)."""
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    if t.lr_schedule == "wsd":
        decay_steps = max(1, int(round(t.decay_fraction * t.steps)))
        decay_start = max(t.warmup_steps, t.steps - decay_steps)
        if step < decay_start:
            return t.lr
        p = min(1.0, (step - decay_start) / max(1, t.steps - decay_start))
        return t.min_lr + (t.lr - t.min_lr) * (1 - p)
    span = max(1, t.steps - t.warmup_steps)
    p = min(1.0, (step - t.warmup_steps) / span)
    if t.lr_schedule == "linear":
        return t.min_lr + (t.lr - t.min_lr) * (1 - p)
    return t.min_lr + (t.lr - t.min_lr) * 0.5 * (1 + math.cos(math.pi * p))


def lr_lambda(t: TrainConfig) -> Callable[[int], float]:
    """Multiplier for ``torch.optim.lr_scheduler.LambdaLR`` (optimizer built with lr = t.lr)."""
    return lambda step: lr_at(step, t) / t.lr
