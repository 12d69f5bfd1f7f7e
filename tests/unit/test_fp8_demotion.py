"""Per-layer FP8 demotion (train.fp8_demote_threshold): a block whose FP8 numbers part from its
high-precision numbers is found and switched to high precision; a clean run demotes nothing; the
demoted blocks survive a checkpoint; the config refuses what cannot work.
"""

from __future__ import annotations

import json

import pytest
import torch

from megaformer.errors import ConfigError
from tests.helpers import cli_main, run_cli, step_records, tiny_model, tiny_overrides


def _faulty():
    """An FP8 GEMM whose input cast reports a scale 64x too small: X is read 64x too large."""
    from megaformer.parallel.fp8 import Fp8Matmul

    class Faulty(Fp8Matmul):
        def quantise(self, t, role, over, column_major=False):  # type: ignore[no-untyped-def]
            q, s = super().quantise(t, role, over, column_major)
            return (q, s / 64) if role == "input" else (q, s)

    return Faulty("tensorwise", True)


def _model(fault: bool):  # type: ignore[no-untyped-def]
    """A tiny FP8 model (3 blocks, emulated) and its AdamW, from one seed; ``fault``: block 1's
    q/k/v read their input through :func:`_faulty`."""
    from megaformer.model.transformer import Transformer
    from megaformer.parallel.fp8 import apply_fp8

    torch.manual_seed(0)
    model = Transformer(tiny_model(n_layers=3, n_kv_heads=2, max_seq_len=16), padded_vocab_size=40)
    apply_fp8(model, "tensorwise", True)
    if fault:
        bad = _faulty()
        for name in ("wq", "wk", "wv"):
            getattr(model.layers[1].attn, name).fp8 = bad
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _steps(model, opt, batches) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for ids in batches:
        opt.zero_grad()
        loss = model(ids, ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_a_faulty_block_is_demoted_at_the_next_pass_and_the_loss_then_tracks_high_precision():
    """A block whose input scale goes wrong is the one flagged, at the first diagnostics pass
    after the fault (intervals=1). From there, the demoted run's loss follows a high-precision
    run from the same weights and optimizer state within 1%, where the run left in FP8 does not."""
    import copy

    from megaformer.diagnostics.fp8_demotion import Fp8Demotion
    from megaformer.parallel.fp8 import demote

    gen = torch.Generator().manual_seed(1)
    probe = torch.randint(0, 37, (2, 16), generator=gen)
    batches = [torch.randint(0, 37, (4, 16), generator=gen) for _ in range(9)]
    model, opt = _model(fault=True)
    _steps(model, opt, batches[:3])
    undemoted = copy.deepcopy((model, opt))
    demotion = Fp8Demotion(threshold=0.25, intervals=1, n_layers=3)
    metrics = demotion(model, probe, None, 3)
    assert demotion.demoted == [1] and metrics["fp8_demoted/layer_01"] == 1.0
    assert metrics["fp8_gap/layer_01"] > 100 and metrics["fp8_gap/layer_00"] < 0.25
    hp = copy.deepcopy((model, opt))
    for block in hp[0].layers:
        demote(block)
    demoted, high, faulty = (_steps(*run, batches[3:]) for run in ((model, opt), hp, undemoted))
    for a, b in zip(demoted, high):
        assert abs(a - b) <= 0.01 * b, (demoted, high)
    assert max(abs(a - b) / b for a, b in zip(faulty, high)) > 0.01, (faulty, high)


def test_a_clean_fp8_run_demotes_nothing():
    from megaformer.diagnostics.fp8_demotion import Fp8Demotion

    gen = torch.Generator().manual_seed(1)
    probe = torch.randint(0, 37, (2, 16), generator=gen)
    model, opt = _model(fault=False)
    demotion = Fp8Demotion(threshold=0.25, intervals=1, n_layers=3)
    for step in range(3):
        _steps(model, opt, [torch.randint(0, 37, (4, 16), generator=gen) for _ in range(3)])
        demotion(model, probe, None, 3 * step + 3)
    assert demotion.demoted == []


def test_gaps_are_each_blocks_own():
    """Every block runs from the FP8 stream in both precisions: a fault in block 1 shows in
    block 1's gap, not in the later blocks' (which read the same faulty stream both times)."""
    from megaformer.diagnostics.fp8_demotion import layer_gaps

    model, _ = _model(fault=False)
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(2))
    clean = layer_gaps(model, ids, None)
    model.layers[1].attn.wq.fp8 = _faulty()
    gaps = layer_gaps(model, ids, None)
    assert max(clean) < 0.1 and gaps[1] > 1.0 and max(gaps[0], gaps[2]) < 0.1, (clean, gaps)


@pytest.mark.parametrize(
    "over,message",
    [
        (["train.fp8_demote_threshold=0.1"], "with train.fp8=off: there is no FP8 to demote"),
        (
            ["train.fp8=tensorwise", "train.fp8_emulate=true", "train.fp8_demote_threshold=0.1"],
            "needs log.diagnostics=true",
        ),
        (["train.fp8_demote_threshold=-1"], "train.fp8_demote_threshold=-1"),
    ],
)
def test_demotion_config_errors_are_one_line(over, message):
    from megaformer.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config("configs/quickstart.yaml", over)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_demoted_blocks_are_logged_checkpointed_resumed_and_reported(tmp_path):
    """`megaformer train` with a threshold no FP8 block can meet: every block is demoted at the
    first diagnostics pass (logged, in the metrics), meta.json lists them, a resumed run starts
    with them demoted, and `megaformer report` names them."""
    run = tmp_path / "run"
    common = tiny_overrides(
        **{
            "train.fp8": "tensorwise",
            "train.fp8_emulate": "true",
            "log.diagnostics": "true",
            "log.diagnostics_interval": 2,
            "train.fp8_demote_threshold": "1e-9",
            "train.fp8_demote_intervals": 1,
            "eval.interval": 0,
            "checkpoint.save_at_end": "true",
        }
    )
    first = run_cli(
        "train", "configs/quickstart.yaml", *common, "train.steps=4", "--run-dir", str(run)
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "block 0 switched to high precision at step 2" in first.stdout + first.stderr
    records = step_records(run)
    assert records[2]["fp8_demoted_layers"] == 2.0 and records[2]["fp8_demoted/layer_01"] == 1.0
    meta = json.loads(next(run.glob("checkpoints/step_*/meta.json")).read_text())
    assert meta["fp8_demoted"] == [0, 1]
    again = run_cli(
        "train", "configs/quickstart.yaml", *common, "train.steps=6", "--run-dir", str(run)
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "blocks (0, 1) run in high precision" in again.stdout + again.stderr
    assert step_records(run)[6]["fp8_demoted_layers"] == 2.0
    report = cli_main("report", str(run))
    assert report.returncode == 0, report.stderr
    summary = (run / "report" / "summary.md").read_text()
    assert "- layer_00 at step 2" in summary and "- layer_01 at step 2" in summary
