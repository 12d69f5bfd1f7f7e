"""``megaformer bench``: the Hugging Face twin has the same parameters; the command runs and compares."""

from __future__ import annotations

import json

import pytest
import torch

from megaformer.analysis.bench import hf_model
from megaformer.analysis.params import count_parameters
from tests.helpers import assert_one_line_error, cli_main, run_cli, tiny_model

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "kw",
    [
        dict(
            position="rope", norm="rmsnorm", activation="swiglu", n_kv_heads=2, tie_embeddings=True
        ),
        dict(position="rope", norm="rmsnorm", activation="swiglu", tie_embeddings=False),
        dict(
            position="learned",
            norm="layernorm",
            activation="gelu_tanh",
            bias=True,
            tie_embeddings=True,
        ),
    ],
)
def test_hf_twin_has_same_parameter_count(kw):
    cfg = tiny_model(vocab_size=97, **kw)
    with torch.device("meta"):
        hf = hf_model(cfg)
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(cfg)["total"]


def test_no_twin_is_a_user_error():
    assert_one_line_error(
        cli_main(
            "bench",
            "configs/quickstart.yaml",
            "model.residual=parallel",
            "--compare-hf",
            "--steps",
            "1",
        ),
        "no transformers twin",
    )


@pytest.mark.slow
def test_bench_compare_hf_runs():
    r = run_cli(
        "bench",
        "configs/quickstart.yaml",
        "model.n_layers=1",
        "model.d_model=64",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.max_seq_len=32",
        "train.micro_batch_size=2",
        "--steps",
        "4",
        "--warmup",
        "1",
        "--compare-hf",
        "--peak-tflops",
        "1",
        "--json",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert len(out["results"]) == 2 and out["ratio"] > 0
    q1, q3 = out["ratio_paired_quartiles"]
    assert q1 <= out["ratio_paired"] <= q3
    assert out["host_malloc"] == "tuned"  # the default train.cpu_malloc, for both models
    for row in out["results"]:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_mem_gb"] > 0
        assert len(row["step_times_s"]) == 4 and row["page_faults_per_step"] >= 0
