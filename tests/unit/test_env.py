"""``megaformer env``: every row of the issue-report table, on this machine and with a faked GPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megaformer.analysis import env
from tests.helpers import ROOT, assert_one_line_error, cli_main

ROWS = (
    "megaformer",
    "Python",
    "platform",
    "torch",
    "CUDA available",
    "cuDNN",
    "NCCL",
    "deepspeed",
    "flash-attn",
    "triton",
    "apex",
    "transformers",
    "GPUs",
    "C compiler",
    "native CPU kernels",
)


def test_env_prints_every_row():
    proc = cli_main("env")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    labels = [line[:20].strip() for line in lines]
    for row in ROWS:
        assert row in labels, (row, proc.stdout)
    assert "error:" not in proc.stdout, proc.stdout
    assert f"torch               {torch.__version__}" in proc.stdout
    # the kernel table: one line per op of the default model, as selection.format_plan writes it
    k = lines.index("kernels (cpu, float32):")
    ops = [line.split()[0] for line in lines[k + 1 :]]
    assert ops[:3] == ["linear", "projections", "attention"] and ops[-1] == "cross_entropy"


def test_env_kernels_follow_the_config():
    proc = cli_main("env", "--config", str(ROOT / "configs/gpt2-124m.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert (
        "layer_norm" in proc.stdout and "bias_gelu" in proc.stdout
    )  # GPT-2: LayerNorm, GELU + bias
    assert "rope" not in proc.stdout.split("kernels (")[1]
    assert_one_line_error(cli_main("env", "--config", str(ROOT / "nope.yaml")), "not found")


def test_gpu_rows_name_the_peak_table_entry(monkeypatch):
    props = {
        0: SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9, minor=0),
        1: SimpleNamespace(name="Some Future GPU", total_memory=2**30, major=12, minor=0),
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    (l0, r0), (l1, r1) = env.gpu_rows()
    assert (l0, l1) == ("GPU 0", "GPU 1")
    assert "80.0 GiB" in r0 and "peak table: H100" in r0 and "bf16 989.5" in r0, r0
    assert "not in the peak table" in r1, r1


def test_missing_compiler_is_a_row_not_a_traceback(monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    assert "not on PATH" in env.compiler_row()
