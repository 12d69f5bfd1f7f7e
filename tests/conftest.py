"""Fixtures and markers (helpers to import live in ``tests/helpers.py``).

Layout: ``unit/`` (one process), ``distributed/`` (several ranks, training runs), ``cuda/`` (the
GPU tier). Markers: ``slow`` (trains a model, compiles, builds the site; seconds to a minute) and
``multiprocess`` (several gloo ranks). The fast set: ``pytest tests -m "not slow and not
multiprocess"``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megaformer.runtime import spawn  # noqa: E402
from tests.helpers import cluster_overrides, run_torchrun, step_records, subprocess_env  # noqa: E402

torch.set_num_threads(1)  # 2-core machines: tests and their subprocess ranks must not oversubscribe
# Ranks and "fresh" CLI processes fork from one server per session that has imported these once.
spawn.configure(
    preload=["pytest", "megaformer.cli", "megaformer.training.trainer", "tests.helpers"],
    env=subprocess_env(),
)


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "slow: trains a (tiny) model, compiles, or builds the site (seconds or more each)",
    )
    config.addinivalue_line("markers", "multiprocess: runs several ranks (run_ranks, torchrun)")
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA device (skips with the reason on CPU); the GPU tier: pytest -m cuda",
    )


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


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: Any) -> Path:
    """An uninterrupted 2-rank run of :func:`~tests.helpers.cluster_overrides` (the numbers to
    match), on ranks forked with torchrun's environment: the launcher tests compare their real
    launches with it."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    proc = run_torchrun(
        2, "train", "configs/quickstart.yaml", *cluster_overrides(), "--run-dir", str(run_dir)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(step_records(run_dir)) == [1, 2, 3, 4, 5, 6]
    return run_dir
