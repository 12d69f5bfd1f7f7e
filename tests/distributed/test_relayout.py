"""Resuming at another layout after an offline reshard, and with an asynchronous save.

Layout A: DP=2 with ZeRO-1 (DeepSpeed's partitioned optimizer), 6 steps, a checkpoint at step 3.
After ``reshard_checkpoint`` the run resumes at TP=2 (DP=1, ZeRO-0: torch's AdamW as is), and
directly at DP=1 with an asynchronous save; steps 4-6 equal A's within fp32 tolerance. The global
batch stays 8 sequences (A: micro 4 x DP 2; B: micro 4 x accumulation 2). Resuming between 4-rank
layouts is tested in tests/distributed/test_sharded_checkpoint.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import sharded
from megaformer.checkpoint.reshard import reshard_checkpoint
from megaformer.checkpoint.sharded import ShardedState
from megaformer.errors import CheckpointError, ConfigError
from tests.helpers import run_cli, run_torchrun, tiny_overrides

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
    proc = run_torchrun(
        2,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        *COMMON,
        *overrides,
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def layout_a(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("relayout") / "a"
    torchrun_train(run, "parallel.zero_stage=1", "checkpoint.interval=3")
    return run


def test_checkpoint_holds_sharded_state(layout_a):
    ckpt = layout_a / "checkpoints" / "step_0000003"
    state = ShardedState(ckpt)
    assert state.index["step"] == 3 and state.adam_step == 3.0
    assert state.index["layout"]["data"] == 2
    assert sorted(state.files) == ["rank_00000.safetensors", "rank_00001.safetensors"]
    for name in state.names():
        assert state.whole(name, "exp_avg_sq").min() >= 0
        assert state.whole(name, "exp_avg").abs().sum() > 0, name


def test_reshard_then_resume_at_tensor_2(layout_a, tmp_path):
    dst = tmp_path / "tp2"
    ckpt = reshard_checkpoint(layout_a / "checkpoints" / "step_0000003", dst, tensor=2, pipeline=1)
    assert ckpt == dst / "checkpoints" / "step_0000003"
    assert ckpt_layout.latest_checkpoint(dst / "checkpoints") == ckpt
    assert not list(ckpt.glob("*.pt")) and not (ckpt / "rng").exists()
    meta = ckpt_layout.read_meta(ckpt)
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
    shard = bad / "state" / "rank_00001.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"rank_00001.safetensors: .*truncated"):
        reshard_checkpoint(bad, tmp_path / "out", 2, 1)
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b'"F32"', b'"F16"', 1)  # tampered: dtype edited
    shard.write_bytes(data[:8] + header + data[8 + n :])
    with pytest.raises(CheckpointError, match=r"rank_00001.safetensors: truncated or tampered"):
        reshard_checkpoint(bad, tmp_path / "out", 2, 1)
    assert not (tmp_path / "out").exists()


def test_resume_at_data_parallel_1_with_async_save(layout_a, tmp_path):
    """DP 2 -> 1 under ZeRO-1 (DeepSpeed's partitions reassembled); the step-6 checkpoint is
    written in the background and equals, tensor by tensor, the one layout A wrote."""
    run = tmp_path / "dp1"
    shutil.copytree(layout_a, run)
    rewind(run)
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        *COMMON,
        "parallel.zero_stage=1",
        "checkpoint.interval=3",
        "checkpoint.async_save=true",
        "checkpoint.keep_last=1",
        "checkpoint.export_weights=true",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data 2 -> 1" in proc.stdout and "(in the background)" in proc.stdout
    assert_same_continuation(run, layout_a)
    ckpt = ckpt_layout.latest_checkpoint(run / "checkpoints")
    assert [p.name for p in ckpt_layout.complete_checkpoints(run / "checkpoints")] == [ckpt.name]
    assert ckpt.name == "step_0000006" and ckpt_layout.read_meta(ckpt)["parallel"]["data"] == 1
    from safetensors.torch import load_file

    mine, theirs = (ShardedState(r / "checkpoints" / "step_0000006") for r in (run, layout_a))
    exported = load_file(str(ckpt / "model.safetensors"))  # checkpoint.export_weights=true
    assert sorted(mine.names()) == sorted(theirs.names()) == sorted(exported)
    for name in theirs.names():
        assert torch.equal(exported[name], mine.whole(name)), name  # fp32: weights = masters
        for key in sharded.KEYS:
            a, b = theirs.whole(name, key), mine.whole(name, key)
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (name, key)
