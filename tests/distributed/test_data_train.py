"""Training on data.paths: a prepared prefix blended with a source prepared on the fly; exact resume."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import assert_one_line_error, cli_main, run_cli, tiny_overrides

pytestmark = pytest.mark.slow


def losses(run_dir):
    return {
        r["step"]: r["loss"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    }


def test_train_on_paths_blend_and_resume_exactly(tmp_path, text_corpus):
    prep = cli_main(
        "prepare-data",
        "--input",
        str(text_corpus),
        "--tokenizer",
        "bpe:300",
        "--output-prefix",
        str(tmp_path / "a"),
    )
    assert prep.returncode == 0, prep.stderr[-2000:]
    tok = tmp_path / "a.tokenizer.json"
    args = tiny_overrides(
        **{
            "data.paths": f"[{tmp_path / 'a'},{text_corpus}]",
            "data.weights": "[0.4,0.6]",
            "data.tokenizer": str(tok),
            "data.cache_dir": str(tmp_path / "cache"),
            "train.steps": 4,
            "eval.interval": 2,
            "checkpoint.interval": 2,
        }
    )
    run = tmp_path / "run"
    proc = run_cli("train", "configs/quickstart.yaml", *args, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "data: 2 dataset(s)" in proc.stdout and "weights [0.400, 0.600]" in proc.stdout
    assert list((tmp_path / "cache" / "prepared").glob("*/data.idx"))  # the source, prepared once
    meta = json.loads((run / "checkpoints" / "step_0000004" / "meta.json").read_text())
    assert meta["consumed_samples"] == 32
    # stop after step 2, resume: steps 3-4 equal the uninterrupted run (cache reused)
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_0000004")
    (resumed / "checkpoints" / "latest").write_text("step_0000002\n")
    again = run_cli("train", "configs/quickstart.yaml", *args, "--run-dir", str(resumed))
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "data: prepared" not in again.stdout and "resumed from" in again.stdout
    a, b = losses(run), losses(resumed)
    assert [b[s] for s in (3, 4)] == [a[s] for s in (3, 4)]
    # another blend would make the saved position index another stream: refused, nothing written
    before = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    other = [a.replace("[0.4,0.6]", "[0.5,0.5]") for a in args]
    changed = cli_main(
        "train", "configs/quickstart.yaml", *other, "train.steps=6", "--run-dir", str(resumed)
    )
    assert_one_line_error(changed, "data.weights=[0.5, 0.5] differs from the checkpoint")
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == before


def test_paths_errors_are_one_line(tmp_path):
    bad = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"data.paths": f"[{tmp_path / 'missing.jsonl'}]"}),
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert_one_line_error(bad, "missing.jsonl: no such file")
    bad = cli_main(
        "train",
        "configs/quickstart.yaml",
        *tiny_overrides(**{"data.paths": "[a,b]", "data.weights": "[1]"}),
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert_one_line_error(bad, "data.weights=[1.0]: needs one weight per data.paths entry (2)")
