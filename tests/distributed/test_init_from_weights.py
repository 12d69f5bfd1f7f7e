"""A weights-only checkpoint (what ``megaformer convert`` writes) seeds training at any layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from megaformer.checkpoint import layout as ckpt_layout
from megaformer.checkpoint import weights as ckpt_weights
from megaformer.data.tokenizer import load_tokenizer
from megaformer.errors import CheckpointError
from tests.helpers import assert_one_line_error, cli_main, run_cli, run_torchrun, tiny_overrides

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def weights_run(tmp_path_factory) -> Path:
    """Two steps of training, re-saved as a weights-only checkpoint in a fresh run directory."""
    base = tmp_path_factory.mktemp("w")
    src = base / "src"
    proc = run_cli(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "train.steps=2",
        "--run-dir",
        str(src),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = ckpt_layout.resolve_checkpoint(src)
    dst = base / "dst"
    ckpt_weights.save_weights_checkpoint(
        dst,
        0,
        ckpt_weights.load_weights(ckpt),
        (ckpt / ckpt_layout.CONFIG).read_text(),
        load_tokenizer(ckpt / "tokenizer.json"),
        {"source": str(ckpt)},
    )
    return dst


def test_weights_only_checkpoint_layout(weights_run):
    ckpt = ckpt_layout.resolve_checkpoint(weights_run)
    assert ckpt.name == "step_0000000" and ckpt_layout.is_weights_only(ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.yaml",
        "meta.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    with pytest.raises(CheckpointError, match="already exists"):
        ckpt_weights.save_weights_checkpoint(weights_run, 0, {}, "", None, {})


def test_training_starts_from_the_weights_at_tensor_parallel_2(weights_run, tmp_path):
    """One step at lr=1e-30 (an update far below fp32 resolution): the saved weights are the
    imported ones after TP=2 sharded them (vocabulary padded) and gathered them back."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(weights_run, run)
    before = ckpt_weights.load_weights(ckpt_layout.resolve_checkpoint(run))
    proc = run_torchrun(
        2,
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "parallel.tensor=2",
        "train.steps=1",
        "train.lr=1e-30",
        "train.min_lr=0",
        "train.warmup_steps=0",
        "eval.interval=0",
        "--run-dir",
        str(run),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "starting from the weights of" in proc.stdout + proc.stderr
    after_ckpt = ckpt_layout.resolve_checkpoint(run)
    assert after_ckpt.name == "step_0000001" and not ckpt_layout.is_weights_only(after_ckpt)
    after = ckpt_weights.load_weights(after_ckpt)
    assert sorted(after) == sorted(before)
    for k in before:
        assert (after[k].float() - before[k].float()).abs().max() <= 1e-20, k


def test_weights_that_do_not_fit_are_refused(weights_run, tmp_path):
    run = tmp_path / "run"
    import shutil

    shutil.copytree(weights_run, run)
    ckpt = run / "checkpoints" / "step_0000000"
    from safetensors.torch import save_file

    w = ckpt_weights.load_weights(ckpt)
    w.pop(sorted(w)[-1])
    save_file(w, str(ckpt / "model.safetensors"))
    proc = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(),
        "train.steps=1",
        "--run-dir",
        str(run),
    )
    assert_one_line_error(proc, "weights do not fit")
