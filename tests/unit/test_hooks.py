"""The training loop as a train step plus step hooks: when hooks run, that they always close, that a
hook added from outside sees each step's record, and that a train step runs without any hook."""

from __future__ import annotations

import json

import pytest

from megaformer.training.loop import StepHook, StepHookProtocol, StepState, TrainLoop


class Recorder(StepHook):
    """Remembers every call (and a copy of the record it was shown)."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.before: list[int] = []
        self.after: list[tuple[int, dict]] = []
        self.closed = 0

    def before_step(self, step: int) -> None:
        self.before.append(step)

    def after_step(self, state: StepState, record: dict) -> None:
        self.after.append((state.step, dict(record)))

    def close(self) -> None:
        self.closed += 1


class OpenRecord(StepHook):
    """Opens the record with the step's loss, as the metrics hook does on a logging step."""

    def after_step(self, state: StepState, record: dict) -> None:
        record.update(step=state.step, loss=state.result["loss"])


class StopAt(StepHook):
    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, state: StepState, record: dict) -> None:
        if state.step == self.step:
            state.stop_reason = "asked to"


def fake_step(n: int) -> dict:
    return {"loss": 10.0 / n}


def test_hook_runs_every_n_steps_and_closes_once():
    every3, each = Recorder(every=3), Recorder()
    loop = TrainLoop(fake_step, last_step=10, hooks=[each])
    loop.add_hook(every3)
    state = loop.run(start=0)
    assert state.step == 10 and state.result == {"loss": 1.0} and not state.stopping
    assert [s for s, _ in every3.after] == [3, 6, 9]
    assert [s for s, _ in each.after] == list(range(1, 11))
    assert every3.before == each.before == list(range(1, 11))  # before_step: every step
    assert every3.closed == each.closed == 1


def test_every_counts_from_step_zero_on_resume():
    hook = Recorder()
    loop = TrainLoop(fake_step, last_step=9)
    loop.add_hook(hook, every=4)
    assert hook.every == 4
    loop.run(start=5)  # resumed after step 5: steps 6..9
    assert [s for s, _ in hook.after] == [8]
    with pytest.raises(ValueError):
        loop.add_hook(Recorder(), every=0)


def test_stop_request_ends_the_loop_after_every_hook_ran_and_closes_all():
    first, last = Recorder(), Recorder()
    loop = TrainLoop(fake_step, last_step=10, hooks=[first, StopAt(4)], tail=[last])
    state = loop.run(start=0)
    assert state.step == 4 and state.stop_reason == "asked to" and state.final
    assert [s for s, _ in last.after] == [1, 2, 3, 4]  # the tail still runs at the stop step
    assert first.closed == last.closed == 1


def test_close_runs_when_a_step_raises():
    hook = Recorder()

    def failing(n: int) -> dict:
        if n == 3:
            raise RuntimeError("boom")
        return fake_step(n)

    loop = TrainLoop(failing, last_step=10)
    loop.add_hook(hook)
    with pytest.raises(RuntimeError, match="boom"):
        loop.run(start=0)
    assert [s for s, _ in hook.after] == [1, 2] and hook.closed == 1


def test_added_hook_sees_the_record_and_its_additions_reach_the_tail():
    class Straggler(StepHook):  # a new side job: no edit to the loop
        def __init__(self) -> None:
            self.seen: list[dict] = []

        def after_step(self, state: StepState, record: dict) -> None:
            self.seen.append(dict(record))
            if record:
                record["slowest_rank"] = 0

    written = Recorder()
    loop = TrainLoop(fake_step, last_step=4, hooks=[OpenRecord()], tail=[written])
    straggler = loop.add_hook(Straggler())
    assert isinstance(straggler, StepHookProtocol)
    loop.run(start=0)
    assert straggler.seen == [{"step": n, "loss": 10.0 / n} for n in range(1, 5)]
    assert [r for _, r in written.after] == [
        {"step": n, "loss": 10.0 / n, "slowest_rank": 0} for n in range(1, 5)
    ]


def test_final_marks_the_last_step():
    assert StepState(step=5, last_step=5).final
    assert not StepState(step=4, last_step=5).final
    assert StepState(step=2, last_step=5, stop_reason="x").final


# ----------------------------------------------------------------------------- through a Trainer


def _trainer(run_dir, *overrides: str):
    from megaformer.config import load_config
    from megaformer.training.trainer import Trainer
    from tests.helpers import tiny_overrides

    cfg = load_config("configs/quickstart.yaml", [*tiny_overrides(), *overrides])
    return Trainer(cfg, run_dir)


@pytest.mark.slow
def test_a_hook_added_to_the_trainer_gets_each_steps_record_and_train_step_runs_alone(tmp_path):
    from tests.helpers import _cli_environment

    recorder = Recorder(every=2)
    with _cli_environment(None, None):
        trainer = _trainer(tmp_path / "hooked", "train.steps=4", "eval.interval=2")
        try:
            trainer.setup()
            trainer.add_hook(recorder)
            result = trainer.run()
        finally:
            trainer.run_lock.release()
    written = [json.loads(line) for line in (tmp_path / "hooked" / "metrics.jsonl").open()]
    assert [r["step"] for r in written] == [1, 2, 3, 4]
    # every second step, the record as the built-in hooks filled it: loss, validation, skips
    assert [s for s, _ in recorder.after] == [2, 4]
    for step, record in recorder.after:
        assert record == written[step - 1]
        assert {"loss", "val_loss", "skipped_steps"} <= set(record)
    assert recorder.before == [1, 2, 3, 4] and recorder.closed == 1
    assert result.step == 4 and result.val_loss == written[3]["val_loss"]

    # the same run's train step, built by setup and stepped with no loop and no hook
    with _cli_environment(None, None):
        trainer = _trainer(tmp_path / "bare", "train.steps=4")
        try:
            trainer.setup()
            steps = [trainer.stepper(n, trainer.loader) for n in (1, 2)]
        finally:
            trainer.run_lock.release()
    assert [s["loss"] for s in steps] == [written[0]["loss"], written[1]["loss"]]
    assert [s["grad_norm"] for s in steps] == [written[0]["grad_norm"], written[1]["grad_norm"]]
    assert not any(s["bad"] for s in steps)
    assert trainer.loader.consumed_samples == 2 * 8  # two global batches of 8 sequences
    assert (
        not (tmp_path / "bare" / "metrics.jsonl").exists()
        or (tmp_path / "bare" / "metrics.jsonl").read_text() == ""
    )
