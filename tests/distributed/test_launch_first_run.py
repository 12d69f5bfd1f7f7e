"""The documented launch paths as a new user meets them: the quickstart on 1, 2 and 4 ranks, the
launcher's interpreter, one-line errors after launch, Ctrl-C under torchrun, ranks ending with their
launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, cluster_overrides, kill_group, run_cli, run_process, subprocess_env

TORCHRUN = [
    sys.executable,
    "-m",
    "megaformer.cli.torchrun",
    "--standalone",
    "--nproc-per-node=2",
    "-m",
    "megaformer",
]


@pytest.mark.parametrize("world,micro", [(1, 16), (2, 8), (4, 4)])
def test_quickstart_layout_holds_on_1_2_4_ranks(world, micro):
    """train.micro_batch_size=null: the global batch of 16 split over the data-parallel ranks,
    without accumulation (one rank keeps micro-batch 16: the one-process numbers do not change)."""
    from megaformer.config import load_config, validate_for_world

    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    assert cfg.train.micro_batch_size is None
    assert validate_for_world(cfg, world) == 1
    assert cfg.train.micro_batch_size == micro


def test_null_micro_batch_must_divide_over_ranks():
    from megaformer.config import load_config, validate_for_world
    from megaformer.errors import ConfigError

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["train.global_batch_size=6"])
    with pytest.raises(ConfigError, match="multiple of the data-parallel size 4"):
        validate_for_world(cfg, 4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_documented_two_process_quickstart_runs(tmp_path):
    proc = run_process(
        [
            "bash",
            "launch/torchrun.sh",
            "2",
            "configs/quickstart.yaml",
            "train.steps=2",
            "model.n_layers=1",
            "model.d_model=32",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "data.max_bytes=300000",
            "eval.interval=0",
            "eval.at_end=false",
            "checkpoint.interval=0",
            "log.sample_tokens=0",
            "log.progress_bar=false",
            "log.tensorboard=false",
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env=subprocess_env(PYTHON=sys.executable),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(micro 8 x accumulation 1 x DP 2)" in proc.stdout and "done: step 2" in proc.stdout


def test_launcher_without_torch_says_what_to_set(tmp_path):
    """A python on PATH that lacks torch (the README's install never activates .venv): one line,
    exit 2, instead of exit 1 and nothing."""
    launch = tmp_path / "launch"
    shutil.copytree(ROOT / "launch", launch)  # no .venv beside this copy
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").symlink_to("/bin/false")
    env = subprocess_env(PATH=f"{bare}:/usr/bin:/bin")
    env.pop("PYTHON", None)
    proc = run_process(
        ["bash", str(launch / "torchrun.sh"), "2", "configs/quickstart.yaml"], env=env, timeout=60
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot import torch and megaformer" in lines[0]
    assert "PYTHON=" in lines[0] and "activate" in lines[0]


def test_dry_run_checks_data_paths(tmp_path):
    proc = run_cli("train", "configs/quickstart.yaml", "data.paths=[data/nope]", "--dry-run")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "data/nope: no such file" in proc.stderr


def test_dry_run_checks_the_tokenizer_of_prepared_data(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 50)
    prefix = tmp_path / "prep"
    made = run_cli(
        "prepare-data",
        "--input",
        str(corpus),
        "--tokenizer",
        "bpe:300",
        "--output-prefix",
        str(prefix),
    )
    assert made.returncode == 0, made.stderr[-2000:]
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        f"data.paths=[{prefix}]",
        "data.tokenizer=byte",
        "--dry-run",
    )
    assert proc.returncode == 2 and "but the run's tokenizer has vocab" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    ok = run_cli(
        "train",
        "configs/quickstart.yaml",
        f"data.paths=[{prefix}]",
        f"data.tokenizer={prefix}.tokenizer.json",
        "--dry-run",
    )
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_missing_data_after_launch_is_one_line_and_exit_2(tmp_path):
    """2 gloo ranks meet a missing data path (torchrun without the launcher's pre-check): rank 0
    prints one line, rank 1 nothing, torchrun no failure table; exit 2."""
    proc = run_process(
        [
            *TORCHRUN,
            "train",
            "configs/quickstart.yaml",
            *cluster_overrides(**{"data.paths": "[data/nope]"}),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 3, proc.stderr
    assert sum("data/nope: no such file" in line for line in lines) == 1
    assert "Traceback" not in proc.stderr and "rank 1" not in proc.stderr


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=subprocess_env(PYTHON=sys.executable),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while not path.exists() or not path.read_text().count("\n"):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < end, f"no {path} after {timeout} s"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ctrl_c_under_torchrun_saves_and_exits_130(tmp_path):
    run = tmp_path / "run"
    proc = _start(
        [
            "bash",
            "launch/torchrun.sh",
            "2",
            "configs/quickstart.yaml",
            *cluster_overrides(**{"train.steps": 100000, "checkpoint.interval": 0}),
            "--run-dir",
            str(run),
        ]
    )
    try:
        _wait_for(run / "metrics.jsonl", proc)
        proc.send_signal(signal.SIGINT)  # the launcher (exec-ed torchrun) forwards it to the ranks
        out, err = proc.communicate(timeout=120)
    except BaseException:
        kill_group(proc)
        raise
    assert proc.returncode == 130, err[-3000:]
    assert list((run / "checkpoints").glob("step_*")), err[-3000:]
    assert "interrupted (SIGINT)" in out
    assert (
        "resume from it with the same command: launch/torchrun.sh 2 configs/quickstart.yaml" in out
    )
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ranks_end_when_their_launcher_is_killed(tmp_path):
    run = tmp_path / "run"
    proc = _start(
        [
            *TORCHRUN,
            "train",
            "configs/quickstart.yaml",
            *cluster_overrides(**{"train.steps": 100000, "checkpoint.interval": 0}),
            "--run-dir",
            str(run),
        ]
    )
    try:
        _wait_for(run / "metrics.jsonl", proc)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 2
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone
        proc.wait()
        end = time.monotonic() + 30
        while any(Path(f"/proc/{c}").exists() and "Z" not in _state(c) for c in children):
            assert time.monotonic() < end, "ranks still running 30 s after their launcher died"
            time.sleep(0.5)
    finally:
        kill_group(proc)
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").glob("step_*"))


def _state(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_sigint_stops_at_the_boundary_and_a_second_one_at_once(monkeypatch):
    """The first SIGINT asks for a checkpoint and exit 130; a repeat within REPEAT_S (the same
    Ctrl-C forwarded by torchrun) changes nothing; a later one raises KeyboardInterrupt."""
    from megaformer.training import preemption

    clock = [100.0]
    monkeypatch.setattr(preemption.time, "monotonic", lambda: clock[0])
    request = preemption.StopRequest()
    assert request.local_code() == preemption.NONE
    request._handle(signal.SIGINT, None)
    clock[0] += 0.01
    request._handle(signal.SIGINT, None)
    assert request.local_code() == preemption.INTERRUPT
    assert preemption.REASONS[request.local_code()] == preemption.INTERRUPTED
    request._handle(signal.SIGTERM, None)  # a SIGTERM too (torchrun's shutdown): still interrupted
    assert request.local_code() == preemption.INTERRUPT
    clock[0] += preemption.REPEAT_S
    with pytest.raises(KeyboardInterrupt):
        request._handle(signal.SIGINT, None)


def test_end_of_run_hints_name_the_venv_script(tmp_path, monkeypatch):
    """A venv that is not activated: the hint prints the path of its tensorboard / megaformer."""
    import shutil

    from megaformer.cli import train as train_command

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "tensorboard").write_text("#!/bin/sh\n")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert train_command._venv_command("tensorboard") == str(tmp_path / "bin" / "tensorboard")
    monkeypatch.setattr(shutil, "which", lambda name: str(tmp_path / "bin" / name))
    assert train_command._venv_command("tensorboard") == "tensorboard"  # activated: on PATH
