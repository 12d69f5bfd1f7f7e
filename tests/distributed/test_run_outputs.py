"""What a run leaves for others to read: file modes of checkpoint shards, the report's plots."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def test_checkpoint_shards_get_an_ordinary_files_mode(tmp_path):
    """safetensors creates its file 0600; a shard is readable as the run's other files are
    (0644 under the usual umask 022), so colleagues on a shared filesystem can load it."""
    import torch

    from megaformer.checkpoint.files import write_payload
    from megaformer.safe_files import current_umask

    path = tmp_path / "state" / "rank_00000.safetensors"
    write_payload(path, {"w": torch.ones(2)})
    write_payload(tmp_path / "index.json", "{}")
    expected = 0o666 & ~current_umask()
    assert oct(path.stat().st_mode & 0o777) == oct(expected)
    assert oct((tmp_path / "index.json").stat().st_mode & 0o777) == oct(expected)


def test_report_memory_from_zero_and_loss_with_unigram_baseline(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from megaformer.analysis.report import write_report

    rows = []
    for i in range(1, 7):
        rows.append({"step": i, "loss": 5.0 / i, "peak_mem_gb": 10.0 + 0.1 * i})
        if i % 3 == 0:
            rows.append({"step": i, "val_loss": 4.0 / i, "val_ppl": 2.0, "unigram_baseline": 3.25})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen: dict[str, Figure] = {}
    save = Figure.savefig
    monkeypatch.setattr(
        Figure,
        "savefig",
        lambda fig, path, *a, **k: (
            seen.__setitem__(Path(path).stem, fig),
            save(fig, path, *a, **k),
        )[1],
    )
    write_report(tmp_path, tmp_path / "out")
    assert seen["memory"].axes[0].get_ylim()[0] == 0.0
    ax = seen["loss"].axes[0]
    flat = [line for line in ax.get_lines() if line.get_label() == "unigram baseline"]
    assert len(flat) == 1 and list(flat[0].get_ydata()) == [3.25, 3.25]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "train",
        "validation",
        "unigram baseline",
    ]
    assert os.path.exists(tmp_path / "out" / "loss.png")


def test_known_third_party_noise_is_dropped(caplog):
    import logging

    from megaformer.cli import quiet_known_noise

    quiet_known_noise()
    quiet_known_noise()  # idempotent
    assert len(logging.getLogger("torchao").filters) == 1
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C.so: undefined symbol")
        logging.getLogger("lm_eval.api.task").warning(
            "t: Custom kwargs can be passed to `--metadata` in console (as json string)"
        )
        logging.getLogger("torchao").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
