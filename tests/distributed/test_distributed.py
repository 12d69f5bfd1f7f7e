"""Data parallelism under torchrun (gloo): two ranks equal one process with the same global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_cli, run_torchrun, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def records(run_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


@pytest.mark.parametrize("stage", [0, 2])
def test_two_ranks_equal_one_process(tmp_path, stage):
    common = tiny_overrides(
        "stdlib",
        **{
            "train.steps": 3,
            "eval.interval": 3,
            "train.micro_batch_size": 4,
            "train.global_batch_size": 8,
            "parallel.zero_stage": stage,
        },
    )
    single = run_cli(
        "train", "configs/quickstart.yaml", *common, "--run-dir", str(tmp_path / "one")
    )
    assert single.returncode == 0, single.stderr[-3000:]
    double = run_torchrun(
        2, "train", "configs/quickstart.yaml", *common, "--run-dir", str(tmp_path / "two")
    )
    assert double.returncode == 0, double.stdout[-3000:] + double.stderr[-3000:]
    assert "world 2 = DP 2" in double.stdout and "accumulation 1 x DP 2" in double.stdout
    assert "accumulation 2 x DP 1" in single.stdout
    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        for key in ("loss", "grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5), (step, key)
    assert b[3]["val_loss"] == pytest.approx(a[3]["val_loss"], rel=1e-5)
    # both ranks wrote one checkpoint; rank 1's RNG state is in it
    ckpt = tmp_path / "two" / "checkpoints" / "step_0000003"
    assert (ckpt / "rng" / "rank_1.pt").is_file()


def test_layout_errors_stop_every_rank(tmp_path):
    """Raw torchrun: every rank exits 2 promptly, the message is printed once (rank 0)."""
    bad = tiny_overrides("stdlib", **{"train.micro_batch_size": 3, "train.global_batch_size": 3})
    proc = run_torchrun(
        2,
        "train",
        "configs/quickstart.yaml",
        *bad,
        "--run-dir",
        str(tmp_path / "run"),
        timeout=120,
        launcher=True,
    )
    assert proc.returncode != 0
    message = "train.global_batch_size=3: must be a multiple of"
    assert proc.stderr.count(message) == 1, proc.stderr


def test_launch_script_checks_the_layout_first(tmp_path):
    """launch/torchrun.sh refuses an impossible layout with one line before starting any rank."""
    import sys

    from tests.helpers import assert_one_line_error, run_process, subprocess_env

    bad = tiny_overrides("stdlib", **{"train.micro_batch_size": 3, "train.global_batch_size": 3})
    proc = run_process(
        [
            "bash",
            "launch/torchrun.sh",
            "2",
            "configs/quickstart.yaml",
            *bad,
            "--run-dir",
            str(tmp_path / "run"),
        ],
        env=subprocess_env(PYTHON=sys.executable),
        timeout=120,
    )
    assert_one_line_error(proc, "data-parallel size = 3 * 2 = 6")
    assert not (tmp_path / "run").exists()
