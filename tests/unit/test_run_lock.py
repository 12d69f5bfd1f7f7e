"""One job per run directory: a second job is refused with one line naming the owner, a stale owner
is taken over with a warning, the owner file goes at exit, and convert / prepare-data never write
into a directory that a live job owns."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from megaformer.runtime.run_lock import (
    OWNER_FILE,
    RunDirInUse,
    RunLock,
    check_not_owned,
    read_owner,
)
from tests.helpers import assert_one_line_error, cli_main, run_cli, subprocess_env, tiny_overrides


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _plant_owner(
    run_dir, host: str, pid: int, age_s: float = 0.0, job=None, attempt=(0, 0)
) -> None:
    """An owner file as another job would have left it, its last heartbeat ``age_s`` ago."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / OWNER_FILE
    path.write_text(
        json.dumps(
            {
                "host": host,
                "pid": pid,
                "started": time.time() - age_s - 60,
                "job": job,
                "attempt": list(attempt),
                "token": "other",
            }
        )
    )
    os.utime(path, (time.time() - age_s, time.time() - age_s))


@pytest.fixture
def sleeper():
    """A live process of this host that is not us (the pid of a job that still runs)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_second_job_is_refused_while_the_first_keeps_it(tmp_path):
    first = RunLock(tmp_path / "run", heartbeat_s=0.05)
    first.acquire()
    first.start_heartbeat()
    mtime = (tmp_path / "run" / OWNER_FILE).stat().st_mtime
    with pytest.raises(RunDirInUse) as refused:
        RunLock(tmp_path / "run").acquire()
    line = str(refused.value)
    assert "\n" not in line
    for needle in (
        f"host {socket.gethostname()}",
        f"pid {os.getpid()}",
        "started ",
        "last heartbeat ",
        "s ago",
    ):
        assert needle in line, (needle, line)
    assert read_owner(tmp_path / "run" / OWNER_FILE).token == first.me.token  # untouched
    time.sleep(0.3)
    assert (tmp_path / "run" / OWNER_FILE).stat().st_mtime > mtime  # the heartbeat runs
    first.release()
    assert not (tmp_path / "run" / OWNER_FILE).exists()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # nothing left behind
    with RunLock(tmp_path / "run") as second:  # free again
        assert read_owner(second.path).token == second.me.token
    assert not (tmp_path / "run" / OWNER_FILE).exists()


def test_owner_whose_process_died_on_this_host_is_taken_over(tmp_path, caplog):
    _plant_owner(tmp_path, socket.gethostname(), _dead_pid())
    lock = RunLock(tmp_path)
    with caplog.at_level(logging.WARNING, logger="megaformer"):
        lock.acquire()
    assert read_owner(lock.path).token == lock.me.token
    assert any(
        "taking over from a stale owner" in r.message and "is gone" in r.message
        for r in caplog.records
    )
    lock.release()


def test_other_host_is_judged_by_its_heartbeat(tmp_path, caplog, sleeper):
    _plant_owner(tmp_path, "node-elsewhere", sleeper, age_s=5)  # pid alive here: irrelevant
    with pytest.raises(RunDirInUse, match="host node-elsewhere, pid .*last heartbeat 5s ago"):
        RunLock(tmp_path, heartbeat_s=10).acquire()  # stale after 30 s
    _plant_owner(tmp_path, "node-elsewhere", sleeper, age_s=100)
    lock = RunLock(tmp_path, heartbeat_s=10)
    with caplog.at_level(logging.WARNING, logger="megaformer"):
        lock.acquire()
    assert any("no heartbeat for 100s" in r.message for r in caplog.records)
    lock.release()


def test_live_owner_on_this_host_is_refused_until_it_goes_stale(tmp_path, sleeper):
    _plant_owner(tmp_path, socket.gethostname(), sleeper, age_s=2)
    with pytest.raises(RunDirInUse, match=f"pid {sleeper}"):
        RunLock(tmp_path, heartbeat_s=10).acquire()
    _plant_owner(tmp_path, socket.gethostname(), sleeper, age_s=40)  # hung or a reused pid
    with RunLock(tmp_path, heartbeat_s=10):
        pass


def test_a_requeued_job_takes_its_run_directory_back(tmp_path, monkeypatch, sleeper):
    _plant_owner(tmp_path, "node-a", sleeper, job="4242")  # fresh heartbeat, another node
    monkeypatch.setenv("SLURM_JOB_ID", "999")
    with pytest.raises(RunDirInUse, match="job 4242"):
        RunLock(tmp_path).acquire()  # another job: refused
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with RunLock(tmp_path) as lock:  # the same job, requeued: takes over
        assert read_owner(lock.path).job == "4242"
    # the same job with its process alive on this very host is a second launch: refused
    _plant_owner(tmp_path, socket.gethostname(), sleeper, job="4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.raises(RunDirInUse):
        RunLock(tmp_path).acquire()


def test_a_lock_taken_over_is_not_released_by_its_old_holder(tmp_path):
    old = RunLock(tmp_path, heartbeat_s=10)
    old.acquire()
    _plant_owner(tmp_path, "node-b", 1)  # another job took it over meanwhile
    assert old.beat() is False and old.lost
    old.release()
    assert read_owner(tmp_path / OWNER_FILE).host == "node-b"


def test_convert_and_prepare_refuse_an_owned_run_directory(tmp_path, sleeper):
    run = tmp_path / "run"
    _plant_owner(run, socket.gethostname(), sleeper)
    with pytest.raises(RunDirInUse, match="convert: .* is inside .*run, a run directory in use"):
        check_not_owned(run / "export" / "hf", "convert")
    check_not_owned(tmp_path / "elsewhere", "convert")  # outside: fine
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 50)
    proc = cli_main(
        "prepare-data",
        "--input",
        str(corpus),
        "--tokenizer",
        "byte",
        "--output-prefix",
        str(run / "data"),
    )
    assert_one_line_error(proc, "prepare-data:", "in use by a training job", f"pid {sleeper}")
    assert sorted(p.name for p in run.iterdir()) == [OWNER_FILE]
    from megaformer.checkpoint.hf.convert import staged_output  # both directions write through it

    with pytest.raises(RunDirInUse, match="convert: .*export is inside"):
        with staged_output(run / "export"):
            pass
    assert sorted(p.name for p in run.iterdir()) == [OWNER_FILE]


def test_train_refused_on_an_owned_run_directory_writes_nothing(tmp_path, sleeper):
    run = tmp_path / "run"
    _plant_owner(run, socket.gethostname(), sleeper)
    proc = cli_main("train", "configs/quickstart.yaml", *tiny_overrides(), "--run-dir", str(run))
    assert_one_line_error(proc, f"{run} is in use by another job", f"pid {sleeper}")
    assert sorted(p.name for p in run.iterdir()) == [OWNER_FILE]  # no metrics, logs, config


@pytest.mark.slow
def test_two_real_trainings_on_one_run_directory(tmp_path):
    run = tmp_path / "run"
    args = [
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"train.steps": 400, "eval.interval": 0}),
        "--run-dir",
        str(run),
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "megaformer", *args],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    try:
        deadline = time.time() + 120
        while not (run / "metrics.jsonl").exists():  # the first one trains
            assert first.poll() is None and time.time() < deadline, first.communicate()
            time.sleep(0.2)
        second = run_cli(*args, timeout=120)
        assert_one_line_error(second, "is in use by another job", f"pid {first.pid}")
        assert first.poll() is None  # untouched, still training
        first.send_signal(signal.SIGTERM)  # ends it early the clean way: checkpoint, exit 0
        out, err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0 and "stopped at step" in out, err[-2000:]
    assert not (run / OWNER_FILE).exists()  # released at the clean exit
    steps = [
        json.loads(line)["step"]
        for line in (run / "metrics.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert steps == list(range(1, len(steps) + 1))  # one writer: no interleaved rows
    # and the directory is free for the next job, which resumes from the checkpoint
    with RunLock(run):
        pass
