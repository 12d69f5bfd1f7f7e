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
        lines.append(json.dumps({"step": i, "loss": 5.0 / i, "lr": 1e-3, "grad_norm": 1.0,
                                 "tokens_per_s": 1000.0 + i, "step_time_s": 0.1,
                                 "tflops_per_gpu": 0.5, "hw_tflops_per_gpu": 0.6, "mfu": 0.25,
                                 "hfu": 0.3, "peak_mem_gb": 1.5, "consumed_tokens": 100 * i}))
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
    assert records[2]["val_loss"] == pytest.approx(4.0 / 3) and records[2]["loss"] == pytest.approx(5 / 3)
    r = write_report(run, tmp_path / "out")
    names = sorted(Path(p).name for p in r["plots"])
    assert names == ["loss.png", "lr.png", "memory.png", "mfu.png", "tflops_per_gpu.png",
                     "tokens_per_s.png"]
    for p in r["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = Path(r["summary"]).read_text()
    assert "| tokens/s | 1,004 |" in md   # median of steps 2..6 (first interval = warm-up)
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
    r = run_cli("train", "configs/quickstart.yaml", *tiny_overrides(**{
        "train.steps": 4, "eval.interval": 0, "log.tensorboard": True, "log.peak_tflops": 0.5,
        "train.recompute": "none"}), "--run-dir", str(run))
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
    assert_one_line_error(cli_main("train", "configs/quickstart.yaml", "log.gpu=TPU-v9", "--dry-run"),
                          "log.gpu", "unknown GPU")
