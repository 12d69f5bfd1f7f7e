"""The training loop: a train step, then the step hooks, until the last step or an agreed stop.

    for n = start+1 .. last:
        hook.before_step(n)                       for every hook
        state.result = train_step(n)
        hook.after_step(state, record)            for every hook with n % hook.every == 0, in order
        stop when state.stop_reason is set
    hook.close()                                  for every hook, in order, however the loop ended

Every side job (watchdog, metrics, validation, checkpoints, stop requests...) is a hook
(:mod:`megaformer.training.hooks`); the loop knows none of them. ``record`` is the step's metrics
record: empty, or opened by a hook (``{"step": n, ...}``) and filled by the hooks after it; the hooks
registered with :meth:`TrainLoop.add_hook` run before the ``tail`` hooks (writing the record,
saving), so what they add is written with the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable


@dataclass
class StepState:
    """What the hooks see after step ``step``: the train step's ``result`` (loss, lr, grad_norm,
    bad, step_time_s, ...), and ``stop_reason`` once the ranks agreed to stop at this step."""

    step: int
    last_step: int
    result: dict[str, Any] = field(default_factory=dict)
    stop_reason: Optional[str] = None

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    @property
    def final(self) -> bool:
        """The loop ends after this step (the last one, or a stop)."""
        return self.stopping or self.step >= self.last_step


@runtime_checkable
class StepHookProtocol(Protocol):
    """What the loop calls: ``after_step`` every ``every`` steps, ``close`` once at the end."""

    every: int

    def after_step(self, state: StepState, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class StepHook:
    """Base of the step hooks: every step, no-ops. ``before_step(n)`` runs before step n."""

    every: int = 1

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, state: StepState, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TrainLoop:
    """Runs ``train_step(n) -> result`` for n = start+1 .. ``last_step`` with ``hooks`` (then
    ``tail``) after each step."""

    def __init__(
        self,
        train_step: Callable[[int], dict[str, Any]],
        last_step: int,
        hooks: Optional[list[Any]] = None,
        tail: Optional[list[Any]] = None,
    ) -> None:
        self.train_step, self.last_step = train_step, last_step
        self.hooks: list[Any] = list(hooks or [])
        self.tail: list[Any] = list(tail or [])

    def add_hook(self, hook: Any, every: Optional[int] = None) -> Any:
        """Run ``hook`` after every ``every`` steps (default: its own ``every``), after the hooks
        already added and before the tail; returns the hook."""
        if every is not None:
            if every < 1:
                raise ValueError(f"every={every}: must be >= 1")
            hook.every = every
        self.hooks.append(hook)
        return hook

    def run(self, start: int) -> StepState:
        """Train from step ``start`` (the steps already done); the state after the last step."""
        state = StepState(step=start, last_step=self.last_step)
        hooks = self.hooks + self.tail
        try:
            while state.step < self.last_step:
                n = state.step + 1
                for hook in hooks:
                    before = getattr(hook, "before_step", None)
                    if before is not None:
                        before(n)
                state = StepState(step=n, last_step=self.last_step, result=self.train_step(n))
                record: dict[str, Any] = {}
                for hook in hooks:
                    if n % max(1, int(getattr(hook, "every", 1))) == 0:
                        hook.after_step(state, record)
                if state.stopping:
                    break
        finally:
            for hook in hooks:
                hook.close()
        return state
