"""Shared fixtures: tiny configs, running the CLI in a subprocess, and torchrun launches.

Markers: ``slow`` (trains a model; seconds to a minute) and ``multiprocess`` (several ranks under
torchrun, gloo). The fast set: ``pytest -m "not slow and not multiprocess"``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

torch.set_num_threads(1)  # 2-core machines: tests and their subprocess ranks must not oversubscribe


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "slow: trains a (tiny) model")
    config.addinivalue_line("markers", "multiprocess: launches several ranks with torchrun")


def tiny_overrides(corpus: Path | str = "stdlib", **extra: Any) -> list[str]:
    """CLI overrides for a ~30k-parameter model that trains in a second per few steps on CPU."""
    base = {
        "model.d_model": 32, "model.n_layers": 2, "model.n_heads": 4, "model.n_kv_heads": 2,
        "model.max_seq_len": 32, "data.source": str(corpus), "data.max_bytes": 200000,
        "train.steps": 6, "train.micro_batch_size": 4, "train.global_batch_size": 8,
        "train.lr": 3e-3, "train.warmup_steps": 2, "eval.interval": 3, "eval.iters": 2,
        "checkpoint.interval": 0, "log.interval": 1, "log.progress_bar": False,
        "log.tensorboard": False, "log.sample_tokens": 0,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu",
                "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m megaformer ARGS`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "megaformer", *args], cwd=cwd or ROOT,
                          env=env or subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(nproc: int, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N -m megaformer ARGS`` on this machine (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "-m", "megaformer", *args]
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """A user error: exit 2, one line on stderr naming the problem, no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], err[-2000:])
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err
    lines = [line for line in err.splitlines() if line.startswith("megaformer: error:")]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def text_corpus(tmp_path: Path) -> Path:
    """A small folder of text documents (deterministic)."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    import random

    rng = random.Random(0)
    words = "the model reads the residual stream and writes its update back additively".split()
    for i in range(40):
        doc = " ".join(rng.choice(words) for _ in range(rng.randint(50, 400)))
        (folder / f"doc{i:03d}.txt").write_text(doc + "\n")
    return folder


# ----------------------------------------------------------------------------- cluster runs

def cluster_overrides(**extra: Any) -> list[str]:
    """The tiny 2-rank run shared by the launcher and fault tests: 6 steps, checkpoints every 2."""
    return tiny_overrides("stdlib", **{"checkpoint.interval": 2, "checkpoint.keep_last": "null",
                                       "eval.interval": 0, "eval.at_end": "false", **extra})


def torchrun_cmd(nproc: int, *args: str, restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--max-restarts={restarts}", "-m", "megaformer", *args]


def step_records(run_dir: Path) -> dict[int, dict]:
    import json

    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: Any) -> Path:
    """An uninterrupted 2-rank torchrun run of :func:`cluster_overrides` (the numbers to match)."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = subprocess.run(torchrun_cmd(2, "train", "configs/quickstart.yaml", *cluster_overrides(),
                                       "--run-dir", str(run_dir)),
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(step_records(run_dir)) == [1, 2, 3, 4, 5, 6]
    return run_dir
