"""The shipped DeepSeek-V3 configs: the 671B shape counts the published parameters (equal to
transformers' DeepseekV3ForCausalLM and to megaformer's module, both built on meta), --dry-run and
``megaformer plan`` accept it; the tiny one trains a few steps with a falling loss."""

from __future__ import annotations

import pytest
import torch

from megaformer.analysis.params import count_parameters
from megaformer.config import load_config
from tests.helpers import ROOT, cli_main, step_records

FULL = ROOT / "configs" / "deepseek-v3-671b.yaml"


def test_671b_counts_the_published_parameters():
    cfg = load_config(FULL)
    counts = count_parameters(cfg.model)
    assert counts["total"] == 671_026_404_352  # published: 671B (without the MTP module)
    assert counts["active"] == 37_552_282_624  # published: 37B activated per token
    from megaformer.model.transformer import Transformer

    with torch.device("meta"):
        assert Transformer(cfg.model).num_parameters() == counts["total"]
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):  # transformers' defaults are DeepSeek-V3's shapes
        theirs = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config())
    assert sum(p.numel() for p in theirs.parameters()) == counts["total"]


def test_671b_dry_run_and_plan():
    proc = cli_main("train", str(FULL), "--dry-run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "671,026,404,352 total" in proc.stdout and "37,552,282,624 active" in proc.stdout
    proc = cli_main("plan", str(FULL), "--gpus", "512", "--gpu", "H100-SXM", "--top", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "plan deepseek-v3-671b: 512 GPUs" in proc.stdout and "feasible" in proc.stdout


@pytest.mark.slow
def test_tiny_trains(tmp_path):
    proc = cli_main(
        "train",
        str(ROOT / "configs" / "deepseek-tiny.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "train.steps=12",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        "model.max_seq_len=64",
        "data.max_bytes=400000",
        "eval.interval=0",
        "checkpoint.interval=0",
        "log.interval=1",
        "log.sample_tokens=0",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = step_records(tmp_path / "run")
    losses = [records[s]["loss"] for s in sorted(records)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, losses
    assert any(k.startswith("moe/load_cv/") for k in records[12])  # the MoE blocks report
