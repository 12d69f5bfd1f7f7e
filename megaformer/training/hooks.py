"""The side jobs of the training loop, one step hook each (:class:`~megaformer.training.loop.StepHook`).

In the order :meth:`megaformer.training.trainer.Trainer.run` installs them (the order is what the
run's output shows: a step's metrics line carries its validation and task scores, the checkpoint
of a step is written after its metrics, a failed background save stops the run before the step
counts):

    BackgroundWriteCheck   a failed asynchronous save raises at the next step boundary
    StopAgreement          signals / time limit and non-finite steps, agreed over ranks (one all-reduce)
    Watchdog               a stalled step names itself in the rank's log
    StragglerDetector      per-rank time outside collectives, compared every
                           ``log.straggler_interval`` steps (:mod:`megaformer.training.stragglers`)
    IntervalMetrics        progress bar; opens the record every ``log.interval`` steps (and on skips)
    BadSteps               reports skipped steps; too many in a row end the run
    LossSpikes             a loss far above the recent median names the replay command
    Diagnostics            residual-stream diagnostics into the record
    Validation             validation loss into the record
    TaskEvaluation         lm-eval task scores into the record
    (hooks added with TrainLoop.add_hook)
    WriteRecord            the record to metrics.jsonl / TensorBoard / W&B and the console   (tail)
    Checkpoints            saves when due and on a stop; waits for the last write at the end (tail)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from megaformer.training.bad_steps import BadStepCounter
from megaformer.training.console import Console
from megaformer.training.intervals import LoopIntervals
from megaformer.training.loop import StepHook, StepState
from megaformer.training.preemption import REASONS, StopRequest, agree_max
from megaformer.training.watchdog import StepWatchdog


def _open(record: dict, state: StepState) -> dict:
    """The step's record, opened with its step number if no hook opened it yet."""
    if not record:
        record["step"] = state.step
    return record


class BackgroundWriteCheck(StepHook):
    """A failed background checkpoint write stops the run at the step boundary after it."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer  # check(): raises the error of a failed write

    def after_step(self, state: StepState, record: dict) -> None:
        self.writer.check()


class StopAgreement(StepHook):
    """One all-reduce per step: did any rank ask to stop (signal, ``train.exit_after_minutes``)?
    was any rank's step non-finite? Sets ``state.stop_reason`` and ``state.result["bad"]``."""

    def __init__(self, request: StopRequest) -> None:
        self.request = request
        request.install()

    def after_step(self, state: StepState, record: dict) -> None:
        stop_code, bad = agree_max([self.request.local_code(), int(state.result["bad"])])
        state.result["bad"] = bool(bad)
        if stop_code:
            state.stop_reason = REASONS[stop_code]

    def close(self) -> None:
        self.request.uninstall()


class Watchdog(StepHook):
    """Times each step (train step and agreement) against the running median."""

    def __init__(self, watchdog: StepWatchdog) -> None:
        self.watchdog = watchdog

    def before_step(self, step: int) -> None:
        self.watchdog.step_started(step)

    def after_step(self, state: StepState, record: dict) -> None:
        self.watchdog.step_finished()

    def close(self) -> None:
        self.watchdog.close()


class IntervalMetrics(StepHook):
    """Advances the progress bar; every ``log.interval`` steps (and on a skipped step) opens the
    record with the interval's means: loss over its good steps, tokens/s, step time, and the
    throughput model's TFLOP/s and MFU (``meter``). Owns the console (closes the bar)."""

    def __init__(
        self,
        console: Console,
        intervals: LoopIntervals,
        tokens_per_step: int,
        consumed_tokens: Callable[[], int],
        meter: Any = None,
    ) -> None:
        self.console, self.intervals, self.meter = console, intervals, meter
        self.tokens_per_step, self.consumed_tokens = tokens_per_step, consumed_tokens
        self.window: list[dict] = []
        self.train_time, self.train_tokens = 0.0, 0

    def after_step(self, state: StepState, record: dict) -> None:
        r = state.result
        self.window.append(r)
        self.train_time += r["step_time_s"]
        self.train_tokens += self.tokens_per_step
        self.console.advance(r["loss"], self.tokens_per_step / r["step_time_s"])
        if self.intervals.log_due(state.step, r["bad"]):
            record.update(self._interval_record(state.step))
            self.window = []

    def _interval_record(self, step: int) -> dict:
        window = self.window
        t = sum(w["step_time_s"] for w in window)
        good = [w["loss"] for w in window if not w["bad"]]
        record = {
            "step": step,
            "loss": sum(good) / len(good) if good else float("nan"),
            "lr": window[-1]["lr"],
            "grad_norm": window[-1]["grad_norm"],
            "tokens_per_s": self.tokens_per_step * len(window) / t,
            "step_time_s": t / len(window),
            "consumed_tokens": self.consumed_tokens(),
        }
        if self.meter is not None:  # tflops_per_gpu, [mfu, hfu], peak_mem_gb
            record.update(self.meter.record(t / len(window)))
        record.update(window[-1].get("moe", {}))  # the last step's MoE metrics
        record.update(window[-1].get("mtp", {}))  # the last step's multi-token prediction loss
        return record

    @property
    def tokens_per_s(self) -> float:
        return self.train_tokens / self.train_time if self.train_time else 0.0

    def close(self) -> None:
        self.console.close()


class BadSteps(StepHook):
    """Reports a skipped step; ``train.max_bad_steps`` in a row end the run (TrainingError naming
    ``latest_checkpoint()``, this step's record written first)."""

    def __init__(
        self,
        counter: BadStepCounter,
        console: Console,
        metrics: Any,
        latest_checkpoint: Callable[[], Optional[Path]],
        run_dir: Optional[Path] = None,
    ) -> None:
        self.counter, self.console, self.metrics = counter, console, metrics
        self.latest_checkpoint, self.run_dir = latest_checkpoint, run_dir

    def after_step(self, state: StepState, record: dict) -> None:
        r, c = state.result, self.counter
        if r["bad"]:
            self.console.write(
                f"step {state.step}: non-finite loss or gradient norm on some rank (loss "
                f"{r['loss']:.4g}, grad norm {r['grad_norm']:.4g}): update skipped "
                f"({c.consecutive + 1} in a row, {c.total + 1} in total)"
                + (f"; see why: {replay_command(self.run_dir, state.step)}" if self.run_dir else "")
            )
        latest = self.latest_checkpoint() if r["bad"] else None
        try:
            c.record(state.step, r["bad"], str(latest) if latest else None)
        finally:
            if record:
                record["skipped_steps"] = c.total
                if c.consecutive >= c.max_consecutive:
                    self.metrics.write(record)  # the run ends with the error just raised


def replay_command(run_dir: Path, step: int) -> str:
    """The command that re-runs ``step`` with per-layer diagnostics (:mod:`.replay`)."""
    return f"megaformer replay {run_dir} --steps {step}..{step}"


class LossSpikes(StepHook):
    """A finite loss more than ``factor`` x the median of the last ``window`` good steps (and
    after at least ``window`` of them) is logged with the replay command for its step."""

    def __init__(self, console: Console, run_dir: Path, window: int = 20, factor: float = 1.5):
        self.console, self.run_dir, self.window, self.factor = console, run_dir, window, factor
        self.recent: deque[float] = deque(maxlen=window)

    def after_step(self, state: StepState, record: dict) -> None:
        loss, bad = state.result["loss"], state.result["bad"]
        if bad or not math.isfinite(loss):
            return
        if len(self.recent) == self.window:
            median = statistics.median(self.recent)
            if loss > self.factor * median:
                self.console.write(
                    f"step {state.step}: loss {loss:.4g} spiked to {loss / median:.2f}x the "
                    f"median {median:.4g} of the last {self.window} steps; see why: "
                    f"{replay_command(self.run_dir, state.step)}"
                )
        self.recent.append(loss)


class Diagnostics(StepHook):
    """Residual-stream diagnostics (:class:`megaformer.diagnostics.training.DiagnosticsHook`)
    every ``log.diagnostics_interval`` steps, into the record."""

    def __init__(self, diagnostics: Any) -> None:
        self.diagnostics = diagnostics

    def after_step(self, state: StepState, record: dict) -> None:
        if self.diagnostics.due(state.step):
            _open(record, state).update(self.diagnostics(state.step))


class Validation(StepHook):
    """Validation loss, perplexity exp(min(loss, 50)) and the unigram baseline (the loss of
    predicting every token by its training-set frequency) when due (not on a stop), into the
    record."""

    def __init__(
        self,
        evaluate: Callable[[], float],
        intervals: LoopIntervals,
        console: Console,
        unigram: float,
    ) -> None:
        self.evaluate, self.intervals, self.console, self.unigram = (
            evaluate,
            intervals,
            console,
            unigram,
        )
        self.val_loss: Optional[float] = None

    def after_step(self, state: StepState, record: dict) -> None:
        if not self.intervals.eval_due(state.step, stopping=state.stopping):
            return
        self.val_loss = val_loss = self.evaluate()
        _open(record, state).update(
            val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50.0)), unigram_baseline=self.unigram
        )
        self.console.write(
            f"step {state.step}: val loss {val_loss:.4f} | val ppl "
            f"{record['val_ppl']:.2f} | unigram baseline {self.unigram:.4f}"
        )


class TaskEvaluation(StepHook):
    """``eval.tasks`` on the live model when due (:mod:`megaformer.evaluation.training`):
    eval/TASK/METRIC into the record, the table to the console."""

    def __init__(
        self, evaluator: Any, run: Callable[[], tuple[dict, str]], console: Console
    ) -> None:
        self.evaluator, self.run, self.console = evaluator, run, console

    def after_step(self, state: StepState, record: dict) -> None:
        if not self.evaluator.due(state.step, state.stopping):
            return
        scores, table = self.run()
        self.console.write(f"step {state.step}: lm-eval tasks\n{table}")
        _open(record, state).update(scores)


class WriteRecord(StepHook):
    """The step's record (when a hook opened one) to the metrics sinks, and its console line."""

    def __init__(self, metrics: Any, console: Console) -> None:
        self.metrics, self.console = metrics, console

    def after_step(self, state: StepState, record: dict) -> None:
        if record:
            self.metrics.write(record)
            self.console.write_record(record)

    def close(self) -> None:
        self.metrics.close()


class Checkpoints(StepHook):
    """Saves (``save()``, collective) every ``checkpoint.interval`` steps, at the end with
    ``checkpoint.save_at_end`` and on every stop; after the loop's last step waits for a
    background write (``writer.wait()``) to finish."""

    def __init__(
        self,
        save: Callable[[], Optional[Path]],
        intervals: LoopIntervals,
        console: Console,
        writer: Any = None,
    ) -> None:
        self.save, self.intervals, self.console, self.writer = save, intervals, console, writer
        self.last: Optional[Path] = None

    def after_step(self, state: StepState, record: dict) -> None:
        if self.intervals.save_due(state.step, stopping=state.stopping):
            self.last = self.save() or self.last
        if state.stopping:
            self.console.write(
                f"step {state.step}: {state.stop_reason}: checkpoint saved, "
                "stopping (run the same command to resume)"
            )
        if state.final and self.writer is not None:
            self.writer.wait()
