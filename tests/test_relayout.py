"""Resuming at another layout (online, and after an offline reshard) continues the original run.

Layout A: DP=2 with ZeRO-1 (DeepSpeed's partitioned optimizer), 6 steps, a checkpoint at step 3.
From that checkpoint the run resumes at PP=2 (DP=1, ZeRO-1) and, after ``reshard_checkpoint``, at
TP=2 (DP=1, ZeRO-0: torch's AdamW as is); steps 4-6 equal A's within fp32 tolerance. The global
batch stays 8 sequences (A: micro 4 x DP 2; B: micro 4 x accumulation 2).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megaformer.checkpoint import io as ckpt_io
from megaformer.checkpoint import portable
from megaformer.checkpoint.reshard import reshard_checkpoint
from megaformer.checkpoint.safe_load import safe_torch_load
from megaformer.errors import CheckpointError, ConfigError
from tests.helpers import assert_one_line_error, cli_main, run_cli, run_torchrun, tiny_overrides

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

COMMON = ("train.steps=6", "eval.interval=0", "model.dropout=0.0", "model.attention_dropout=0.0")


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def rewind(run: Path, to: str = "step_0000003") -> None:
    """Keep only the checkpoint ``to``, as if the run had stopped there."""
    for ckpt in (run / "checkpoints").glob("step_*"):
        if ckpt.name != to:
            shutil.rmtree(ckpt)
    (run / "checkpoints" / "latest").write_text(to + "\n")


def assert_same_continuation(run: Path, reference: Path) -> None:
    a, b = losses(reference), losses(run)
    assert sorted(b)[-3:] == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (step, a[step], b[step])
    assert a[6] < a[3]  # the continuation trains: the comparison is not between constants


def torchrun_train(run: Path, *overrides: str) -> str:
    proc = run_torchrun(2, "train", "configs/quickstart.yaml", *tiny_overrides(), *COMMON,
                        *overrides, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def layout_a(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("relayout") / "a"
    torchrun_train(run, "parallel.zero_stage=1", "checkpoint.interval=3")
    return run


def test_checkpoint_holds_layout_free_state(layout_a):
    ckpt = layout_a / "checkpoints" / "step_0000003"
    state = portable.PortableState(ckpt)
    assert state.info["step"] == 3 and state.info["adam_step"] == 3.0
    assert state.info["layout"]["data"] == 2
    weights = ckpt_io.load_weights(ckpt)
    assert sorted(state.names()) == sorted(weights)
    for name, w in weights.items():  # fp32 training: the master weights are the weights
        assert torch.equal(state.tensor(name, "master"), w), name
        assert state.tensor(name, "exp_avg_sq").min() >= 0
        assert state.tensor(name, "exp_avg").abs().sum() > 0, name


def test_resume_at_pipeline_2(layout_a, tmp_path):
    run = tmp_path / "pp2"
    shutil.copytree(layout_a, run)
    rewind(run)
    out = torchrun_train(run, "parallel.pipeline=2", "parallel.zero_stage=1")
    assert "at a new layout" in out and "pipeline 1 -> 2" in out
    assert_same_continuation(run, layout_a)


def test_reshard_then_resume_at_tensor_2(layout_a, tmp_path):
    dst = tmp_path / "tp2"
    ckpt = reshard_checkpoint(layout_a / "checkpoints" / "step_0000003", dst, tensor=2, pipeline=1)
    assert ckpt == dst / "checkpoints" / "step_0000003"
    assert ckpt_io.latest_checkpoint(dst / "checkpoints") == ckpt
    assert not list(ckpt.glob("*.pt")) and not (ckpt / "rng").exists()
    meta = ckpt_io.read_meta(ckpt)
    assert meta["engine_state"] is False and meta["parallel"] == {"tensor": 2, "pipeline": 1}
    assert "tensor: 2" in (ckpt / "config.yaml").read_text()
    out = torchrun_train(dst, "parallel.tensor=2")
    assert "resharded offline" in out
    assert_same_continuation(dst, layout_a)


def test_reshard_refusals(layout_a, tmp_path):
    src = layout_a / "checkpoints" / "step_0000003"
    (tmp_path / "exists").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        reshard_checkpoint(src, tmp_path / "exists", 2, 1)
    with pytest.raises(ConfigError, match="parallel.tensor=3"):
        reshard_checkpoint(src, tmp_path / "tp3", 3, 1)
    with pytest.raises(ConfigError, match="more stages than model.n_layers"):
        reshard_checkpoint(src, tmp_path / "pp4", 1, 4)
    assert not (tmp_path / "tp3").exists() and not (tmp_path / "pp4").exists()

    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    stage = bad / "optimizer" / "stage_00.safetensors"
    data = stage.read_bytes()
    stage.write_bytes(data[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"stage_00.safetensors: truncated or tampered"):
        reshard_checkpoint(bad, tmp_path / "out", 2, 1)
    n = int.from_bytes(data[:8], "little")
    header = data[8:8 + n].replace(b'"F32"', b'"F16"', 1)  # tampered: dtype edited
    stage.write_bytes(data[:8] + header + data[8 + n:])
    with pytest.raises(CheckpointError, match=r"stage_00.safetensors: truncated or tampered"):
        reshard_checkpoint(bad, tmp_path / "out", 2, 1)
    assert not (tmp_path / "out").exists()


def test_resume_at_data_parallel_1_with_async_save(layout_a, tmp_path):
    """DP 2 -> 1 under ZeRO-1 (DeepSpeed's partitions reassembled); the step-6 checkpoint is
    written in the background and equals, tensor by tensor, the one layout A wrote."""
    run = tmp_path / "dp1"
    shutil.copytree(layout_a, run)
    rewind(run)
    proc = run_cli("train", "configs/quickstart.yaml", *tiny_overrides(), *COMMON,
                   "parallel.zero_stage=1", "checkpoint.interval=3", "checkpoint.async_save=true",
                   "checkpoint.keep_last=1", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data 2 -> 1" in proc.stdout and "(in the background)" in proc.stdout
    assert_same_continuation(run, layout_a)
    ckpt = ckpt_io.latest_checkpoint(run / "checkpoints")
    assert [p.name for p in ckpt_io.complete_checkpoints(run / "checkpoints")] == [ckpt.name]
    assert ckpt.name == "step_0000006" and ckpt_io.read_meta(ckpt)["parallel"]["data"] == 1
    engine_state = safe_torch_load(str(ckpt / "mp_rank_00_model_states.pt"))["module"]
    for name, w in ckpt_io.load_weights(ckpt).items():  # DeepSpeed's file, deferred, is whole
        assert torch.equal(engine_state[name][:w.shape[0]], w), name
    mine, theirs = (portable.PortableState(r / "checkpoints" / "step_0000006")
                    for r in (run, layout_a))
    assert sorted(mine.names()) == sorted(theirs.names())
    for name in theirs.names():
        for key in portable.KEYS:
            a, b = theirs.tensor(name, key), mine.tensor(name, key)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (name, key)


def test_relayout_resume_with_a_truncated_state_file_is_one_clear_error(layout_a, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(layout_a, run)
    rewind(run)
    stage = run / "checkpoints" / "step_0000003" / "optimizer" / "stage_00.safetensors"
    stage.write_bytes(stage.read_bytes()[:5000])
    proc = cli_main("train", "configs/quickstart.yaml", *tiny_overrides(), *COMMON,
                    "parallel.zero_stage=1", "--run-dir", str(run))  # DP 2 -> 1
    assert_one_line_error(proc, "stage_00.safetensors", "truncated or tampered")
