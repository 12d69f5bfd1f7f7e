"""Training logs TFLOP/s, MFU/HFU and peak memory; ``megaformer report`` plots a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaformer.analysis.report import load_records, write_report
from tests.helpers import assert_one_line_error, cli_main, run_cli, tiny_overrides


def _fake_run(folder: Path, n: int = 6, partial_last_line: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(1, n + 1):
        lines.append(
            json.dumps(
                {
                    "step": i,
                    "loss": 5.0 / i,
                    "lr": 1e-3,
                    "grad_norm": 1.0,
                    "tokens_per_s": 1000.0 + i,
                    "step_time_s": 0.1,
                    "tflops_per_gpu": 0.5,
                    "hw_tflops_per_gpu": 0.6,
                    "mfu": 0.25,
                    "hfu": 0.3,
                    "peak_mem_gb": 1.5,
                    "consumed_tokens": 100 * i,
                }
            )
        )
        if i % 3 == 0:
            lines.append(json.dumps({"step": i, "val_loss": 4.0 / i, "val_ppl": 2.0}))
    text = "\n".join(lines) + "\n"
    if partial_last_line:
        text += '{"step": 7, "loss": 0.'  # a write in progress
    (folder / "metrics.jsonl").write_text(text)
    return folder


def test_report_from_jsonl_in_progress(tmp_path):
    run = _fake_run(tmp_path / "run")
    records, _ = load_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[2]["val_loss"] == pytest.approx(4.0 / 3) and records[2]["loss"] == pytest.approx(
        5 / 3
    )
    r = write_report(run, tmp_path / "out")
    names = sorted(Path(p).name for p in r["plots"])
    assert names == [
        "loss.png",
        "lr.png",
        "memory.png",
        "mfu.png",
        "tflops_per_gpu.png",
        "tokens_per_s.png",
    ]
    for p in r["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = Path(r["summary"]).read_text()
    assert "| tokens/s | 1,004 |" in md  # median of steps 2..6 (first interval = warm-up)
    assert "| MFU | 25.00% |" in md


def test_report_cli_errors(tmp_path):
    assert_one_line_error(cli_main("report", str(tmp_path / "missing")), "not a run directory")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(cli_main("report", str(tmp_path / "empty")), "no metrics.jsonl")


@pytest.mark.slow
def test_training_logs_throughput_then_report(tmp_path):
    """A tiny CPU run logs tokens/s, TFLOP/s per GPU, MFU/HFU (peak given) and peak memory to
    metrics.jsonl and TensorBoard; report reads the events when metrics.jsonl is gone."""
    run = tmp_path / "run"
    r = run_cli(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(
            **{
                "train.steps": 4,
                "eval.interval": 0,
                "log.tensorboard": True,
                "log.peak_tflops": 0.5,
                "train.recompute": "none",
            }
        ),
        "--run-dir",
        str(run),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "TFLOP/s/GPU" in r.stdout and "MFU" in r.stdout and "FLOPs:" in r.stdout
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in recs if "loss" in x]
    assert len(train) == 4
    for x in train:
        assert x["tflops_per_gpu"] > 0 and x["hw_tflops_per_gpu"] >= x["tflops_per_gpu"]
        assert x["mfu"] == pytest.approx(x["tflops_per_gpu"] / 0.5)
        assert 0.05 < x["peak_mem_gb"] < 50
    (run / "metrics.jsonl").unlink()
    out = cli_main("report", str(run), "--out", str(tmp_path / "rep"))
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "tensorboard" in md and "MFU" in md
    assert (tmp_path / "rep" / "mfu.png").is_file()


def test_unknown_gpu_in_training_config_is_one_line_error():
    assert_one_line_error(
        cli_main("train", "configs/quickstart.yaml", "log.gpu=TPU-v9", "--dry-run"),
        "log.gpu",
        "unknown GPU",
    )


def _fake_diag_run(folder: Path, bump_step: int, bump_layer: int, bump: float) -> Path:
    """Loss 5/i and per-layer residual RMS / max logit, with layer ``bump_layer`` scaled by
    (1 + bump) from ``bump_step`` on (and the loss from the step after)."""
    folder.mkdir(parents=True)
    lines = []
    for i in range(1, 9):
        rec = {"step": i, "loss": 5.0 / i * (1 + bump if i > bump_step else 1.0)}
        for layer in range(3):
            f = 1 + bump if (i >= bump_step and layer >= bump_layer) else 1.0
            rec[f"resid/layer_{layer:02d}/rms"] = (1.0 + layer + 0.1 * i) * f
            rec[f"attn/layer_{layer:02d}/max_logit"] = 3.0 + layer
        lines.append(json.dumps(rec))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_report_of_two_runs_names_where_they_diverge(tmp_path):
    from megaformer.analysis.report import write_comparison

    a = _fake_diag_run(tmp_path / "bf16", 99, 0, 0.0)
    b = _fake_diag_run(tmp_path / "fp8", 5, 1, 0.08)
    r = write_comparison(a, b, threshold=0.05)
    d = r["divergence"]
    assert d["loss"]["first"]["step"] == 6 and d["loss"]["first"]["rel"] == pytest.approx(0.08)
    first = d["diag_resid_rms"]["first"]
    assert (first["step"], first["layer"]) == (5, "layer_01")
    assert first["a"] == pytest.approx(2.5) and first["b"] == pytest.approx(2.5 * 1.08)
    assert d["diag_resid_rms"]["points"] == 3 * 8
    assert d["diag_attn_max_logit"]["first"] is None and d["diag_attn_max_logit"]["largest"] == 0
    assert (
        write_comparison(a, b, tmp_path / "o", threshold=0.1)["divergence"]["loss"]["first"] is None
    )
    names = sorted(Path(p).name for p in r["plots"])
    assert names == [
        "compare_diag_attn_max_logit.png",
        "compare_diag_resid_rms.png",
        "compare_loss.png",
    ]
    md = Path(r["summary"]).read_text()
    assert Path(r["summary"]).parent == a / "compare_fp8"
    assert "| residual RMS | 24 | step 5, layer_01 | 2.5 | 2.7 | 8.00% | 8.00% |" in md
    out = cli_main("report", str(a), str(b), "--out", str(tmp_path / "cli"))
    assert out.returncode == 0, out.stderr
    assert (
        "residual RMS: first diverges at step 5, layer_01 (A 2.5, B 2.7, 8.00% > 5.0%)"
        in out.stdout
    )
    assert "max attention logit: within 5.0% at all 24 points" in out.stdout
    assert_one_line_error(cli_main("report", str(a), str(tmp_path / "nope")), "not a run directory")
    assert_one_line_error(cli_main("report", str(a), str(b), "--threshold", "0"), "--threshold")
