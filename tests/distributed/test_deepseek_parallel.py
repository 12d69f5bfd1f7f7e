"""The DeepSeek-V3 shape (multi-head latent attention, group-limited sigmoid MoE with a shared
expert and a dense first block) trained under pipeline, tensor and sequence parallelism with
recomputation equals one process over 3 steps (losses, gradient norms, weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_pipeline import _compare
from tests.helpers import run_cli, run_torchrun, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

CONFIG = "configs/deepseek-tiny.yaml"
ARGS = {
    "model.d_model": 32,
    "model.n_layers": 4,
    "model.n_kv_heads": "null",
    "model.d_ffn": 64,
    "model.mla.q_lora_rank": 16,
    "model.mla.kv_lora_rank": 12,
    "model.mla.qk_nope_head_dim": 8,
    "model.mla.qk_rope_head_dim": 4,
    "model.mla.v_head_dim": 6,
    "model.moe.d_expert": 16,
    "train.steps": 3,
    "train.micro_batch_size": 2,
    "train.lr": 1e-3,
    "train.global_batch_size": 8,
    "eval.interval": 3,
    "eval.iters": 1,
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("dsv3") / "ref"
    proc = run_cli("train", CONFIG, *tiny_overrides("stdlib", **ARGS), "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.parametrize(
    "world,extra",
    [
        (2, {"parallel.pipeline": 2}),
        (
            4,
            {
                "parallel.pipeline": 2,
                "parallel.tensor": 2,
                "parallel.sequence_parallel": "true",
                "train.recompute": "selective",
            },
        ),
    ],
    ids=["pp2", "pp2xtp2-sp-selective"],
)
def test_layout_equals_one_process(reference, tmp_path, world, extra):
    run = tmp_path / "run"
    overrides = tiny_overrides("stdlib", **{**ARGS, **extra})
    proc = run_torchrun(world, "train", CONFIG, *overrides, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _compare(reference, run)
