"""Fault injection (MEGAFORMER_FAULT, gloo on CPU): signals, killed ranks, killed saves, NaNs, hangs.

Every survived fault is checked by comparison: the losses and gradient norms of the interrupted run
equal the uninterrupted 2-rank run's bit for bit, and a skipped step leaves the weights unchanged.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import pytest
import torch

from megaformer.checkpoint.weights import load_weights
from megaformer.training import preemption
from megaformer.training.watchdog import StepWatchdog
from tests.helpers import (
    ROOT,
    assert_one_line_error,
    cluster_overrides,
    run_cli,
    run_module,
    run_process,
    step_records,
    subprocess_env,
    tiny_overrides,
    torchrun_cmd,
)


def launch(
    run_dir: Path, fault: str, *extra: str, restarts: int = 0, nproc: int = 2
) -> subprocess.CompletedProcess:
    cmd = torchrun_cmd(
        nproc,
        "train",
        "configs/quickstart.yaml",
        *cluster_overrides(),
        *extra,
        "--run-dir",
        str(run_dir),
        restarts=restarts,
    )
    env = subprocess_env(MEGAFORMER_FAULT=fault, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10")
    return run_process(cmd, env=env)


def launch_forked(run_dir: Path, fault: str, *extra: str) -> subprocess.CompletedProcess:
    """The 2-rank run of :func:`launch` on ranks forked with torchrun's environment (no launcher:
    for faults the ranks handle themselves, where torchrun would only watch them exit)."""
    argv = ["train", "configs/quickstart.yaml", *cluster_overrides(), *extra]
    return run_module(
        2,
        "megaformer",
        [*argv, "--run-dir", str(run_dir)],
        env=subprocess_env(MEGAFORMER_FAULT=fault),
        cwd=ROOT,
    )


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_weights(a), load_weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def assert_matches(run_dir: Path, reference: Path) -> None:
    got, want = step_records(run_dir), step_records(reference)
    assert sorted(got) == sorted(want) == [1, 2, 3, 4, 5, 6]
    for step in want:
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigterm_then_killed_save_then_killed_rank_continue_exactly(tmp_path, ddp_reference):
    """1. SIGTERM reaches rank 1 in step 3: both ranks save step 3 and exit 0.
    2. Rerun (auto-resume from step 3) under torchrun --max-restarts=2: rank 0 is SIGKILLed inside the
       save of step 4 (before it is committed); torchrun restarts both ranks, which ignore the
       half-written save and resume from step 3; in that attempt rank 1 is SIGKILLed at the start of
       step 6; the next attempt resumes from step 4 and finishes. Losses equal the reference run's."""
    run = tmp_path / "run"
    first = launch(run, "sigterm@step=3,rank=1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "received SIGTERM" in first.stdout + first.stderr
    assert "stopped at step 3 (stop signal received)" in first.stdout
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_0000003"
    assert sorted(step_records(run)) == [1, 2, 3]

    second = launch(run, "kill-in-save@step=4,rank=0;kill@step=6,rank=1,attempt=1", restarts=2)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-5000:]
    assert "ignoring " in out and ".tmp-step_0000004" in out  # the killed save, skipped
    assert out.count("resumed from") == 3, out[-5000:]  # step 3, step 3 again, step 4
    assert "resumed from " + str(ckpts / "step_0000004") in out
    assert sorted(p.name for p in ckpts.iterdir()) == [
        "latest",
        "step_0000002",
        "step_0000003",
        "step_0000004",
        "step_0000006",
    ]
    assert_matches(run, ddp_reference)
    assert same_weights(ckpts / "step_0000006", ddp_reference / "checkpoints" / "step_0000006")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_nan_on_one_rank_is_skipped_then_a_stalled_rank_trips_the_watchdog(tmp_path):
    """ZeRO-2, 2 ranks: rank 1's loss is NaN in step 2 -> every rank skips the update (weights of
    steps 1 and 2 identical), training goes on; rank 1 then stalls in step 5 -> each rank's watchdog
    writes its stacks to logs/rank_N.log, rank 0 names rank 1 as the rank its collective waits for
    (logs/hang.log) and the run ends non-zero within seconds (15 s limit: a
    step on a loaded 2-core machine can take over 5 s, which fired the watchdog early). The ranks
    are forked: the watchdog ends its own process, no launcher takes part."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    proc = launch_forked(
        run,
        "nan@step=2,rank=1;stall@step=5,rank=1",
        "parallel.zero_stage=2",
        "checkpoint.interval=1",
        "train.watchdog_factor=5",
        "train.watchdog_min_seconds=15",
    )
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert elapsed < 120, elapsed  # without the watchdog: an hour's stall, then the 30-min timeout
    r = step_records(run)
    assert sorted(r) == [1, 2, 3, 4]
    assert math.isnan(r[2]["loss"]) and r[2]["skipped_steps"] == 1
    assert all(math.isfinite(r[s]["loss"]) for s in (1, 3, 4)) and r[4]["skipped_steps"] == 1
    assert r[3]["lr"] == r[2]["lr"]  # the schedule did not advance on the skipped step
    ckpts = run / "checkpoints"
    assert same_weights(ckpts / "step_0000001", ckpts / "step_0000002")
    assert not same_weights(ckpts / "step_0000002", ckpts / "step_0000003")
    for rank in (0, 1):
        log = (run / "logs" / f"rank_{rank}.log").read_text()
        assert f"megaformer watchdog (rank {rank}): step 5 has run" in log, log[-2000:]
        assert "most recent call first" in log and "Thread 0x" in log
    assert "in step_start" in (run / "logs" / "rank_1.log").read_text()  # the stalled frame
    (hang,) = (run / "logs" / "hang.log").read_text().splitlines()  # one line, by rank 0
    assert hang.startswith("megaformer hang: ") and "did not arrive: rank 1 (" in hang, hang


@pytest.mark.slow
def test_consecutive_nans_stop_with_one_line_and_the_last_good_checkpoint(tmp_path):
    """One process, fp32 without ZeRO (megaformer's own step guard): a NaN step is skipped, and
    train.max_bad_steps=2 NaN steps in a row stop the run with one error line, exit 2."""
    run = tmp_path / "run"
    env = subprocess_env(MEGAFORMER_FAULT="nan@step=3;nan@step=5-6")
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(
            **{
                "train.steps": 8,
                "checkpoint.interval": 1,
                "eval.interval": 0,
                "checkpoint.keep_last": "null",
                "train.max_bad_steps": 2,
            }
        ),
        "--run-dir",
        str(run),
        env=env,
    )
    line = assert_one_line_error(
        proc,
        "non-finite loss or gradients in 2 consecutive steps (steps 5-6; train.max_bad_steps=2)",
        "step_0000005",
    )
    assert "update skipped (1 in a row, 1 in total)" in proc.stdout, line
    ckpts = run / "checkpoints"
    assert same_weights(ckpts / "step_0000002", ckpts / "step_0000003")
    assert not same_weights(ckpts / "step_0000003", ckpts / "step_0000004")
    assert same_weights(ckpts / "step_0000004", ckpts / "step_0000005")
    assert (ckpts / "latest").read_text().strip() == "step_0000005"
    assert not (ckpts / "step_0000006").exists()
    r = step_records(run)
    assert r[6]["skipped_steps"] == 3 and r[4]["lr"] == r[3]["lr"] and math.isfinite(r[4]["loss"])
    assert all(torch.isfinite(v).all() for v in load_weights(ckpts / "step_0000005").values())


def test_stop_request_from_a_signal_or_the_clock():
    """A signal only sets the flag (the process keeps running); the time limit raises its own code;
    the ranks combine codes with MAX (single process here: the values come back unchanged)."""
    import os
    import signal

    request = preemption.StopRequest(exit_after_minutes=60)
    request.install()
    try:
        assert request.local_code() == preemption.NONE
        os.kill(os.getpid(), signal.SIGUSR1)
        assert request.local_code() == preemption.SIGNAL and request.signal == signal.SIGUSR1
    finally:
        request.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    timed = preemption.StopRequest(exit_after_minutes=1e-6)
    time.sleep(0.01)
    assert timed.local_code() == preemption.TIME_LIMIT
    assert preemption.agree_max([2, 0]) == [2, 0]


def test_watchdog_limit_follows_the_running_median(tmp_path):
    dog = StepWatchdog(
        factor=4, min_seconds=0.5, log_path=tmp_path / "rank_0.log", rank=0, poll_seconds=60
    )
    try:
        assert dog.limit() is None  # unarmed until one step has completed
        dog.times.extend([0.1, 0.3, 0.2])
        assert dog.limit() == pytest.approx(0.8)  # 4 x median 0.2 > the 0.5 s floor
        dog.times.extend([0.01] * 10)
        assert dog.limit() == 0.5
    finally:
        dog.close()
    assert not (tmp_path / "rank_0.log").exists()
