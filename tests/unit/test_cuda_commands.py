"""The CUDA tier's training commands (tests/cuda/test_cuda.py :data:`TRAINING_CASES`) checked on CPU:
each passes ``megaformer train --dry-run`` with its CUDA keys, so a config the tier would have
refused fails here, without a GPU.

``--dry-run`` validates the config, the layout for ``--world-size`` processes and the rules that
need only the device type (``train.device=cuda``: FP8 on CUDA needs ``train.compile``), not the
device itself (FP8 GEMM support, the number of GPUs)."""

from __future__ import annotations

import pytest

from tests.cuda.test_cuda import TRAINING_CASES, training_args
from tests.helpers import cli_main


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("case", list(TRAINING_CASES))
def test_cuda_training_command_passes_dry_run(tmp_path, case, precision):
    spec = TRAINING_CASES[case]
    args = training_args(spec, precision, tmp_path / "run")
    proc = cli_main(*args, "--dry-run", "--world-size", str(spec.processes))
    assert proc.returncode == 0, (case, precision, proc.stderr[-2000:])
    assert "train.device" not in proc.stderr
    assert "device: cuda" in proc.stdout and f"precision: {precision}" in proc.stdout, proc.stdout
    assert not (tmp_path / "run").exists()


def test_a_refused_tier_config_fails_the_dry_run(tmp_path):
    """What the tier's first version asked for: bf16 with ZeRO-0."""
    spec = TRAINING_CASES["1-none"]._replace(shared={"parallel.zero_stage": 0})
    proc = cli_main(*training_args(spec, "bf16", tmp_path / "run"), "--dry-run")
    assert proc.returncode == 2 and "zero_stage" in proc.stderr, proc.stderr


def test_subprocess_env_keeps_the_machines_pythonpath(monkeypatch):
    """The tier's CLI subprocesses import what this process imports: the repository first, then
    every PYTHONPATH entry of the machine (its packages may live there)."""
    import os

    from tests.helpers import ROOT, subprocess_env

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/opt/site", str(ROOT), "/tmp/mf-site"]))
    assert subprocess_env()["PYTHONPATH"].split(os.pathsep) == [
        str(ROOT),
        "/opt/site",
        "/tmp/mf-site",
    ]
    monkeypatch.delenv("PYTHONPATH")
    assert subprocess_env()["PYTHONPATH"] == str(ROOT)
