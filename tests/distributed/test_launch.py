"""Launchers: how megaformer recognises its launcher, and real launches with each of them.

Multi-node torchrun (two node processes rendezvousing over loopback), the DeepSpeed launcher with a
hostfile, and a one-machine Slurm cluster (sbatch launch/slurm.sbatch, 2 tasks, then a USR1
warning signal: checkpoint, requeue, resume) all reproduce the single-node 2-rank run's losses.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from megaformer.errors import LaunchError
from megaformer.training.distributed import detect_launch, first_host
from megaformer.training.faults import Fault, parse
from tests.helpers import (
    ROOT,
    cluster_overrides,
    free_port,
    kill_group,
    run_process,
    step_records,
    subprocess_env,
)


def assert_same_losses(run_dir: Path, reference: Path) -> None:
    got, want = step_records(run_dir), step_records(reference)
    assert sorted(got) == sorted(want)
    for step in want:
        for key in ("loss", "grad_norm", "lr"):
            assert got[step][key] == want[step][key], (step, key)


# ----------------------------------------------------------------------------- detection (fast)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ("python", 0, 1, 0)),
        (
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "x"},
            ("torchrun", 3, 8, 1),
        ),
        (
            {
                "RANK": "5",
                "WORLD_SIZE": "16",
                "LOCAL_RANK": "5",
                "CROSS_RANK": "0",
                "LOCAL_SIZE": "8",
            },
            ("deepspeed", 5, 16, 5),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2"}, ("environment", 1, 2, 0)),
        (
            {
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "9",
                "SLURM_NTASKS": "16",
                "SLURM_STEP_NUM_TASKS": "12",
                "SLURM_LOCALID": "1",
                "SLURM_JOB_ID": "4242",
                "SLURM_STEP_NODELIST": "gpu[07-09,12]",
            },
            ("srun", 9, 12, 1),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            },
            ("mpi (Open MPI)", 2, 4, 0),
        ),
        ({"PMI_RANK": "7", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3"}, ("mpi (PMI)", 7, 8, 3)),
        ({"PMIX_RANK": "1", "PMIX_SIZE": "2"}, ("mpi (PMIx)", 1, 2, 0)),
        # a batch script (no job step) is not a world of SLURM_NTASKS processes; torchrun inside srun wins
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}, ("python", 0, 1, 0)),
        (
            {
                "SLURM_STEP_ID": "0",
                "SLURM_PROCID": "1",
                "SLURM_NTASKS": "2",
                "RANK": "6",
                "WORLD_SIZE": "16",
                "LOCAL_RANK": "2",
                "TORCHELASTIC_RUN_ID": "j",
            },
            ("torchrun", 6, 16, 2),
        ),
    ],
)
def test_detect_launch(env, expected):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank) == expected
    if info.launcher == "srun":
        assert (info.master_addr, info.master_port) == ("gpu07", 29500 + 242)


def test_detect_launch_errors_and_node_lists():
    with pytest.raises(LaunchError, match="PMI_SIZE"):
        detect_launch({"PMI_RANK": "1"})
    with pytest.raises(LaunchError, match="RANK='x'"):
        detect_launch({"RANK": "x", "WORLD_SIZE": "2"})
    assert first_host("node001") == "node001"
    assert first_host("a[3-4],b[1-2]") == "a3"
    assert first_host("gpu[0012,0020-0030]") == "gpu0012"


def test_fault_spec():
    assert parse("nan@step=3,rank=1;stall@step=4-6,seconds=2;kill@step=6,rank=1,attempt=1") == [
        Fault("nan", 3, 3, 1),
        Fault("stall", 4, 6, None, 0, 2.0),
        Fault("kill", 6, 6, 1, 1),
    ]
    with pytest.raises(LaunchError, match="KIND@step=S"):
        parse("explode@step=3")


def test_one_line_errors_for_a_bad_launch_environment(tmp_path):
    from tests.helpers import assert_one_line_error, cli_main, tiny_overrides

    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "--run-dir",
        str(tmp_path / "run"),
        env=env,
    )
    assert_one_line_error(proc, "mpi (Open MPI): world size 2 but MASTER_ADDR/MASTER_PORT")


# ----------------------------------------------------------------------------- real launches


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_torchrun_nodes_over_loopback_equal_one_node(tmp_path, ddp_reference):
    """launch/torchrun.sh with NNODES=2: node ranks 0 and 1, one process each, c10d rendezvous."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                "bash",
                "launch/torchrun.sh",
                "1",
                "configs/quickstart.yaml",
                *cluster_overrides(),
                "--run-dir",
                str(tmp_path / "run"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=subprocess_env(
                PYTHON=sys.executable,
                NNODES="2",
                NODE_RANK=str(node),
                RDZV_ENDPOINT=f"127.0.0.1:{port}",
                RDZV_ID="loopback",
            ),
        )
        for node in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    except BaseException:
        for p in procs:
            kill_group(p)
        raise
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert "launch: torchrun, rank 0 of 2" in "".join(outs)
    assert_same_losses(tmp_path / "run", ddp_reference)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_deepspeed_launcher_with_a_hostfile(tmp_path, ddp_reference):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# one host, two processes\nlocalhost slots=2\n")
    proc = run_process(
        [
            "bash",
            "launch/deepspeed.sh",
            str(hostfile),
            "configs/quickstart.yaml",
            *cluster_overrides(),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env=subprocess_env(PYTHON=sys.executable, MASTER_PORT=str(free_port())),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "launch: deepspeed, rank 0 of 2" in proc.stdout
    assert_same_losses(tmp_path / "run", ddp_reference)


# ----------------------------------------------------------------------------- Slurm


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict]:
    """A one-machine Slurm cluster (installed and started by tests/slurm/setup_local_slurm.sh);
    the daemons it started (munged, slurmctld, slurmd) are stopped when the module's tests end."""
    state = Path("/tmp/megaformer-slurm")

    def stop() -> None:
        subprocess.run(
            ["bash", "tests/slurm/stop_local_slurm.sh", str(state)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        proc = subprocess.run(
            ["bash", "tests/slurm/setup_local_slurm.sh", str(state)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
    except BaseException:
        stop()
        raise
    if proc.returncode == 77:
        stop()  # a daemon started before the step that failed
        reason = (proc.stdout.strip().splitlines() or ["Slurm cannot be set up here"])[-1]
        print(reason)
        pytest.skip(reason)
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield {"SLURM_CONF": str(state / "slurm.conf")}
    finally:
        stop()


def _job_state(job: str, env: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env)
    for field in out.stdout.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slurm_sbatch_two_tasks_preempted_requeued_and_resumed(tmp_path, slurm, ddp_reference):
    """sbatch -n 2 launch/slurm.sbatch: two srun tasks (SLURM_PROCID -> rank). Once step 2 is logged,
    `scancel --batch --signal=USR1` plays Slurm's time-limit warning: the script passes SIGTERM to
    the ranks, they save a checkpoint and exit 0, the job requeues itself, and the requeued run
    resumes and finishes with the uninterrupted run's losses. (Every rank sleeps 1 s per step
    from step 3 on, so the warning lands mid-run; sleeping changes no number.)"""
    run = tmp_path / "run"
    env = subprocess_env(
        PYTHON=sys.executable, MEGAFORMER_FAULT="stall@step=3-6,seconds=1", **slurm
    )
    sub = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-n",
            "2",
            "-o",
            str(tmp_path / "job.out"),
            "launch/slurm.sbatch",
            "configs/quickstart.yaml",
            *cluster_overrides(),
            "--run-dir",
            str(run),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    signalled = released = False
    pending_since = 0.0
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline:
            if (
                not signalled
                and (run / "metrics.jsonl").is_file()
                and max(step_records(run), default=0) >= 2
            ):
                subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=env, check=True)
                signalled = True
            state = _job_state(job, env)
            if signalled and state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
                break
            if signalled and state == "PENDING":
                # requeued: Slurm holds it 120 s; start it now (2 s on: a credential issued in the
                # second the old one was revoked is refused)
                pending_since = pending_since or time.monotonic()
                if not released and time.monotonic() - pending_since > 2:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
                    released = True
            time.sleep(0.5)
    finally:
        if _job_state(job, env) not in ("COMPLETED", "FAILED", "CANCELLED"):
            subprocess.run(["scancel", job], env=env)
    log = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", (state, log[-4000:])
    assert "tasks mode, world 2" in log and "launch: srun, rank 0 of 2" in log
    assert "USR1 received" in log and "requeueing job" in log, log[-4000:]
    assert "(restart 1)" in log and "resumed from" in log, log[-4000:]
    stopped = [line for line in log.splitlines() if "stop signal received" in line]
    assert stopped, log[-4000:]
    assert_same_losses(run, ddp_reference)
    assert (run / "checkpoints" / "step_0000006").is_dir()


def _sbatch_and_wait(args: list[str], env: dict, timeout: float = 600) -> str:
    sub = subprocess.run(
        ["sbatch", "--parsable", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    state = _job_state(job, env)
    while state not in (
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
    ):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            break
        time.sleep(0.5)
        state = _job_state(job, env)
    return state


@pytest.mark.slow
@pytest.mark.multiprocess
def test_slurm_sbatch_one_torchrun_per_node(tmp_path, slurm, ddp_reference):
    """One task on the node runs torchrun (c10d rendezvous on the allocation's first node) with
    NPROC_PER_NODE=2 processes: the same losses as the single-node run."""
    env = subprocess_env(PYTHON=sys.executable, NPROC_PER_NODE="2", **slurm)
    state = _sbatch_and_wait(
        [
            "-N",
            "1",
            "-n",
            "1",
            "-c",
            "2",
            "-o",
            str(tmp_path / "job.out"),
            "launch/slurm.sbatch",
            "configs/quickstart.yaml",
            *cluster_overrides(),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env,
    )
    log = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", (state, log[-4000:])
    assert "torchrun mode, world 2" in log and "launch: torchrun, rank 0 of 2" in log, log[-4000:]
    assert_same_losses(tmp_path / "run", ddp_reference)
